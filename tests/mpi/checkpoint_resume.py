"""Run under mpiexec: train with Keras callbacks and checkpoints; be killed while saving; resume.

    checkpoint_resume.py DIR --partitions 2 --replicas 2 --mode full
        4 epochs with ModelCheckpoint (DIR/ckpt.keras every epoch), BackupAndRestore
        (DIR/backup), CSVLogger and LearningRateScheduler; then hf.save(DIR/full.keras).
    checkpoint_resume.py DIR ... --mode killed
        the same, but the writing rank is SIGKILLed inside the save of epoch 3,
        after the new file is written and before it replaces DIR/ckpt.keras.
    checkpoint_resume.py DIR ... --mode resume
        load DIR/ckpt.keras with plain Keras on every rank, continue from the
        epoch it holds to epoch 4 at this P × R; then hf.save(DIR/resumed.keras).
    checkpoint_resume.py DIR ... --mode restore
        a new model and the same callbacks: BackupAndRestore restores DIR/backup and
        training continues from its epoch; then hf.save(DIR/restored.keras).
    checkpoint_resume.py DIR ... --mode preempted
        the same as full, but the last rank sends itself SIGUSR1 after the first
        step of epoch 2 (as a batch system warns a job): every rank stops at the
        next step boundary, BackupAndRestore writes DIR/backup, exit code 75.
    checkpoint_resume.py DIR ... --mode elastic
        as full under `hyparflow-run --elastic` (no BackupAndRestore: the elastic job's own),
        the last rank (or --kill-rank) killed (SIGKILL) after the second step of epoch 2 the
        first time (while
        DIR/elastic-died does not exist); the others go on in place (where every stage has a
        copy left), or the launcher runs the job again, which resumes from its backup; then
        hf.save(DIR/elastic.keras).
    checkpoint_resume.py DIR ... --mode signalled
        as restore, every rank printing each step and pausing 3 s after the first
        step of epoch 3: the time for a test to signal hyparflow-run.
"""

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import hyparflow as hf

EPOCHS, BATCH, STEPS, SEED = 4, 16, 3, 7


def build():
    import keras

    import models

    model = models.residual()  # its initial weights come from the script's seed
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--partitions", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--mode", required=True,
                   choices=["full", "killed", "resume", "restore", "preempted", "signalled",
                            "elastic"])
    p.add_argument("--kill-rank", type=int, help="the rank --mode elastic kills (the last)")
    p.add_argument("--shard", action="store_true",
                   help="hf.fit(shard_optimizer=True): Adam's state split over the replicas")
    args = p.parse_args()

    import keras
    from mpi4py import MPI

    from hyparflow.training import checkpoint

    rank = MPI.COMM_WORLD.Get_rank()
    keras.utils.set_random_seed(SEED)  # as a script would: hf.fit's shuffling seed too
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 5)).astype("float32")
    y = rng.integers(0, 3, size=BATCH * STEPS)
    ckpt = os.path.join(args.dir, "ckpt-elastic.keras" if args.mode == "elastic" else "ckpt.keras")
    initial_epoch = 0
    if args.mode == "resume":
        model = keras.models.load_model(ckpt)
        initial_epoch = int(model.optimizer.iterations.numpy()) // STEPS
        print(f"RESUMING AT EPOCH {initial_epoch}", flush=True)
    else:
        model = build()
    if args.mode == "killed":
        real = checkpoint.replace

        def replace(tmp, path):
            if path == ckpt and os.path.exists(path) and killed_epoch[0] == 2:
                print(f"KILLED WHILE SAVING {tmp}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            real(tmp, path)

        killed_epoch = [None]
        checkpoint.replace = replace
    callbacks = [
        # monitor="accuracy": every rank must know the metric to tell its direction
        keras.callbacks.ModelCheckpoint(ckpt, monitor="accuracy"),
        keras.callbacks.CSVLogger(os.path.join(args.dir, f"log-{args.mode}.csv")),
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: 1e-2 * 0.5 ** epoch),
    ]
    if args.mode not in ("resume", "elastic"):
        callbacks.append(keras.callbacks.BackupAndRestore(os.path.join(args.dir, "backup")))
    if args.mode == "elastic":
        died = os.path.join(args.dir, "elastic-died")
        epoch_now = [None]

        def die(batch, logs):
            chosen = rank == (MPI.COMM_WORLD.Get_size() - 1 if args.kill_rank is None
                              else args.kill_rank)
            if (epoch_now[0], batch) == (1, 1) and chosen and not os.path.exists(died):
                open(died, "w").close()
                print(f"KILLING RANK {rank}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        callbacks.append(keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: epoch_now.__setitem__(0, epoch),
            on_train_batch_end=die))
    if args.mode == "killed":
        callbacks.append(keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: killed_epoch.__setitem__(0, epoch)))
    if args.mode in ("preempted", "signalled"):
        epoch_now = [None]

        def warn(batch, logs):
            print(f"STEP {epoch_now[0]} {batch} ON RANK {rank}", flush=True)
            if args.mode == "signalled" and (epoch_now[0], batch) == (2, 0):
                time.sleep(3)
            elif (epoch_now[0], batch) == (1, 0) and rank == MPI.COMM_WORLD.Get_size() - 1:
                os.kill(os.getpid(), signal.SIGUSR1)

        callbacks.append(keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: epoch_now.__setitem__(0, epoch),
            on_train_batch_end=warn))
    hf.fit(model, x, y, partitions=args.partitions, replicas=args.replicas, batch_size=BATCH,
           epochs=EPOCHS, initial_epoch=initial_epoch, verbose=0,
           callbacks=callbacks, shard_optimizer=args.shard)
    if args.mode == "full":  # the logging rank's file is complete when fit returns anywhere
        with open(os.path.join(args.dir, "log-full.csv")) as f:
            print(f"CSV ON RANK {rank}: {len(f.read().splitlines())} lines", flush=True)
    name = {"full": "full.keras", "resume": "resumed.keras", "restore": "restored.keras",
            "preempted": "never.keras", "signalled": "never.keras",
            "elastic": "elastic.keras"}[args.mode]
    hf.save(model, os.path.join(args.dir, name))
    print(f"SAVED {name} ON RANK {rank}", flush=True)


if __name__ == "__main__":
    main()
