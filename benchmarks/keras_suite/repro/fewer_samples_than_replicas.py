"""hf.fit on a data set with fewer samples than replicas (batch_size larger than the data).

Keras: model.fit on one sample trains one step. hyparflow at 1x2: hf.fit's check refuses
batch_size=1 < replicas=2 with a clear error, but batch_size=32 on one sample passes the check;
replica 1 then gets no sample in the only step and the job hangs until the watchdog ends it
(here timeout=20 s): "rank 1 ... waited 20 s ... for the allreduce of the step's loss and
metrics". A smaller *last* batch of one sample works (3 samples, batch_size=2 trains).
Keras tests: terminate_on_nan_test test_raise_error_terminate_does_not_trigger_on_train_end,
test_raise_error_terminate_preserves_backup (one sample, TerminateOnNaN(raise_error=True):
model.fit raises RuntimeError; at 1x2 the job is ended by the watchdog instead).

Status: hf.fit at 1x2 now trains it as model.fit does ({'loss': [4.0]} on both ranks,
2026-11-28): a replica without samples takes part with none. (Before: the hang above, then a
refusal "x has 1 sample, fewer than replicas=2".)

Run: python repro/fewer_samples_than_replicas.py                 (model.fit)
     mpiexec -n 2 python repro/fewer_samples_than_replicas.py    (hf.fit, 1x2)
"""
import hyparflow as hf  # isort: skip  (before TensorFlow)

import keras
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")])
model.compile(optimizer="sgd", loss="mse")
x, y = np.ones((1, 1)), np.full((1, 1), 3.0)
if comm.Get_size() == 1:
    print("model.fit, 1 sample:", model.fit(x, y, verbose=0).history, flush=True)
else:
    history = hf.fit(model, x, y, replicas=comm.Get_size(), verbose=0, timeout=20)
    print(f"rank {comm.Get_rank()}, hf.fit 1x{comm.Get_size()}, 1 sample:", history.history,
          flush=True)
