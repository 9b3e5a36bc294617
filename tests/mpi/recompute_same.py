"""Run on 2 ranks: recompute=True gives the weights recompute=False gives,
BN and dropout included; so does balance="time", whose measuring on rank 0 runs the
model's layers in training mode (BatchNormalization's statistics, dropout's seed).
Afterwards every rank holds each dropout layer's random state as its stage left it."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import hyparflow as hf  # isort: skip  (before TensorFlow)

import keras
from mpi4py import MPI


def build():
    keras.utils.set_random_seed(5)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, name="d1")(x)
    h = keras.layers.BatchNormalization(name="bn1")(h)
    h = keras.layers.Dropout(0.3, name="drop1")(keras.layers.Activation("relu", name="r1")(h))
    h = keras.layers.Dense(16, name="d2")(h)
    h = keras.layers.BatchNormalization(name="bn2")(h)
    h = keras.layers.Dropout(0.3, name="drop2")(h)
    out = keras.layers.Dense(2, name="out")(h)
    model = keras.Model(x, out)
    model.compile(optimizer="adam", loss="mse")
    return model


rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 6)), rng.normal(size=(64, 2))
results = []
for recompute, balance in ((False, ["d2"]), (True, ["d2"]), (False, "time")):
    model = build()
    history = hf.fit(model, x, y, partitions=2, batch_size=16, epochs=2, verbose=0,
                     shuffle=False, balance=balance, microbatches=4, recompute=recompute)
    results.append((model.get_weights(), history.history["loss"]))
    # each dropout layer drew on its stage's rank only, once per micro-batch (8 steps of 4):
    # afterwards every rank holds that state (a later call at another P would draw from it)
    states = [model.get_layer(name).seed_generator.state.numpy().tolist()
              for name in ("drop1", "drop2")]
    everyone = MPI.COMM_WORLD.allgather(states)
    assert all(s == states for s in everyone), everyone
    assert [counter for _, counter in states] == [32, 32], states
(plain, plain_loss), *others = results
for (again, again_loss), what in zip(others, ("recompute", 'balance="time"')):
    np.testing.assert_allclose(again_loss, plain_loss, rtol=1e-5, atol=1e-6, err_msg=what)
    for w, a, b in zip(build().weights, plain, again):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=f"{what}: {w.path}")
if MPI.COMM_WORLD.Get_rank() == 0:
    print("RECOMPUTE MATCHES", plain_loss, flush=True)
