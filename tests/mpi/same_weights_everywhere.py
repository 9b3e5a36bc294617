"""Run on 4 ranks (P=2, R=2) with BatchNormalization: afterwards every rank holds the same model."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import hyparflow as hf  # noqa: E402

import keras  # noqa: E402
from mpi4py import MPI  # noqa: E402

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
hf.fit(model, rng.normal(size=(64, 6)), rng.normal(size=(64, 2)), partitions=2, replicas=2,
       batch_size=16, epochs=1, verbose=0, balance="layers")
everyone = MPI.COMM_WORLD.allgather(model.get_weights())
for r, weights in enumerate(everyone):
    for w, v, ref in zip(model.weights, weights, everyone[0]):
        np.testing.assert_allclose(v, ref, rtol=1e-6, atol=1e-7,
                                   err_msg=f"{w.path} on rank {r} differs from rank 0")
if MPI.COMM_WORLD.Get_rank() == 0:
    print("SAME WEIGHTS ON ALL RANKS", flush=True)
