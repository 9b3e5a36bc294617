"""Run under mpiexec: examples/digits.py trained by hf.fit at (P, R) vs single-process Keras.

Every rank trains the example's ResNet (BatchNormalization included) with hf.fit and
evaluates it with hf.evaluate; rank 0 then trains the same model from the same initial
weights with model.fit on the same data and batch size (both shuffle every epoch, each
with its own order) and prints both test accuracies. BatchNormalization's batch statistics
are per micro-batch under hyparflow, so the accuracies are compared, not the weights.
"""

import argparse
import importlib.util
import os
import time

import hyparflow as hf  # noqa: F401  # isort: skip  (before TensorFlow: one thread per rank)

import numpy as np
from mpi4py import MPI

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                       "examples", "digits.py")


def load_example():
    spec = importlib.util.spec_from_file_location("digits_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--partitions", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    digits = load_example()
    rank = MPI.COMM_WORLD.Get_rank()

    start = time.monotonic()
    ours = digits.main(["--partitions", str(args.partitions), "--replicas", str(args.replicas),
                        "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                        "--seed", str(args.seed)])
    hf_seconds = time.monotonic() - start
    if rank != 0:
        return

    (x_train, y_train), (x_test, y_test) = digits.load_digits()
    steps = args.epochs * -(-len(x_train) // args.batch_size)
    reference = digits.build_model(args.seed, steps)
    # The same initial weights as the model hf.fit started from (rebuilt with the same seed).
    again = digits.build_model(args.seed, steps)
    for a, b in zip(reference.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(a, b)
    start = time.monotonic()
    reference.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                  shuffle=True, validation_data=(x_test, y_test), verbose=0)
    _, theirs = reference.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    keras_seconds = time.monotonic() - start
    print(f"DIGITS P={args.partitions} R={args.replicas} seed={args.seed} "
          f"hyparflow={ours:.4f} keras={theirs:.4f} diff={ours - theirs:+.4f} "
          f"hf_seconds={hf_seconds:.1f} keras_seconds={keras_seconds:.1f}", flush=True)


if __name__ == "__main__":
    main()
