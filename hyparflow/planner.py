"""hf.plan: predict the step time of every P × R × m on N ranks from one-process measurements, and pick the fastest.

The model of a training step (every term measured or given, nothing fitted to
hyparflow's own runs)::

    b        = batch_size / (R·m)                      samples per micro-batch
    t_s      = f_s · C(b)                              stage s's share of the whole model's
                                                       compiled forward + backward on b samples
             + HANDOFF · calls_s   (s < P − 1)         a non-last stage's forward runs under a
                                                       tape and hands its tensors to a later
                                                       backward: a fixed cost per layer call
             + Σ (latency + bytes·b / bandwidth)       each boundary tensor it receives
                                                       (forward) or whose error it receives
                                                       (backward)
    pipeline = Σ_s t_s + (m − 1) · max_s t_s           fill and drain, then the slowest stage
    step     = pipeline + max_s ring(R, 4·params_s)    gradient allreduce of each stage's
                                                       replicas: 2(R−1)·latency
                                                       + 2(R−1)/R · bytes / bandwidth
             + max_s U · params_s / params             the optimizer's update, U measured
                                                       on the whole model

C(b) is measured on this process (one compiled forward + backward of a copy of
the model, at each micro-batch size the candidates need); f_s is the share of
the per-layer times (measured eagerly at one size) that the `"time"` split puts
on stage s; calls, boundary tensors and parameters come from the layer graph.
GPipe and 1F1B take the same time in this model (the same bubble); 1F1B keeps
fewer micro-batches' activations, so it ranks first on a tie.
"""

import math
import time
from dataclasses import dataclass, field

import numpy as np

from hyparflow.partitioner import balance as balance_
from hyparflow.partitioner import costs as costs_
from hyparflow.partitioner import split as split_
from hyparflow.partitioner.graph import LayerGraph

# A non-last stage's fixed cost per layer call per micro-batch (its forward's tensors
# handed through a GradientTape to the later backward), seconds. Measured on the 2-core
# machine of benchmarks/README.md: ~16 ms per micro-batch for ResNet-110's stage 0
# (~190 calls), against the same forward and backward fused in one function.
HANDOFF = 80e-6


@dataclass(frozen=True)
class Network:
    """Point-to-point cost of a message: `latency` seconds plus bytes / `bandwidth` (bytes/s)."""

    latency: float
    bandwidth: float


NETWORKS = {
    # Ranks of one node through shared memory (Open MPI's vader/sm, measured here by
    # benchmarks/transfer.py: ~13 GB/s for 1 MiB messages from TensorFlow's memory).
    "shm": Network(latency=5e-6, bandwidth=12e9),
    # An InfiniBand-class network between nodes: 100 Gb/s (Frontera's HDR100), ~2 µs.
    "infiniband": Network(latency=2e-6, bandwidth=100e9 / 8),
}


@dataclass
class Profile:
    """What `measure` found of a model on this process; pass it to `plan` again to skip measuring.

    Attributes:
        call_seconds: per layer call, eager forward + backward on `call_batch` samples.
        call_batch: the micro-batch size of `call_seconds`.
        step_seconds: micro-batch size → seconds of one compiled forward + backward of
            the whole model.
        threads: TensorFlow intra-op threads while measuring.
        update_seconds: one compiled optimizer update of every trainable variable
            (0 for a model that is not compiled).
    """

    call_seconds: list
    call_batch: int
    step_seconds: dict = field(default_factory=dict)
    threads: int = 1
    update_seconds: float = 0.0

    def compute(self, b):
        """C(b): compiled forward + backward of the whole model on b samples (interpolated)."""
        sizes = sorted(self.step_seconds)
        if b in self.step_seconds:
            return self.step_seconds[b]
        if len(sizes) == 1:
            return self.step_seconds[sizes[0]] * b / sizes[0]
        lo = max([s for s in sizes if s <= b] or sizes[:1])
        hi = min([s for s in sizes if s > lo and s >= b] or sizes[-1:])
        if hi == lo:
            lo, hi = sizes[-2], sizes[-1]
        t_lo, t_hi = self.step_seconds[lo], self.step_seconds[hi]
        line = t_lo + (t_hi - t_lo) * (b - lo) / (hi - lo)
        # below the smallest size measured, never less than proportional to it
        return max(line, t_lo * b / lo) if b < lo else line


