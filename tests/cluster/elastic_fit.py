"""Run across the box under `hyparflow-run --elastic`: an hf.fit at P × R (2 × 2 by default; the
arguments: P R, "norm" for a synchronized BatchNormalization, "twice" for rank 2 to die while the
job goes on in place after a loss) that lasts (a pause per step),
saying each step it ends and its process; at the end rank 0 trains the same model with model.fit
and prints the largest weight difference (SGD with momentum: equal up to rounding)."""

import os
import signal
import sys
import time

import hyparflow as hf  # isort: skip  (before TensorFlow)
import keras
import numpy as np
from mpi4py import MPI

EPOCHS, BATCH = 6, 16


def build(norm=False):
    keras.utils.set_random_seed(0)
    # (synchronized: the moments of the whole batch, as model.fit's, over the replicas)
    normalized = [keras.layers.BatchNormalization(synchronized=True, name="bn")] if norm else []
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh",
                                                                    name="d0"),
                              *normalized,
                              keras.layers.Dense(8, activation="tanh", name="d1"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def main():
    rank = MPI.COMM_WORLD.Get_rank()
    x = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
    y = np.tanh(x[:, :3] * 2.0)
    epoch_now = [None]

    def said(batch, logs):
        print(f"STEP {epoch_now[0]} {batch} ON {MPI.Get_processor_name()} RANK {rank} OF "
              f"{MPI.COMM_WORLD.Get_size()} PID {os.getpid()}", flush=True)
        time.sleep(0.3)

    norm = "norm" in sys.argv[3:]
    if "twice" in sys.argv[3:] and rank == 2:  # (a fault during the recovery: rank 2 dies in it)
        from hyparflow.training import elastic

        def dies(*args, **kwargs):
            print(f"KILLED IN RECOVERY RANK {rank}", flush=True)
            time.sleep(1)  # (the line forwarded to the launcher before the process dies)
            os.kill(os.getpid(), signal.SIGKILL)

        elastic._stage_state = dies
    model = build(norm)
    P, R = (int(v) for v in sys.argv[1:3]) if len(sys.argv) > 2 else (2, 2)
    # (a BatchNormalization trains as model.fit's at one micro-batch a step; at several, each
    # normalizes by its own moments: "works, differently")
    said_each_step = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: epoch_now.__setitem__(0, epoch),
        on_train_batch_end=said)
    hf.fit(model, x, y, partitions=P, replicas=R, batch_size=BATCH, epochs=EPOCHS, verbose=0,
           microbatches=1 if norm else None, shuffle=False, callbacks=[said_each_step])
    if rank == 0:
        build(norm).fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # (warm-up)
        oracle = build(norm)
        oracle.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        gap = max(float(np.max(np.abs(a - b)))
                  for a, b in zip(oracle.get_weights(), model.get_weights()))
        print(f"ORACLE GAP {gap:.3g} ON {MPI.COMM_WORLD.Get_size()} RANKS", flush=True)
    print(f"FINISHED {rank} {os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
