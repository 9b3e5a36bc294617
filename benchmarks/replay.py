"""A stage's whole step built by tracing one micro-batch's forward and backward once and copying
that graph m times (GraphDef import), against tracing all m inline (issue 19: the step graph's
build time).

One process, one thread, no messages: stage 0 of ResNet v1 cut in two; the partial errors
are fixed tensors. Prints each build's Python trace, its first run (compile) and its median
step, and how far the two arms' gradient sums differ::

    .venv/bin/python benchmarks/replay.py            # ResNet-110, cut 145, m = 8
    .venv/bin/python benchmarks/replay.py --depth 20 --cut 32 --microbatches 4
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402


def _source(name):
    """The node an input of a NodeDef names ("^n", "n:1" → "n")."""
    return name.lstrip("^").split(":")[0]


def split_graph(graph, e_ph):
    """One micro-batch's forward-and-backward graph → (forward GraphDef, backward GraphDef,
    the forward tensors the backward reads): the backward is every node that depends on the
    partial errors `e_ph`; control edges from forward to backward are dropped (data edges
    order them)."""
    import tensorflow as tf

    gd = graph.as_graph_def()
    behind = {e_ph.op.name}
    changed = True
    while changed:
        changed = False
        for nd in gd.node:
            if nd.name not in behind and any(_source(i) in behind for i in nd.input):
                behind.add(nd.name)
                changed = True
    forward, backward = tf.compat.v1.GraphDef(), tf.compat.v1.GraphDef()
    for part in (forward, backward):
        part.versions.CopyFrom(gd.versions)
    forward.library.CopyFrom(gd.library)
    for nd in gd.node:
        if nd.name not in behind:
            forward.node.add().CopyFrom(nd)
        elif nd.name != e_ph.op.name:
            copy = backward.node.add()
            copy.CopyFrom(nd)
            del copy.input[:]
            copy.input.extend(i for i in nd.input
                              if not (i.startswith("^") and _source(i) not in behind))
    crossing = sorted({i if ":" in i else i + ":0" for nd in backward.node for i in nd.input
                       if not i.startswith("^") and _source(i) not in behind})
    return forward, backward, crossing


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=110)
    parser.add_argument("--cut", type=int, default=145, help="layer calls on stage 0")
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    harness.one_thread_per_rank()
    import numpy as np
    import tensorflow as tf

    from benchmarks.handoff import two_stages

    m, b = args.microbatches, args.microbatch
    stage = two_stages(args.depth, args.cut)[1][0].model
    variables = stage.trainable_variables
    rng = np.random.default_rng(0)
    xs = [tf.constant(rng.random((b, 32, 32, 3), dtype=np.float32)) for _ in range(m)]
    y_shape = (b,) + tuple(stage.outputs[0].shape[1:])
    es = [tf.constant(rng.random(y_shape, dtype=np.float32)) for _ in range(m)]

    def inline(xs, es):
        total = [tf.zeros_like(v) for v in variables]
        for x, e in zip(xs, es):
            with tf.GradientTape() as tape:
                y = tf.nest.flatten(stage(x, training=True))[0]
            grads = tape.gradient(y, variables, output_gradients=e)
            total = [a + g for a, g in zip(total, grads)]
        return total

    @tf.function
    def one(x, e):
        with tf.GradientTape() as tape:
            y = tf.nest.flatten(stage(x, training=True))[0]
        return [y] + tape.gradient(y, variables, output_gradients=e)

    start = time.perf_counter()
    graph = one.get_concrete_function(tf.TensorSpec(xs[0].shape),
                                      tf.TensorSpec(y_shape)).graph
    traced_once = time.perf_counter() - start
    x_ph, e_ph = graph.inputs[0], graph.inputs[1]
    forward, backward, crossing = split_graph(graph, e_ph)
    in_forward = {nd.name for nd in forward.node}
    grad_names = [t.name for t in graph.outputs[1:]]

    def replayed(xs, es):
        outer = tf.compat.v1.get_default_graph()
        captured = {inner.name: outer.capture(outside) for outside, inner in graph.captures
                    if _source(inner.name) in in_forward}
        total = [tf.zeros_like(v) for v in variables]
        for i, (x, e) in enumerate(zip(xs, es)):
            got = tf.graph_util.import_graph_def(
                forward, input_map={**captured, x_ph.name: x}, return_elements=crossing,
                name=f"f{i}")
            grads = tf.graph_util.import_graph_def(
                backward, input_map={**dict(zip(crossing, got)), e_ph.name: e},
                return_elements=grad_names, name=f"b{i}")
            total = [a + g for a, g in zip(total, grads)]
        return total

    print(f"one micro-batch traced in {traced_once:.1f} s; forward {len(forward.node)} nodes, "
          f"backward {len(backward.node)}")
    sums = {}
    for name, body in (("replayed", replayed), ("inline", inline)):
        fn = tf.function(body)
        start = time.perf_counter()
        fn.get_concrete_function(xs, es)
        trace = time.perf_counter() - start
        start = time.perf_counter()
        sums[name] = [v.numpy() for v in fn(xs, es)]
        first = time.perf_counter() - start
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            fn(xs, es)[0].numpy()
            runs.append(time.perf_counter() - start)
        print(f"{name}: trace {trace:.1f} s, first run {first:.1f} s, "
              f"step {statistics.median(runs) * 1e3:.0f} ms", flush=True)
    print("gradient sums differ by at most", max(
        float(np.linalg.norm(a - r) / max(np.linalg.norm(a), 1e-30))
        for a, r in zip(sums["inline"], sums["replayed"])), "of a norm")


if __name__ == "__main__":
    main()
