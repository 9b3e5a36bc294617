"""CSVLogger + TerminateOnNaN (Keras' csv_logger_test test_stop_training_csv) at 1x2.

Keras: when training stops on a NaN loss, CSVLogger has written the header and a row with
"nan" when model.fit returns. hyparflow: CSVLogger runs on the logging rank only; this
script reads the file on every rank right after hf.fit returns, then again after a barrier.

Before the change below (HEAD 0b9ab29 or earlier): 3 of 3 runs, rank 1 read [] (an empty file)
right after hf.fit, the complete file after a barrier. Status: an uncommitted change to
hyparflow/api.py (made during this measurement: every rank waits at the end of hf.fit for the
logging rank to close its files) makes both ranks read the complete file (3 of 3 runs).

Run: mpiexec -n 2 python repro/csvlogger_terminate_on_nan.py
"""
import hyparflow as hf  # isort: skip  (before TensorFlow)

import csv
import os
import tempfile

import keras
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
folder = comm.bcast(tempfile.mkdtemp() if rank == 0 else None)
path = os.path.join(folder, "csv_logger.csv")
np.random.seed(1337)
x = np.random.random((10, 3))
y = keras.utils.to_categorical(np.random.choice(np.arange(2), size=10))
xv = np.random.random((10, 3))
yv = keras.utils.to_categorical(np.random.choice(np.arange(2), size=10))
model = keras.Sequential([keras.Input((3,))] + [
    keras.layers.Dense(2, activation="relu", kernel_initializer=keras.initializers.Constant(1e5))
    for _ in range(5)] + [keras.layers.Dense(2)])
model.compile(loss="mean_squared_error", optimizer="sgd")
history = hf.fit(model, x, y, replicas=comm.Get_size(), batch_size=4, validation_data=(xv, yv),
                 callbacks=[keras.callbacks.TerminateOnNaN(), keras.callbacks.CSVLogger(path)],
                 epochs=20)  # verbose="auto", as in the test


def rows():
    if not os.path.exists(path):
        return "missing"
    with open(path) as f:
        return [r for r in csv.reader(f) if r]


now = rows()
comm.Barrier()
later = rows()
for r in range(comm.Get_size()):
    if r == rank:
        print(f"rank {rank}: loss {history.history['loss']}; right after hf.fit: {now}; "
              f"after a barrier: {later}", flush=True)
    comm.Barrier()