@dataclass
class Prediction:
    """One configuration's predicted step, and where its time goes."""

    partitions: int
    replicas: int
    microbatches: int
    schedule: str
    microbatch_size: int
    step_s: float
    images_per_s: float
    stage_s: list
    allreduce_s: float
    sizes: list
    update_s: float = 0.0

    @property
    def bubble(self):
        """Share of the pipeline's time a stage idles on average (fill, drain, imbalance)."""
        busy = sum(self.stage_s) * self.microbatches / self.partitions
        pipeline = self.step_s - self.allreduce_s - self.update_s
        return 1 - busy / pipeline if pipeline > 0 else 0.0


@dataclass
class Plan:
    """Every prediction, fastest first; `best` is the recommendation."""

    predictions: list
    ranks: int
    batch_size: int
    profile: Profile

    @property
    def best(self):
        return self.predictions[0]

    def table(self, rows=None):
        """The ranked predictions as a text table."""
        head = (f"{'P':>3} {'R':>3} {'m':>3} {'schedule':>8} {'micro':>6} {'step ms':>9} "
                f"{'images/s':>9} {'bubble':>7} {'allreduce ms':>12}  calls per stage")
        lines = [head, "-" * len(head)]
        for p in self.predictions[:rows]:
            lines.append(f"{p.partitions:>3} {p.replicas:>3} {p.microbatches:>3} "
                         f"{p.schedule:>8} {p.microbatch_size:>6} {p.step_s * 1e3:>9.1f} "
                         f"{p.images_per_s:>9.1f} {p.bubble:>7.0%} "
                         f"{p.allreduce_s * 1e3:>12.2f}  {p.sizes}")
        return "\n".join(lines)

    def find(self, partitions, replicas, microbatches, schedule="1f1b"):
        """The prediction of one configuration."""
        for p in self.predictions:
            if (p.partitions, p.replicas, p.microbatches, p.schedule) == (
                    partitions, replicas, microbatches, schedule):
                return p
        raise KeyError(f"no prediction for P={partitions} R={replicas} m={microbatches} "
                       f"schedule={schedule!r}")


def _network(value, name):
    if isinstance(value, Network):
        return value
    if isinstance(value, str) and value in NETWORKS:
        return NETWORKS[value]
    if isinstance(value, dict) and set(value) == {"latency", "bandwidth"}:
        return Network(float(value["latency"]), float(value["bandwidth"]))
    raise ValueError(f"{name}={value!r}: use {' or '.join(map(repr, NETWORKS))}, a "
                     "hyparflow.plan.Network, or {'latency': seconds, 'bandwidth': bytes/s}.")


def microbatch_sizes(batch_size, ranks, microbatches):
    """Every micro-batch size b = batch_size // (R·m) the candidates need (≥ 1)."""
    sizes = set()
    for R in _divisors(ranks):
        for m in microbatches:
            if batch_size // (R * m) >= 1:
                sizes.add(batch_size // (R * m))
    return sorted(sizes)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def measure(model, sizes, call_batch=None, repeats=3, keep_nested=False):
    """A `Profile` of `model`: per-call eager times, and the compiled whole model at each size.

    The model is copied (`keras.models.clone_model`) for the compiled timings, so its
    weights and BatchNormalization statistics are left as they are.
    """
    import keras
    import tensorflow as tf

    if not sizes:
        raise ValueError("measure: no micro-batch sizes to measure.")
    graph = LayerGraph(model, keep_nested=keep_nested)
    call_batch = call_batch or max(sizes)
    call_seconds = costs_.profile(graph, call_batch, repeats=repeats)
    clone = keras.models.clone_model(model)
    variables = clone.trainable_variables
    rng = np.random.default_rng(0)

    @tf.function(reduce_retracing=True)
    def forward_backward(xs):
        with tf.GradientTape() as tape:
            outs = clone(xs, training=True)
            loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                             for o in tf.nest.flatten(outs)])
        grads = tape.gradient(loss, variables)
        return tf.add_n([tf.reduce_sum(g) for g in grads if g is not None])

    steps = {}
    for b in sorted(set(sizes)):
        xs = [tf.constant(rng.random((b,) + tuple(1 if d is None else int(d)
                                                  for d in t.shape[1:])),
                          dtype=t.dtype) for t in clone.inputs]  # a free size measured at 1
        xs = xs[0] if len(xs) == 1 else xs
        forward_backward(xs).numpy()  # trace (and warm up)
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            forward_backward(xs).numpy()
            best = min(best, time.perf_counter() - start)
        steps[b] = best
    update = 0.0
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        copy = type(optimizer).from_config(optimizer.get_config())
        grads = [tf.zeros_like(v) for v in variables]

        @tf.function
        def apply():
            copy.apply_gradients(zip(grads, variables))

        apply()  # builds the slots, traces
        update = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            apply()
            update = min(update, time.perf_counter() - start)
    return Profile(call_seconds, call_batch, steps,
                   tf.config.threading.get_intra_op_parallelism_threads() or 0, update)


