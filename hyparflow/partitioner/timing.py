"""Compiled timings of a model, or of contiguous pieces of one, in the two roles a stage runs."""

import time
from dataclasses import dataclass

import numpy as np

from hyparflow.keras import keras_private
from hyparflow.keras import variables as variables_
from hyparflow.partitioner import balance as balance_
from hyparflow.partitioner import costs as costs_
from hyparflow.partitioner import graph as graph_

# Pieces the calls are cut into to be timed (`profile`): each is compiled and timed as a
# stage, and its time spread over its calls by their FLOPs. More pieces place a cut more
# exactly and cost a trace and a compilation each.
PIECES = 16


def typical(run, repeats=3, seconds=0.5):
    """Median seconds of at least `repeats` timed calls of `run` lasting at least `seconds` in
    all, after one untimed call (trace, warm-up): what a training loop sees, not its best."""
    run()
    times = []
    while len(times) < repeats or sum(times) < seconds:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


class Roles:
    """A keras model timed as a stage runs it: `fused` (the last stage: forward and backward in
    one compiled function) or `split` (any other: the compiled forward under a GradientTape,
    ``tape.gradient`` later, the forward's tensors handed through Python in between).

    The gradient is taken of every floating output (seeded with ones) with respect to the
    floating inputs and the trainable variables, as a stage's backward takes it. Running in
    training mode moves the model's non-trainable state (BatchNormalization's statistics,
    dropout's seed): `restore` puts back what it was when this object was made.
    """

    def __init__(self, model):
        import tensorflow as tf

        self.model = model
        self._structure = keras_private.inputs_struct(graph_.functional_of(model))
        self.variables = list(model.trainable_variables)
        self._state = list(model.non_trainable_variables)
        self._saved = [variables_.value(v) for v in self._state]
        self._rng = np.random.default_rng(0)
        self._forward = tf.function(self._outputs, reduce_retracing=True)
        self._fused = tf.function(self._fused_fn, reduce_retracing=True)

    def inputs(self, b):
        """Random inputs of b samples (zeros for integer and boolean ones; a free dimension
        measured at 1)."""
        import tensorflow as tf

        xs = []
        for t in self.model.inputs:
            shape = (b,) + tuple(1 if d is None else int(d) for d in t.shape[1:])
            dtype = tf.as_dtype(t.dtype)
            xs.append(tf.constant(self._rng.random(shape), dtype=dtype) if dtype.is_floating
                      else tf.zeros(shape, dtype))
        return xs

    def _pack(self, xs):
        """`xs` (in the order of ``model.inputs``) in the structure the model takes them: one
        tensor, a list, or a dict (keras-hub's task models refuse a dict's values as a list)."""
        import keras

        return keras.tree.pack_sequence_as(self._structure, list(xs))

    def _outputs(self, xs):
        import tensorflow as tf

        outs = tf.nest.flatten(self.model(self._pack(xs), training=True))
        return [tf.cast(o, tf.float32) for o in outs if o.dtype.is_floating]

    def _gradients(self, forward, xs):
        """`forward(xs)` under a tape, then the gradients of its outputs (seeded with ones)
        with respect to the floating inputs and the variables (None where unconnected)."""
        import tensorflow as tf

        watched = [x for x in xs if x.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(watched)
            outs = forward(xs)
        return tape.gradient(outs, watched + self.variables,
                             output_gradients=[tf.ones_like(o) for o in outs])

    def _fused_fn(self, xs):
        import tensorflow as tf

        grads = self._gradients(self._outputs, xs)  # (mixed precision: of several dtypes)
        return tf.add_n([tf.cast(tf.reduce_sum(g), tf.float32) for g in grads if g is not None]
                        or [tf.zeros(())])

    def fused(self, xs):
        """Forward and backward of inputs `xs` as one compiled function."""
        return self._fused(xs).numpy()

    def split(self, xs):
        """The compiled forward of `xs` under a tape, then its gradient."""
        return [g for g in self._gradients(self._forward, xs) if g is not None][-1:]

    def restore(self):
        """The model's non-trainable state as it was before it was timed."""
        variables_.assign(self._state, self._saved)


@dataclass
class Timings:
    """Measured seconds of each layer call on one micro-batch, forward and backward, in the
    role of the stage holding it.

    Attributes:
        fused: on the last stage (forward and backward in one compiled function).
        split: on any other stage (the compiled forward under a tape, its gradient later).
        pieces: calls per piece that was compiled and timed.
    """

    fused: list
    split: list
    pieces: list


def _pieces(graph, count):
    """Calls per piece: `count` contiguous pieces of about equal FLOPs, each starting where a
    stage may start (fewer where fewer starts are allowed)."""
    allowed = balance_.allowed_starts(graph)
    count = max(1, min(count, len(graph), int(allowed[1:-1].sum()) + 1))
    flops = costs_.costs(graph, "flops")
    return balance_.split(flops, count, graph, allowed)[0], flops.calls


def profile(graph, microbatch_size, build, repeats=5, pieces=PIECES, seconds=0.1):
    """`Timings` of every call of `graph` on `microbatch_size` samples, measured compiled.

    `build(graph, sizes)`: the stage models of `graph` cut into pieces of `sizes` calls
    (`split.stage_models`).

    The calls are cut into `pieces` contiguous pieces of about equal FLOPs; each is
    built as a stage is (its own keras.Model over the same layers), compiled, and
    timed in both roles (`Roles`, the median of at least `repeats` calls); a piece's
    time is spread over its calls by their FLOPs. A compiled piece is what a stage
    runs: its kernels at this micro-batch size, the fusions the graph optimiser
    makes, and a non-last stage's hand-off, none of which timing each call alone,
    eagerly, sees. The model's weights and non-trainable state are left as they were.
    """
    sizes, flops = _pieces(graph, pieces)
    fused, split = [], []
    start = 0
    for n, model in zip(sizes, build(graph, sizes)):
        roles = Roles(model)
        try:
            xs = roles.inputs(microbatch_size)
            t_fused = typical(lambda: roles.fused(xs), repeats, seconds)
            t_split = typical(lambda: roles.split(xs), repeats, seconds)
        finally:
            roles.restore()
        weights = np.maximum(flops[start:start + n], 1.0)
        weights = weights / weights.sum()
        fused += list(t_fused * weights)
        split += list(t_split * weights)
        start += n
    return Timings(fused, split, [int(n) for n in sizes])
