"""What a sample costs in micro-batches against the whole batch, in one process, one thread.

    .venv/bin/python benchmarks/microbatch.py [--depth 110] [--batch 64] [--micro 8 16 32]

A pipeline of m micro-batches of b computes the same samples as one process's batch
of m·b, in m calls per stage instead of one. This times, compiled, ResNet v1's
forward and its forward + backward (gradients of every weight, no optimizer step) at
the whole batch and as m calls of b; then, at each of the network's three map sizes, the
ops a 3×3 convolution layer runs (convolution; its input and filter gradients;
fused BatchNormalization and its gradient; ReLU's gradient), each at micro-batch b
against the whole batch, per sample. Medians of `--reps` timings after a warm-up.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402 (no TensorFlow yet)


def _median(run, reps):
    """Median seconds of `run()` (which returns tensors, read back) after one warm-up call."""
    import tensorflow as tf

    def once():
        start = time.perf_counter()
        for t in tf.nest.flatten(run()):
            t.numpy()
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(reps))


def whole_model(depth, batch, micro, reps):
    """{"forward"/"forward+backward": (seconds at the whole batch, seconds as m calls)}."""
    import keras
    import tensorflow as tf

    from benchmarks.models import resnet_v1

    keras.utils.set_random_seed(0)
    model = resnet_v1(depth)
    loss = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def forward(x):
        return model(x, training=True)

    @tf.function
    def forward_backward(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        return tape.gradient(value, model.trainable_variables)

    x = tf.random.normal((batch, 32, 32, 3), seed=1)
    y = tf.zeros((batch,), tf.int32)
    parts = [(x[k:k + micro], y[k:k + micro]) for k in range(0, batch, micro)]
    return {
        "forward": (_median(lambda: forward(x), reps),
                    _median(lambda: [forward(a) for a, _ in parts], reps)),
        "forward+backward": (_median(lambda: forward_backward(x, y), reps),
                             _median(lambda: [forward_backward(a, b) for a, b in parts], reps)),
    }


def layer_ops(batch, micro, reps, calls=16):
    """{(map size, op): (seconds per whole batch of samples at `batch`, at `micro`)}: each op
    run `calls` batches' worth of samples inside one compiled function."""
    import tensorflow as tf

    out = {}
    for hw, c in ((32, 16), (16, 32), (8, 64)):
        kernel = tf.random.normal((3, 3, c, c), seed=2) * 0.1
        ones, zeros, none = tf.ones((c,)), tf.zeros((c,)), tf.zeros((0,))
        ops = {
            "convolution": lambda x, k=kernel: tf.nn.conv2d(x, k, 1, "SAME"),
            "input gradient": lambda x, k=kernel: tf.raw_ops.Conv2DBackpropInput(
                input_sizes=tf.shape(x), filter=k, out_backprop=x, strides=[1] * 4,
                padding="SAME"),
            "filter gradient": lambda x, k=kernel: tf.raw_ops.Conv2DBackpropFilter(
                input=x, filter_sizes=tf.shape(k), out_backprop=x, strides=[1] * 4,
                padding="SAME"),
            "batch norm": lambda x, o=ones, z=zeros, n=none: tf.raw_ops.FusedBatchNormV3(
                x=x, scale=o, offset=z, mean=n, variance=n, is_training=True)[0],
            "batch norm gradient": lambda x, o=ones, z=zeros: tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=x, x=x, scale=o, reserve_space_1=z, reserve_space_2=o,
                reserve_space_3=z, is_training=True)[0],
            "ReLU gradient": lambda x: tf.raw_ops.ReluGrad(gradients=x, features=x),
        }
        for size in (batch, micro):
            inputs = [tf.random.normal((size, hw, hw, c), seed=k) for k in range(4)]
            runs = calls * batch // size
            for name, op in ops.items():
                @tf.function
                def run(op=op, inputs=inputs, runs=runs):
                    total = tf.zeros(())
                    for r in range(runs):  # each op's input waits for the previous op
                        total += tf.reduce_sum(op(inputs[r % 4] + total * 0)) * 0
                    return total

                seconds = _median(run, reps) / calls
                out.setdefault((f"{hw}×{hw}×{c}", name), [None, None])[size != batch] = seconds
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=110)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro", type=int, nargs="+", default=[8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--output", default=None, help="JSON results file (default: none)")
    args = parser.parse_args(argv)
    if any(args.batch % b for b in args.micro):
        parser.error("--micro: each must divide --batch")
    harness.one_thread_per_rank()  # one TensorFlow thread, set before TensorFlow loads
    record = {"machine": harness.machine(), "depth": args.depth, "batch": args.batch, "runs": []}
    for micro in args.micro:
        m = args.batch // micro
        whole = whole_model(args.depth, args.batch, micro, args.reps)
        ops = layer_ops(args.batch, micro, args.reps)
        print(f"ResNet-{args.depth} v1, batch {args.batch} against m = {m} micro-batches of "
              f"{micro} (one thread; ms for the whole batch's samples):")
        print(f"| | one call of {args.batch} | {m} calls of {micro} | ratio |")
        print("| --- | ---: | ---: | ---: |")
        rows = [(f"whole model, {name}", one, many) for name, (one, many) in whole.items()]
        rows += [(f"{size} {name}", one, many) for (size, name), (one, many) in ops.items()]
        for name, one, many in rows:
            print(f"| {name} | {one * 1e3:.2f} | {many * 1e3:.2f} | {many / one:.2f} |")
        record["runs"].append({
            "micro": micro, "whole": {k: list(v) for k, v in whole.items()},
            "ops": [{"maps": s, "op": n, "seconds": list(v)} for (s, n), v in ops.items()]})
    if args.output:
        with open(args.output, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
