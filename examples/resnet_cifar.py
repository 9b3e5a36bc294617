"""Train a CIFAR ResNet (v1, or the pre-activation v2 of ResNet-1001) on random CIFAR-shaped data
with hyparflow and report images/s.

Run it on partitions × replicas ranks, for example::

    hyparflow-run -n 4 .venv/bin/python examples/resnet_cifar.py --partitions 2 --replicas 2 \
        --depth 20 --epochs 2 --samples 512
"""

import argparse
import os
import sys
import time

import hyparflow as hf  # before TensorFlow, so that each rank's thread share applies

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import keras
import numpy as np
from mpi4py import MPI

from benchmarks.models import resnet_v1, resnet_v2


class EpochTimer(keras.callbacks.Callback):
    """Wall-clock seconds of each epoch."""

    def __init__(self):
        super().__init__()
        self.seconds = []
        self._start = None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--model", default="v1", choices=("v1", "v2"),
                        help="ResNet v1 (depth 6n+2) or pre-activation bottleneck v2 (depth "
                             "3k+2, e.g. 164, 1001, 5000); default v1")
    parser.add_argument("--depth", type=int, default=56, help="ResNet depth (default 56)")
    parser.add_argument("--partitions", type=int, default=1, help="pipeline stages P")
    parser.add_argument("--replicas", type=int, default=1, help="pipeline copies R")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="micro-batches per replica's share (default: hyparflow's choice)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=1024, help="random training images")
    parser.add_argument("--balance", default="flops",
                        help='how to cut the model: "flops" (the default), "layers", "params", '
                             '"time", "memory", or comma-separated layer counts per stage')
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the weights")
    parser.add_argument("--trace", default=None,
                        help="write the per-rank timeline here (draw it with "
                             "python -m hyparflow.trace FILE -o FILE.png)")
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    parser.add_argument("--backup", default=None,
                        help="keep the training state in this directory (BackupAndRestore): "
                             "a job stopped by SIGUSR1 or SIGTERM saves there and exits with "
                             "75, and the same command resumes it at the next step")
    parser.add_argument("--verbose", type=int, default=1, choices=(0, 1, 2),
                        help="Keras progress output, printed by one rank (default 1)")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs {args.epochs}: train for at least one epoch")
    if args.samples < 1:
        parser.error(f"--samples {args.samples}: need at least one sample")
    if "," in args.balance or args.balance.isdigit():
        args.balance = [int(c) for c in args.balance.split(",")]
    return args


def cifar_like(samples, seed):
    """Random 32×32×3 float32 images in [0, 1) and labels of 10 classes."""
    rng = np.random.default_rng(seed)
    x = rng.random((samples, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=samples).astype(np.int32)
    return x, y


def main(argv=None):
    args = parse_args(argv)
    x, y = cifar_like(args.samples, args.seed)
    keras.utils.set_random_seed(args.seed)  # the same initial weights on every rank
    model = (resnet_v1 if args.model == "v1" else resnet_v2)(args.depth)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    timer = EpochTimer()
    callbacks = [timer]
    if args.backup:
        callbacks.append(keras.callbacks.BackupAndRestore(args.backup))
    history = hf.fit(model, x, y, partitions=args.partitions, replicas=args.replicas,
                     microbatches=args.microbatches, batch_size=args.batch_size,
                     epochs=args.epochs, verbose=args.verbose, shuffle=True,
                     balance=args.balance, schedule=args.schedule,
                     callbacks=callbacks + ([hf.Trace(args.trace)] if args.trace else []))

    if MPI.COMM_WORLD.Get_rank() != 0:  # every rank holds the same History
        return
    if len(timer.seconds) > 1:
        seconds, epochs, which = sum(timer.seconds[1:]), len(timer.seconds) - 1, \
            "excluding the first epoch"
    else:
        seconds, epochs, which = timer.seconds[0], 1, "including the first epoch (graph tracing)"
    print(f"{model.name}: partitions={args.partitions} replicas={args.replicas} "
          f"microbatches={args.microbatches or 'default'} batch_size={args.batch_size} "
          f"samples={args.samples} epochs={len(timer.seconds)} ranks={MPI.COMM_WORLD.Get_size()}")
    print(f"throughput: {args.samples * epochs / seconds:.1f} images/s ({which}); "
          f"epoch times: {', '.join(f'{s:.2f}s' for s in timer.seconds)}")
    print(f"final loss: {history.history['loss'][-1]:.4f}, "
          f"accuracy: {history.history['accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
