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

MIB = 2**20


@dataclass(frozen=True)
class Held:
    """What a stage holds besides its weights, gradient sums and optimizer slots, by the way
    it runs (`role`): `per_call` bytes a layer call (its share of the traced and optimised
    functions and of the Keras objects behind them); `kept`, the share of the bytes of its
    calls' outputs and boundary tensors held for each sample of each micro-batch it keeps
    (`schedule.kept`); `per_call_microbatch` bytes a call for each of a step's m
    micro-batches (the step graph has every call m times)."""

    per_call: float
    kept: float
    per_call_microbatch: float = 0.0


# Fitted by least squares to each rank's peak resident set over a whole hf.fit call (tracing
# and compiling included) less its resident set before the call and its weights, gradient
# sums and slots: ResNet-56 and -110 v1, ResNet-1001 v2, 1, 2 and 4 stages, every schedule,
# 63 ranks of 33 runs (benchmarks/results/log.md, "Memory by role"): every configuration's
# largest rank predicted within 0.90-1.05 of its peak.
HELD = {
    "whole": Held(0.65 * MIB, 0.63),  # P = 1: the user's own model, stepped in one function
    "split": Held(1.13 * MIB, 0.72),  # a stage before the last on the executor: the forward's
                                      # tensors handed through a tape to a later backward
    "fused": Held(1.0 * MIB, 0.63),   # the last stage at P > 1: forward and backward fused
    "graph": Held(0.71 * MIB, 0.33, 0.5 * MIB),  # any stage whose step is one graph
}
# What a layer call adds on a rank with replicas to sum with (R > 1): the backward runs beside
# the thread that sums its gradient buckets (ResNet-110, 1 × 2 at 16, 32 and 64 samples a
# replica: 0.33 MiB a call each; 2 × 2: 0.20 and 0.45).
REPLICATED = 0.3 * MIB


def role(stage, stages, step_graph=False):
    """How `stage` of `stages` runs, a key of `HELD`: in the step graph, the whole model, the
    last stage (fused) or one before it (split)."""
    if step_graph:
        return "graph"
    if stages == 1:
        return "whole"
    return "fused" if stage == stages - 1 else "split"


def held_per_call(role_, microbatches=1, replicated=False):
    """Bytes a layer call holds besides its weights in a stage of `role_` (`HELD`), at m
    micro-batches a step, with replicas to sum with or not."""
    held = HELD[role_]
    return (held.per_call + held.per_call_microbatch * microbatches
            + (REPLICATED if replicated else 0.0))


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
        activations: per call, the part scaled by `per_stage` (memory: its outputs'
            bytes in one micro-batch), or None.
        tensors: per tensor key, what it costs to cross a cut (zeros when the
            method ignores communication).
        in_flight: per stage, what scales its activations (memory: the micro-batches it
            keeps times the share of their bytes its role holds, `HELD`), else 1.
        last: per call, what it costs on the last stage in place of `calls` (time, memory:
            the last stage runs forward and backward fused, the others hand the forward's
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


def weight_bytes(graph, optimizer=None):
    """Bytes each layer call's weights take with their gradient sums and `optimizer`'s slots
    (trainable: weights, gradient sum, slots; frozen: weights), counted at their first call."""
    slots = _SLOTS.get(type(optimizer).__name__, 2) if optimizer is not None else 2
    if type(optimizer).__name__ == "SGD" and not getattr(optimizer, "momentum", 0):
        slots = 0
    seen = set()
    out = []
    for c in graph.calls:
        trainable, frozen = _param_count(c.layer, seen)
        out.append(4.0 * ((2 + slots) * trainable + frozen))
    return np.array(out, float)


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
            bytes: weights, gradient sums and optimizer slots and what each call holds in
            the stage's role (`HELD`), plus the role's share of each layer's outputs and
            each boundary tensor per micro-batch in flight (as many as `schedule` keeps
            on the stage: `schedule.kept`).
        partitions, microbatches: P and m (memory: micro-batches in flight).
        schedule, chunks: "1f1b", "gpipe" or "interleaved" with `chunks` stages a rank
            (memory: micro-batches in flight; `partitions` counts every stage).
        microbatch_size: samples per micro-batch (time, memory).
        optimizer: the keras optimizer (memory: its slots per weight).
        timings: for ``"time"``, the model's `timing.Timings` at `microbatch_size`
            (`split.shared_profile`).
        step_graph: every stage runs its step as one graph (`StepGraph`), which compiles
            a non-last stage's forward with its backward: for ``"time"`` every call is
            costed fused, as the last stage runs it; for ``"memory"`` in the step graph's
            role, every stage but the last keeping all m micro-batches.
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
        weights = weight_bytes(graph, optimizer)
        m = microbatches or partitions
        last = role(partitions - 1, partitions, step_graph)
        before = role(0, partitions, step_graph)
        acts = np.array([sum(bytes_per_sample(t) for t in c.node.outputs) * microbatch_size
                         for c in graph.calls], float)
        tensors = {k: float(bytes_per_sample(t) * microbatch_size)
                   for k, t in graph.tensors.items()}
        kept = schedule_.kept(schedule, partitions // chunks, m, chunks, step_graph)
        in_flight = tuple(k * HELD[role(s, partitions, step_graph)].kept
                          for s, k in enumerate(kept))
        return Costs(method, "bytes", weights + held_per_call(before, m), acts, tensors,
                     in_flight, last=weights + held_per_call(last, m))
    raise ValueError(
        f"balance={method!r} is not a balance method; use one of {', '.join(map(repr, METHODS))}, "
        "a list of layer counts per stage, or a list of layer names that start stages 1..P-1.")
