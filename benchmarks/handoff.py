"""Where a non-last stage's hand-off goes: one stage's micro-batches run as hyparflow runs
them against the same work compiled whole.

A non-last stage runs each micro-batch's forward as a compiled function under a
GradientTape and its backward later (`tape.gradient` with the partial errors);
the last stage runs forward and backward as one compiled function. This times,
per micro-batch, on stage 0 of a ResNet v1 cut in two (one TensorFlow thread):

* ``forward``: the compiled forward alone;
* ``taped_forward``: the same under a tape (the function that also returns
  what its backward will need);
* ``split``: taped forward, then ``tape.gradient`` — a non-last stage's work, in
  1F1B order (F0, F1 B0, F2 B1, ...), the weight gradients summed as hyparflow sums them;
* ``fused``: forward and backward of each micro-batch as one compiled function
  (the last stage's way; the partial errors known at once);
* ``whole_step``: every micro-batch's forward and backward in one compiled
  function (what a whole-step graph per stage would run),

and the first call (trace and compile) of ``fused`` and of ``whole_step``. Each
is the median of ``--reps`` rounds, interleaved, of at least 3 timed calls::

    .venv/bin/python benchmarks/handoff.py           # ResNet-110, cut 147, b = 8, m = 4 8
    .venv/bin/python benchmarks/handoff.py --output benchmarks/results/handoff.json
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402


def two_stages(depth, cut, batchnorm=True):
    """ResNet v1 of `depth` (seeded) and its two stages, `cut` layer calls on the first."""
    import keras

    import hyparflow as hf
    from benchmarks.models import resnet_v1
    from hyparflow.partitioner.graph import LayerGraph

    keras.utils.set_random_seed(0)
    model = resnet_v1(depth, batchnorm=batchnorm)
    calls = len(LayerGraph(model))
    return model, hf.partition(model, 2, balance=[cut, calls - cut]).stages


def measure(args, m):
    """{kind: median ms per micro-batch, ...} for m micro-batches."""
    import numpy as np
    import tensorflow as tf

    from hyparflow.partitioner.timing import typical

    stage = two_stages(args.depth, args.cut)[1][0].model
    b = args.microbatch
    rng = np.random.default_rng(0)
    xs = [tf.constant(rng.random((b, 32, 32, 3), dtype=np.float32)) for _ in range(m)]
    errors = [[tf.constant(rng.random((b,) + tuple(o.shape[1:]), dtype=np.float32))
               for o in stage.outputs] for _ in range(m)]
    variables = stage.trainable_variables
    sums = [tf.Variable(tf.zeros_like(v)) for v in variables]

    def run(x):
        return tf.nest.flatten(stage(x, training=True))

    forward = tf.function(run)
    accumulate = tf.function(lambda gs: [s.assign_add(g) for s, g in zip(sums, gs)])

    def differentiate(x, e):  # in a graph: forward, then every gradient, summed in
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = run(x)
        grads = tape.gradient(y, [x] + variables, output_gradients=e)
        for s, g in zip(sums, grads[1:]):
            s.assign_add(g)
        return grads[0]

    fused_one = tf.function(differentiate)
    whole = tf.function(lambda xs, es: [differentiate(x, e) for x, e in zip(xs, es)])

    def plain():
        return [forward(x) for x in xs][-1][0]

    def taped():
        kept = []
        for x in xs:
            with tf.GradientTape() as tape:
                tape.watch(x)
                kept.append((tape, forward(x)))
        return kept[-1][1][0]

    def split():
        order = [("F", 0)] + [a for i in range(1, m) for a in (("F", i), ("B", i - 1))] + \
            [("B", m - 1)]
        tapes = {}
        for kind, i in order:
            if kind == "F":
                with tf.GradientTape() as tape:
                    tape.watch(xs[i])
                    tapes[i] = (tape, forward(xs[i]))
            else:
                tape, y = tapes.pop(i)
                grads = tape.gradient(y, [xs[i]] + variables, output_gradients=errors[i])
                accumulate(grads[1:])
        return grads[0]

    def fused():
        return [fused_one(x, e) for x, e in zip(xs, errors)][-1]

    def whole_step():
        return whole(xs, errors)[-1]

    out = {"m": m, "calls_on_stage": args.cut}
    start = time.perf_counter()
    fused_one(xs[0], errors[0]).numpy()
    out["fused_first_s"] = time.perf_counter() - start
    start = time.perf_counter()
    whole_step().numpy()
    out["whole_step_first_s"] = time.perf_counter() - start
    kinds = {"forward": plain, "taped_forward": taped, "split": split, "fused": fused,
             "whole_step": whole_step}
    rounds = {k: [] for k in kinds}
    for _ in range(args.reps):
        for k, fn in kinds.items():
            rounds[k].append(typical(lambda fn=fn: fn().numpy(), repeats=3, seconds=1.0)
                             * 1e3 / m)
    out["ms_per_microbatch"] = {k: statistics.median(v) for k, v in rounds.items()}
    out["rounds"] = rounds
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=110)
    parser.add_argument("--cut", type=int, default=147, help="layer calls on stage 0")
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--output")
    args = parser.parse_args()
    harness.one_thread_per_rank()
    report = {"machine": harness.machine(), "depth": args.depth, "microbatch": args.microbatch,
              "runs": [measure(args, m) for m in args.microbatches]}
    for run in report["runs"]:
        ms = run["ms_per_microbatch"]
        print(f"m = {run['m']}: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
              + f" ms per micro-batch; first call fused {run['fused_first_s']:.1f} s, whole "
              f"step {run['whole_step_first_s']:.1f} s", flush=True)
    if args.output:
        harness.write_report(report, args.output)
    print(json.dumps({r["m"]: r["ms_per_microbatch"] for r in report["runs"]}))


if __name__ == "__main__":
    main()
