"""Run on 2 ranks: rank 1 raises mid-training while rank 0 waits; the job must end, not hang."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import hyparflow as hf  # noqa: E402
import models  # noqa: E402


def explode(batch, logs):
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 1 and batch == 1:
        raise RuntimeError("injected failure on rank 1")


import keras  # noqa: E402

model = models.chain(n=3)
model.compile(optimizer="sgd", loss="mse")
hf.fit(model, np.zeros((64, 5)), np.zeros((64, 3)), partitions=2, batch_size=8, verbose=0,
       callbacks=[keras.callbacks.LambdaCallback(on_train_batch_begin=explode)])
