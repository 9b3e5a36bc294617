"""Run on 4 ranks (P=2, R=2) with BatchNormalization: afterwards every rank holds the same model.

The ranks build the model with different weights (all must start from rank 0's), and
EarlyStopping restores the best epoch's weights at the end: what it kept on each rank
must be the whole model of that epoch, not this rank's stage alone. TensorBoard writes
from one rank (argv[1]: its log folder), the whole model's weights too at each epoch's end
(embeddings_freq=1: a save every rank takes part in).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import hyparflow as hf  # isort: skip  (before TensorFlow)

import keras
from mpi4py import MPI

keras.utils.set_random_seed(MPI.COMM_WORLD.Get_rank())  # different initial weights per rank
x = keras.Input((6,), name="x")
h = keras.layers.Dense(8, name="d1")(x)
h = keras.layers.BatchNormalization(name="bn1")(h)
h = keras.layers.Activation("relu", name="r1")(h)
h = keras.layers.Dense(8, name="d2")(h)
h = keras.layers.BatchNormalization(name="bn2")(h)
out = keras.layers.Dense(2, name="out")(h)
model = keras.Model(x, out)
model.compile(optimizer="adam", loss="mse")
rng = np.random.default_rng(0)
stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True,
                                     start_from_epoch=1)
# Validation targets are the opposite of what training teaches: once the model learns,
# val_loss rises and EarlyStopping stops and restores an earlier epoch, whatever the start.
x_train, x_val = rng.normal(size=(64, 6)), rng.normal(size=(32, 6))
history = hf.fit(model, x_train, 2 * x_train[:, :2], partitions=2,
                 replicas=2, batch_size=16, epochs=8, verbose=0, balance="layers",
                 validation_data=(x_val, -2 * x_val[:, :2]),
                 callbacks=[keras.callbacks.ReduceLROnPlateau(patience=1, factor=0.5),
                            stop, keras.callbacks.TensorBoard(sys.argv[1], embeddings_freq=1)])
assert stop.stopped_epoch > 0 and stop.best_epoch < len(history.history["loss"]) - 1, (
    "the test needs a run that stops early and restores an earlier epoch",
    history.history["val_loss"])
everyone = MPI.COMM_WORLD.allgather(model.get_weights())
for r, weights in enumerate(everyone):
    for w, v, ref in zip(model.weights, weights, everyone[0]):
        np.testing.assert_allclose(v, ref, rtol=1e-6, atol=1e-7,
                                   err_msg=f"{w.path} on rank {r} differs from rank 0")
if MPI.COMM_WORLD.Get_rank() == 0:
    print("SAME WEIGHTS ON ALL RANKS", flush=True)
    print(f"EPOCHS {len(history.history['loss'])}", flush=True)
    last = os.path.join(sys.argv[1], "train",
                        f"keras_embedding.ckpt-{len(history.history['loss']) - 1}.weights.h5")
    keras.models.clone_model(model).load_weights(last)  # the whole model's, in Keras' format
