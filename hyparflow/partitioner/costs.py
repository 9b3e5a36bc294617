"""What each layer call and each cut costs under a balance method: layers to memory."""

from dataclasses import dataclass

import numpy as np

from hyparflow.engine import schedule as schedule_

METHODS = ("params", "layers", "flops", "time", "memory")
# The method hf.fit, hf.evaluate, hf.predict and hf.partition use unless told: free to
# compute, the same split on every run, and it follows compute where layers differ in
# cost ("params" put 78 % of a ResNet's calls on stage 0; benchmarks/results/log.md).
DEFAULT = "flops"

# Boundary tensors under balance="time": one message per tensor and direction
# (activations forward, partial errors backward), each costing LATENCY plus its
# bytes over BANDWIDTH. Defaults for ranks of one node talking through shared
# memory; the planner (issue 8) measures the network instead.
LATENCY = 20e-6  # seconds per message
BANDWIDTH = 4e9  # bytes per second

# Memory a stage holds per layer call whatever the batch: its share of the traced and
# optimised forward/backward graphs and of the Keras objects behind them. Measured on
# ResNet-1001 v2 (benchmarks/results/log.md, stages.py): ranks whose activations the split had
# made equal grew by 0.62 MiB more per call they held.
BYTES_PER_CALL = 0.6 * 2**20

# Optimizer slots per trainable weight (balance="memory"), by optimizer class.
_SLOTS = {"SGD": 1, "Adam": 2, "AdamW": 2, "Adamax": 2, "Nadam": 2, "Adafactor": 2,
          "RMSprop": 1, "Adagrad": 1, "Adadelta": 2, "Ftrl": 2, "Lion": 1, "Lamb": 2}


@dataclass
class Costs:
    """Predicted cost of every stage a contiguous split could create.

    The cost of stage ``s`` holding calls ``a .. b-1`` is::

        calls[a:b].sum() + per_stage(s) * (activations[a:b].sum() + boundary(a, b))

    with `last` in place of `calls` on the last stage when it is given.

    where ``boundary(a, b)`` sums `tensors` over the tensors the stage receives
    (produced before ``a``, consumed in ``a .. b-1``) and sends (produced in
    ``a .. b-1``, consumed at or after ``b``).

    Attributes:
        method: the balance method.
        unit: the unit of the costs ("params", "calls", "flops", "s", "bytes").
        calls: per call, the part of its cost that does not depend on the stage.
        activations: per call, the part scaled by `per_stage` (memory: bytes kept
            per micro-batch in flight), or None.
        tensors: per tensor key, what it costs to cross a cut (zeros when the
            method ignores communication).
        in_flight: per stage, how many micro-batches it keeps (memory), else 1.
        last: per call, what it costs on the last stage in place of `calls` (time: the
            last stage runs forward and backward fused, the others hand the forward's
            tensors to a later backward), or None: the same.
    """

    method: str
    unit: str
    calls: np.ndarray
    activations: np.ndarray
    tensors: dict
    in_flight: tuple = ()
    last: np.ndarray | None = None

    def per_stage(self, s):
        return self.in_flight[s] if self.in_flight else 1

    @property
    def communicates(self):
        return any(w > 0 for w in self.tensors.values())

    def format(self, value):
        if self.unit == "s":
            return f"{value * 1e3:,.2f} ms"
        if self.unit == "bytes":
            return f"{value / 2**20:,.1f} MiB"
        if self.unit == "flops":
            return f"{value / 1e6:,.2f} MFLOP"
        return f"{value:,.0f}"


def _count(shape):
    n = 1
    for d in shape:
        n *= int(d) if d is not None else 1
    return n


def bytes_per_sample(tensor):
    """Bytes of one sample of a (symbolic) tensor."""
    size = np.dtype(object).itemsize if str(tensor.dtype) == "string" else \
        np.dtype(tensor.dtype).itemsize  # (a string: its pointer; never sent)
    return _count(tensor.shape[1:]) * size


def _param_count(layer, seen):
    """Parameters of `layer`, counted on its first call only (shared layers)."""
    if id(layer) in seen:
        return 0, 0
    seen.add(id(layer))
    trainable = sum(_count(w.shape) for w in getattr(layer, "trainable_weights", []))
    frozen = sum(_count(w.shape) for w in getattr(layer, "non_trainable_weights", []))
    return trainable, frozen