def _stage_terms(graph, sizes, b, network):
    """Per stage: layer calls, parameter bytes, and boundary-tensor seconds per micro-batch."""
    P = len(sizes)
    stage_of = np.repeat(np.arange(P), sizes)
    seen, param_bytes = set(), [0.0] * P
    for c in graph.calls:
        trainable, _ = costs_._param_count(c.layer, seen)
        param_bytes[stage_of[c.index]] += 4.0 * trainable
    transfer = [0.0] * P
    outputs = set(graph.outputs)
    for key, producer in graph.producer.items():
        if producer is None:
            continue  # a model input: every stage reads its own copy
        src = int(stage_of[producer])
        seconds = network.latency + costs_.bytes_per_sample(graph.tensors[key]) * b \
            / network.bandwidth
        for d in split_.readers(graph, stage_of, key, outputs):
            transfer[d] += seconds    # the activation, received forward
            transfer[src] += seconds  # its partial error, received backward
    return param_bytes, transfer


def _ring(R, nbytes, network):
    if R == 1:
        return 0.0
    return 2 * (R - 1) * network.latency + 2 * (R - 1) / R * nbytes / network.bandwidth


def predict(graph, profile, partitions, replicas, microbatches, batch_size, schedule="1f1b",
            network="shm", allreduce_network=None, ranks_per_node=None, handoff=HANDOFF):
    """The predicted `Prediction` of one configuration (see the module's formula).

    The split is the `"time"` split hf.fit would make: cuts only where a stage may
    start (not inside the span of a layer called at several places).
    """
    P, R, m = partitions, replicas, microbatches
    b = max(1, batch_size // (R * m))
    intra = _network(network, "network")
    inter = _network(allreduce_network or network, "allreduce_network")
    per_node = ranks_per_node or P * R
    calls = np.asarray(profile.call_seconds, float)
    costs = costs_.Costs("time", "s", calls, np.zeros(len(calls)),
                         {k: 0.0 for k in graph.tensors})
    sizes = balance_.split(costs, P, graph, balance_.allowed_starts(graph))[0] if P > 1 \
        else [len(calls)]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    total = calls.sum() or 1.0
    share = [calls[a:z].sum() / total for a, z in zip(bounds, bounds[1:])]
    pipe_net = intra if P <= per_node else inter
    param_bytes, transfer = _stage_terms(graph, sizes, b, pipe_net)
    compute = profile.compute(b)
    stage_s = [share[s] * compute + (handoff * sizes[s] if s < P - 1 else 0.0) + transfer[s]
               for s in range(P)]
    pipeline = sum(stage_s) + (m - 1) * max(stage_s)
    ring_net = intra if P * R <= per_node else inter
    allreduce = max(_ring(R, nbytes, ring_net) for nbytes in param_bytes)
    total = sum(param_bytes) or 1.0
    update = profile.update_seconds * max(nbytes / total for nbytes in param_bytes)
    step = pipeline + allreduce + update
    return Prediction(P, R, m, schedule, b, step, batch_size / step, stage_s, allreduce,
                      [int(s) for s in sizes], update)


def plan(model, ranks, batch_size, *, microbatches=(1, 2, 4, 8, 16, 32),
         schedules=("1f1b", "gpipe"), network="shm", allreduce_network=None,
         ranks_per_node=None, profile=None, keep_nested=False, verbose=1):
    """Predict the step time of every (P, R, m, schedule) with P × R = `ranks`, fastest first.

    Args:
        model: a built functional or Sequential keras.Model (not changed).
        ranks: N, the ranks the job will have.
        batch_size: the global batch.
        microbatches: the m to consider (those that leave at least one sample per
            micro-batch and replica are kept).
        schedules: the schedules to list.
        network: the messages' cost between ranks of a node: "shm" (default),
            "infiniband", a `Network`, or ``{"latency": s, "bandwidth": bytes/s}``.
        allreduce_network: between nodes, when P × R exceeds `ranks_per_node`
            (default: `network`).
        ranks_per_node: ranks on one node (default: all of them).
        profile: a `Profile` from an earlier plan (``plan.profile``): nothing is measured.
        keep_nested: as in `hf.fit`: keep models used as layers whole.
        verbose: print the ranked table and the recommendation.

    Returns:
        A `Plan`: ``plan.best`` is the recommendation, ``plan.table()`` the ranking.

    Example:
        >>> p = hf.plan(model, ranks=8, batch_size=256)
        >>> hf.fit(model, x, y, partitions=p.best.partitions, replicas=p.best.replicas,
        ...        microbatches=p.best.microbatches, batch_size=256)
    """
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks={ranks!r}: must be a whole number ≥ 1 (the job's MPI ranks).")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be a whole number ≥ 1.")
    ms = sorted({int(m) for m in microbatches})
    if not ms or ms[0] < 1:
        raise ValueError(f"microbatches={microbatches!r}: give whole numbers ≥ 1.")
    for s in schedules:
        if s not in ("1f1b", "gpipe"):
            raise ValueError(f"schedules={schedules!r}: each must be '1f1b' or 'gpipe'.")
    _network(network, "network")
    if allreduce_network is not None:
        _network(allreduce_network, "allreduce_network")
    graph = LayerGraph(model, keep_nested=keep_nested)
    cuts = int(balance_.allowed_starts(graph)[1:-1].sum())
    if profile is None:
        profile = measure(model, microbatch_sizes(batch_size, ranks, ms) or [1],
                          keep_nested=keep_nested)
    predictions = []
    for P in _divisors(ranks):
        if P > cuts + 1:
            continue  # cannot be cut into P stages (layers called at several places)
        R = ranks // P
        for m in ms:
            if batch_size // (R * m) < 1 or (P == 1 and m > 1 and len(ms) > 1):
                continue  # one stage: micro-batches only add steps (unless m was given)
            for schedule in schedules:
                predictions.append(predict(graph, profile, P, R, m, batch_size, schedule,
                                           network, allreduce_network, ranks_per_node))
    order = {s: i for i, s in enumerate(("1f1b", "gpipe"))}
    predictions.sort(key=lambda p: (round(p.step_s, 9), order[p.schedule], p.partitions,
                                    p.microbatches))
    if not predictions:
        raise ValueError(
            f"hf.plan: no configuration of ranks={ranks} fits batch_size={batch_size} with "
            f"microbatches={tuple(ms)} (every micro-batch needs at least one sample per replica, "
            f"and the model can be cut into at most {cuts + 1} stages).")
    result = Plan(predictions, ranks, batch_size, profile)
    if verbose:
        best = result.best
        print(result.table(rows=12))
        print(f"hf.plan: fastest predicted: partitions={best.partitions}, "
              f"replicas={best.replicas}, microbatches={best.microbatches}, "
              f"schedule={best.schedule!r}: {best.step_s * 1e3:.1f} ms per step, "
              f"{best.images_per_s:.1f} images/s", flush=True)
    return result
