"""A layer that updates its own state in call() (a counter), trained at 2x1.

Keras (backup_and_restore_test CanaryLayer): the counter grows by one per batch under
model.fit. hyparflow at P=2 cuts each batch into micro-batches (default m=2 here), so the
layer is called once per micro-batch and its state moves m times per step: 12 instead of
6 in Keras' test. With microbatches=1 it matches. (README documents this for
BatchNormalization's moving statistics; any other state a layer updates in call() is
affected alike, silently.)

Run: python repro/stateful_layer_call_count.py                   (model.fit)
     mpiexec -n 2 python repro/stateful_layer_call_count.py      (hf.fit 2x1, m default and 1)
"""
import hyparflow as hf  # isort: skip  (before TensorFlow)

import keras
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD


class Canary(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.counter = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x):
        self.counter.assign_add(1)
        return x


def make():
    model = keras.Sequential([keras.Input((3,)), Canary(), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    return model


rng = np.random.RandomState(0)
x, y = rng.rand(10, 3), rng.rand(10, 1)  # 3 batches of 4, 4, 2 per epoch
if comm.Get_size() == 1:
    model = make()
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    print("model.fit: counter after 2 epochs of 3 batches =", int(model.layers[0].counter.value))
else:
    for m in (None, 1):
        model = make()
        hf.fit(model, x, y, partitions=2, batch_size=4, epochs=2, verbose=0, microbatches=m)
        if comm.Get_rank() == 0:
            print(f"hf.fit 2x1, microbatches={m}: counter after 2 epochs of 3 batches =",
                  int(model.layers[0].counter.value), flush=True)