def flops(call):
    """Estimated forward floating-point operations of one call, per sample.

    Dense and convolution layers from their kernels and output shapes; pooling
    from its window; normalisation as a few operations per element; embeddings
    as one per output element (a lookup, not a product); any other
    layer with weights as two operations per weight per output position;
    everything else (activations, additions, concatenations, keras.ops) one per
    output element. A nested model kept whole is the sum of its layers.
    """
    from keras import layers

    from hyparflow.partitioner.graph import LayerGraph, is_graph_model

    layer = call.layer
    outs = call.node.outputs
    out_elems = sum(_count(t.shape[1:]) for t in outs)
    if is_graph_model(layer):
        return sum(flops(c) for c in LayerGraph(layer).calls)
    if isinstance(layer, (layers.Conv1DTranspose, layers.Conv2DTranspose,
                          layers.Conv3DTranspose)):
        x = call.node.input_tensors[0]
        k = layer.kernel
        return 2 * _count(k.shape) * _count(x.shape[1:-1])
    if isinstance(layer, layers.SeparableConv2D) or isinstance(layer, layers.SeparableConv1D):
        positions = _count(outs[0].shape[1:-1])
        return 2 * positions * (_count(layer.depthwise_kernel.shape)
                                + _count(layer.pointwise_kernel.shape))
    if isinstance(layer, (layers.Conv1D, layers.Conv2D, layers.Conv3D,
                          layers.DepthwiseConv1D, layers.DepthwiseConv2D)):
        kernel = layer.depthwise_kernel if hasattr(layer, "depthwise_kernel") else layer.kernel
        # kernel (*window, in/groups, out); depthwise: (*window, in, multiplier).
        return 2 * _count(outs[0].shape[1:-1]) * _count(kernel.shape)
    if isinstance(layer, (layers.Dense, layers.EinsumDense)):
        positions = _count(outs[0].shape[1:-1])
        return 2 * positions * _count(layer.kernel.shape)
    if isinstance(layer, (layers.BatchNormalization, layers.LayerNormalization,
                          layers.GroupNormalization, layers.UnitNormalization)):
        return 5 * out_elems
    if isinstance(layer, layers.Embedding):  # a lookup: one copy per output element
        return out_elems
    pool = getattr(layer, "pool_size", None)
    if pool is not None:
        return _count(pool) * out_elems
    if isinstance(layer, (layers.GlobalAveragePooling1D, layers.GlobalAveragePooling2D,
                          layers.GlobalAveragePooling3D, layers.GlobalMaxPooling1D,
                          layers.GlobalMaxPooling2D, layers.GlobalMaxPooling3D)):
        return sum(_count(t.shape[1:]) for t in call.node.input_tensors)
    weights = sum(_count(w.shape) for w in getattr(layer, "trainable_weights", []))
    if weights:
        last = outs[0].shape[-1] if len(outs[0].shape) > 1 else 1
        return 2 * weights * max(1, out_elems // max(1, int(last or 1)))
    return out_elems


def costs(graph, method=DEFAULT, *, partitions=1, microbatch_size=16, microbatches=None,
          optimizer=None, timings=None, schedule="1f1b", chunks=1, step_graph=False):
    """The `Costs` of `graph`'s calls under a balance method.

    Args:
        graph: a `LayerGraph`.
        method: ``"params"`` — parameters of the called layer (first call only) plus
            one, so parameter-free layers still spread; ``"layers"`` — one per call;
            ``"flops"`` — estimated forward FLOPs per sample (`flops`); ``"time"`` —
            forward + backward seconds per micro-batch, measured compiled in the role
            of the stage holding the call (`timing.profile`: `last` for the last
            stage, `calls` for the others), plus what each boundary tensor costs to
            send and receive; ``"memory"`` —
            bytes: weights, gradient sums and optimizer slots, plus each layer's
            outputs and each boundary tensor per micro-batch in flight (as many as
            `schedule` keeps on the stage: `schedule.kept`).
        partitions, microbatches: P and m (memory: micro-batches in flight).
        schedule, chunks: "1f1b", "gpipe" or "interleaved" with `chunks` stages a rank
            (memory: micro-batches in flight; `partitions` counts every stage).
        microbatch_size: samples per micro-batch (time, memory).
        optimizer: the keras optimizer (memory: its slots per weight).
        timings: for ``"time"``, the model's `timing.Timings` at `microbatch_size`
            (`split.shared_profile`).
        step_graph: for ``"time"``, every stage runs its step as one graph
            (`StepGraph`), which compiles a non-last stage's forward with its backward:
            every call is costed fused, as the last stage runs it.
    """
    n = len(graph)
    zero_tensors = dict.fromkeys(graph.tensors, 0.0)
    if method == "layers":
        return Costs(method, "calls", np.ones(n), np.zeros(n), zero_tensors)
    if method == "params":
        seen = set()
        calls = np.array([sum(_param_count(c.layer, seen)) + 1 for c in graph.calls], float)
        return Costs(method, "params", calls, np.zeros(n), zero_tensors)
    if method == "flops":
        calls = np.array([flops(c) for c in graph.calls], float)
        return Costs(method, "flops", calls, np.zeros(n), zero_tensors)
    if method == "time":
        if timings is None:
            raise ValueError('balance="time" needs the model timed (timings=...).')
        tensors = {k: (2 * LATENCY + 2 * bytes_per_sample(t) * microbatch_size / BANDWIDTH
                       if "float" in str(t.dtype) else
                       LATENCY + bytes_per_sample(t) * microbatch_size / BANDWIDTH)
                   for k, t in graph.tensors.items()}
        fused = np.array(timings.fused, float)
        return Costs(method, "s", fused if step_graph else np.array(timings.split, float),
                     np.zeros(n), tensors, last=fused)
    if method == "memory":
        slots = _SLOTS.get(type(optimizer).__name__, 2) if optimizer is not None else 2
        if type(optimizer).__name__ == "SGD" and not getattr(optimizer, "momentum", 0):
            slots = 0
        seen = set()
        static = []
        for c in graph.calls:
            trainable, frozen = _param_count(c.layer, seen)
            static.append(4 * ((2 + slots) * trainable + frozen) + BYTES_PER_CALL)
        acts = np.array([sum(bytes_per_sample(t) for t in c.node.outputs) * microbatch_size
                         for c in graph.calls], float)
        tensors = {k: float(bytes_per_sample(t) * microbatch_size)
                   for k, t in graph.tensors.items()}
        m = microbatches or partitions
        in_flight = schedule_.kept(schedule, partitions // chunks, m, chunks)
        return Costs(method, "bytes", np.array(static, float), acts, tensors, in_flight)
    raise ValueError(
        f"balance={method!r} is not a balance method; use one of {', '.join(map(repr, METHODS))}, "
        "a list of layer counts per stage, or a list of layer names that start stages 1..P-1.")
