"""hf.plan: predict the step time of every P × R × m on N ranks
from one-process measurements, and pick the fastest.

The model of a training step (every term measured or given, nothing fitted to
hyparflow's own runs)::

    b        = batch_size / (R·m)                      samples per micro-batch
    t_s      = f_s · C(b)                              stage s's share of the whole model's
                                                       compiled forward + backward on b samples
             + H(b) · calls_s      (s < P − 1)         a non-last stage's forward runs under a
                                                       tape and hands its tensors to a later
                                                       backward: a cost per layer call
             + Σ (latency + bytes·b / bandwidth)       each boundary tensor it receives
                                                       (forward) or whose error it receives
                                                       (backward): shared memory within a
                                                       node, the network between nodes
    pipeline = Σ_s (k_fill · w_s + x_s)                fill and drain: one stage per pipeline
                                                       computes (k_fill: with the node's
                                                       other pipelines)
             + (m − 1) · max_s (k_all · w_s + x_s)     then the slowest stage, every rank busy
    step     = pipeline + ring(R, 4·params)          every stage's gradient allreduce over
                                                       its replicas at once: 2(R−1) ring
                                                       steps of latency + chunk / bandwidth
                                                       of the slowest hop, the chunks of all
                                                       stages leaving a node sharing its link
             + k_all · max_s U · params_s / params     the optimizer's update, U measured
                                                       on the whole model as a stage
                                                       takes it (`update_seconds`)

With gradient buckets (R > 1, `$HYPARFLOW_BUCKET_MB` not 0) and two or more TensorFlow
inter-op threads where the profile was measured, the allreduce runs during the step's last
backward (hyparflow.engine.buckets), and only what outlasts it counts: the larger of the ring less
stage 0's backward of one micro-batch (⅔ of its compute, the usual forward : backward of
1 : 2; the last to finish, the other stages finish theirs earlier) and the ring of the last
bucket alone (the first layers' gradients, known only at the backward's end).

where w_s is t_s's compute (the first two terms) and x_s its messages.
C(b) is measured on this process (one compiled forward + backward of the
model, at each micro-batch size the candidates need); H(b) is the same
model run the way a non-last stage runs it (the compiled forward under a tape,
then ``tape.gradient``) less C(b), per layer call; f_s is the share of the
per-layer times on b samples that the `"time"` split at b puts on stage s (the times
measured compiled, piece by piece, at the largest and the smallest size:
`timing.profile`; each call on the line between them, `Profile.calls_at`); calls,
boundary tensors and parameters come from the layer graph.
k(n) is the slowdown of compute when n ranks of a node compute at once (they
share its memory bandwidth and caches): measured on every rank of the job at
once when hf.fit plans ("auto"), given as `contention` to `plan`, 1 otherwise;
between 1 and the `Profile.contention_ranks` it was measured at, linear.
k_all = k(min(P·R, ranks per node)); k_fill = k(min(R, ranks per node // P)).
GPipe and 1F1B take the same time in this model (the same bubble); 1F1B keeps
fewer micro-batches' activations, so it ranks first on a tie.

With the step graph (`step_graph`, as ``hf.fit(step_graph=True)``) a non-last stage's forward
is compiled with its backward: every stage is priced as the last is (no H(b)), and the split
is the `"time"` split of fused times that hf.fit then makes; every stage but the last keeps
all m micro-batches (TensorFlow runs the graph in dataflow order: `schedule.kept`).

Interleaved (v stages a rank, `chunks`): the model is split into P·v stages at b, each
priced as above (t_s; a non-last stage's H(b) per call), a rank's parameters and memory
those of all its stages; the pipeline term is the interleaved schedule run on the clock
(`schedule.simulate`), each stage's forward ⅓ of k_all · w_s + x_s and its backward ⅔,
and its replicas' allreduce waits for the backward to end (no buckets).

A rank's memory (the largest rank's is the prediction)::

    memory = base                                      the process before the call (the model,
                                                       the data, TensorFlow: measured)
           + Σ_s weights_s                             each stage it holds: weights, gradient
                                                       sums, optimizer slots
           + Σ_s calls_s · held_per_call(role_s, m, R > 1)
           + Σ_s kept_s · b · HELD[role_s].kept · out_s

where out_s is the bytes per sample of stage s's calls' outputs and boundary tensors, kept_s
the micro-batches it keeps (`schedule.kept`), and role_s how it runs (`costs.role`: the whole
model, a split or fused stage of the executor, or the step graph), whose constants
(`costs.HELD`) are fitted to measured peaks: the one part of the planner fitted to
hyparflow's own runs.
"""

from __future__ import annotations

import bisect
import gc
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from hyparflow.engine import buckets
from hyparflow.engine import schedule as schedule_
from hyparflow.mpi import memory as memory_
from hyparflow.mpi import threads as threads_
from hyparflow.partitioner import balance as balance_
from hyparflow.partitioner import costs as costs_
from hyparflow.partitioner import split as split_
from hyparflow.partitioner import timing
from hyparflow.partitioner.graph import LayerGraph

if TYPE_CHECKING:  # keras loads TensorFlow: imported by the caller, not for the hints
    from collections.abc import Collection, Iterable

    import keras

# The schedules the planner prices, in the order a tie ranks them (1F1B keeps fewer
# activations than GPipe; interleaved sends more messages; ZB-H1 runs only in the step graph)
ORDER = tuple(schedule_.SCHEDULES)
# The weight gradients' share of a backward (W of B + W, ZB-H1's split): measured on
# ResNet-110's first stage of two, micro-batches of 8 and 16 (benchmarks/results/log.md,
# "ZB-H1"): 13-17 ms of 68-72 and 26-28 ms of 128-132.
W_SHARE = 0.2
# A non-last stage's cost per layer call per micro-batch (its forward's tensors handed
# through a GradientTape to the later backward), seconds, for a profile that did not
# measure it (`Profile.split_seconds` empty). Measured on the 2-core machine of
# benchmarks/results/log.md: ~16 ms per micro-batch for ResNet-110's stage 0 (~190 calls),
# against the same forward and backward fused in one function.
HANDOFF = 80e-6


@dataclass(frozen=True)
class Network:
    """Point-to-point cost of a message: `latency` seconds plus bytes / `bandwidth` (bytes/s).

    `allreduce_bandwidth` is what a ring step of an allreduce moves per second over it,
    when measured (`measure_link`): an allreduce between two nodes of the cluster in a
    box's slow profile took 1.45 times what its bytes at `bandwidth` take. None: `bandwidth`.
    """

    latency: float
    bandwidth: float
    allreduce_bandwidth: float | None = None


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
        call_seconds: per layer call, forward + backward on `call_batch` samples as the
            last stage runs it (`timing.profile`: measured compiled, piece by piece).
        call_split_seconds: the same as any other stage runs it (empty: not measured;
            the split then takes `call_seconds` for every stage).
        call_batch: the micro-batch size of `call_seconds`.
        calls_by_size: per-call times at other micro-batch sizes: size → [fused, split]
            lists as `call_seconds` and `call_split_seconds` (`calls_at` interpolates
            between the sizes; empty: the times at `call_batch` stand for every size).
        step_seconds: micro-batch size → seconds of one compiled forward + backward of
            the whole model (at sizes not in `whole_sizes`, from its pieces: `measure`).
        threads: TensorFlow intra-op threads while measuring.
        update_seconds: one optimizer update of every trainable variable as a stage
            takes it, gradients handed from numpy to a compiled apply (0 for a model that
            is not compiled).
        split_seconds: micro-batch size → seconds of the whole model run as a
            non-last stage runs: the compiled forward under a GradientTape, then
            ``tape.gradient`` (empty: the hand-off is `HANDOFF` per call).
        contention: how much slower the compiled step ran with `contention_ranks`
            ranks of a node computing at once than alone (1: not measured).
        contention_ranks: the ranks per node `contention` was measured with.
        inter_op: TensorFlow inter-op threads while measuring (1: not recorded). With two
            or more, TensorFlow runs a stage's gradient buckets' hand-over beside its
            backward, so their allreduce overlaps it (`predict`).
        base_bytes: resident memory of the measuring process before it measured
            (TensorFlow, the script's model and data): what every rank holds
            besides its stage.
        whole_sizes: the sizes at which the whole model was timed; the others are where
            timing it was predicted not to fit the memory a rank may use (empty: at none, or
            a profile saved before this was recorded).
        cut: how `predict` cuts a configuration it is not given the split of: "time" (the
            profile's times, as hf.fit's ``balance="time"``) or "memory" (`for_memory`).
    """

    call_seconds: list
    call_batch: int
    step_seconds: dict = field(default_factory=dict)
    threads: int = 1
    update_seconds: float = 0.0
    split_seconds: dict = field(default_factory=dict)
    contention: float = 1.0
    contention_ranks: int = 1
    base_bytes: float = 0.0
    call_split_seconds: list = field(default_factory=list)
    inter_op: int = 1
    calls_by_size: dict = field(default_factory=dict)
    whole_sizes: list = field(default_factory=list)
    cut: str = "time"

    def __post_init__(self):  # sizes as whole numbers, also from JSON (whose keys are text)
        self.step_seconds = {int(b): float(t) for b, t in self.step_seconds.items()}
        self.split_seconds = {int(b): float(t) for b, t in self.split_seconds.items()}
        self.calls_by_size = {int(b): [list(fused), list(split)]
                              for b, (fused, split) in self.calls_by_size.items()}
        self.whole_sizes = [int(b) for b in self.whole_sizes]

    @classmethod
    def for_memory(cls, graph, base_bytes, cut="time"):
        """A profile of `graph` with placeholder times: `predict` of it is good for its
        memory only (`base_bytes`: what every rank holds besides its stage). `cut`: "time",
        the placeholder's (every call alike), or "memory": each configuration cut where its
        largest rank holds least (``balance="memory"``), the least it can need."""
        return cls(call_seconds=[1.0] * len(graph), call_batch=8, step_seconds={8: 1.0},
                   base_bytes=base_bytes, cut=cut)

    def calls_at(self, b):
        """(fused, split) seconds of each layer call on b samples, as numpy arrays: measured
        at `call_batch` and at the sizes of `calls_by_size`, each call on the line through
        the two measured sizes around b (as `compute` is for the whole model).

        A layer's time is not proportional to its samples alike for every layer (a
        convolution on large maps gains more from a small micro-batch's working set
        than one on small maps), so which calls make half of a model's time moves with
        the micro-batch size; times measured at one size would cut every size there.
        """
        measured = {**self.calls_by_size,
                    self.call_batch: [self.call_seconds, self.call_split_seconds]}
        tables = {size: [np.asarray(fused, float), np.asarray(split or fused, float)]
                  for size, (fused, split) in measured.items()}  # no split: the fused
        return tuple(_interpolate({size: t[k] for size, t in tables.items()}, b)
                     for k in (0, 1))

    def compute(self, b):
        """C(b): compiled forward + backward of the whole model on b samples (interpolated)."""
        return _interpolate(self.step_seconds, b)

    def handoff(self, b):
        """H(b): a non-last stage's extra cost per layer call on b samples, seconds."""
        if not self.split_seconds:
            return HANDOFF
        extra = _interpolate(self.split_seconds, b) - self.compute(b)
        return max(0.0, extra) / max(1, len(self.call_seconds))

    def slowdown(self, busy):
        """k(n): compute's slowdown with `busy` ranks of a node computing at once."""
        if self.contention_ranks <= 1 or busy <= 1:
            return 1.0
        reach = min(busy, self.contention_ranks) - 1
        return 1.0 + (self.contention - 1.0) * reach / (self.contention_ranks - 1)


def _interpolate(table, b):
    """table[b], or the line through the measured sizes around b (size → seconds, a number
    or an array of them, each on its own line)."""
    if b in table:
        return table[b]
    sizes = sorted(table)
    if len(sizes) == 1:
        return table[sizes[0]] * b / sizes[0]
    i = min(max(bisect.bisect_left(sizes, b), 1), len(sizes) - 1)
    lo, hi = sizes[i - 1], sizes[i]
    line = table[lo] + (table[hi] - table[lo]) * (b - lo) / (hi - lo)
    # below the smallest size measured, never less than proportional to it
    return np.maximum(line, table[lo] * b / lo) if b < lo else line


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
    memory_bytes: float = 0.0  # the largest rank's: base + weights, slots, activations kept

    @property
    def bubble(self):
        """Share of the pipeline's time a stage idles on average (fill, drain, imbalance)."""
        busy = sum(self.stage_s) * self.microbatches / self.partitions
        pipeline = self.step_s - self.allreduce_s - self.update_s
        return max(0.0, 1 - busy / pipeline) if pipeline > 0 else 0.0


@dataclass
class Plan:
    """Every prediction, fastest first; `best` is the recommendation."""

    predictions: list
    ranks: int
    batch_size: int
    profile: Profile

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    def table(self, rows: int | None = None) -> str:
        """The ranked predictions as a text table."""
        head = (f"{'P':>3} {'R':>3} {'m':>3} {'schedule':>11} {'micro':>6} {'step ms':>9} "
                f"{'images/s':>9} {'bubble':>7} {'allreduce ms':>12} {'GiB/rank':>8}  "
                "calls per stage")
        lines = [head, "-" * len(head)]
        for p in self.predictions[:rows]:
            lines.append(f"{p.partitions:>3} {p.replicas:>3} {p.microbatches:>3} "
                         f"{p.schedule:>11} {p.microbatch_size:>6} {p.step_s * 1e3:>9.1f} "
                         f"{p.images_per_s:>9.1f} {p.bubble:>7.0%} "
                         f"{p.allreduce_s * 1e3:>12.2f} {p.memory_bytes / 2**30:>8.2f}  "
                         f"{p.sizes}")
        return "\n".join(lines)

    def find(self, partitions: int, replicas: int, microbatches: int,
             schedule: str = "1f1b") -> Prediction:
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
    if isinstance(value, dict) and {"latency", "bandwidth"} <= set(value) <= {
            "latency", "bandwidth", "allreduce_bandwidth"}:
        ring = value.get("allreduce_bandwidth")
        return Network(float(value["latency"]), float(value["bandwidth"]),
                       None if ring is None else float(ring))
    raise ValueError(f"{name}={value!r}: use {' or '.join(map(repr, NETWORKS))}, a "
                     "hyparflow.plan.Network, or {'latency': seconds, 'bandwidth': bytes/s} "
                     "(and 'allreduce_bandwidth': bytes/s, optional).")


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


def measure(model, sizes, call_batch=None, repeats=3, keep_nested=False,
            memory_per_rank=None):
    """A `Profile` of `model`: per-call times (`timing.profile`, compiled piece by piece at
    `call_batch`, and at the smallest size too), and the compiled whole model at each size.

    At each size the whole model is timed twice: forward and backward as one
    compiled function (as the last stage runs), and the compiled forward under
    a GradientTape followed by ``tape.gradient`` (as the other stages run); then the
    optimizer's update (`update_seconds`). The sizes are timed largest first, by one
    function a role (traced for the first size, then once for any size), or, where the room
    would not hold that second graph of each role (predicted as a whole model's calls hold,
    `costs.HELD`), by a function a role and size, each freed before the next: the measuring
    then holds one graph and one size's activations at a time. ResNet-110, sizes 64 to 1:
    1.44 GiB against 1.89 (sizes 1 to 64 in one function: 2.53), 120 s against 69; sizes 16
    to 1: 1.52 GiB in one function, 1.16 by size. The model's weights,
    BatchNormalization statistics and optimizer are left as they were.

    With `memory_per_rank` (bytes) the whole model is timed only at the sizes where timing
    it is predicted to fit (`whole_fits`: one process's step, under a tape); at the others
    its times are its pieces' sums at that size (`Profile.calls_at`), scaled by the whole
    model's over its pieces' at the largest size it was timed at (unscaled where it fits
    at none), and `Profile.whole_sizes` names the sizes timed whole.
    """
    if not sizes:
        raise ValueError("measure: no micro-batch sizes to measure.")
    base = memory_.resident()
    graph = LayerGraph.of(model, keep_nested)
    call_batch = call_batch or max(sizes)
    whole = [b for b in sorted(set(sizes), reverse=True)
             if memory_per_rank is None or whole_fits(graph, base, b, memory_per_rank)]
    # one function a role for every size where the room holds a second graph of each role
    # (as much as a whole model's calls hold: `costs.HELD`); first, so that the pieces after
    # it reuse its memory, not the other way round
    shared = memory_per_rank is None or bool(whole) and whole_fits(
        graph, base + 2 * len(graph) * costs_.held_per_call("whole"), whole[0], memory_per_rank)
    steps, splits = _time_whole(model, whole, repeats, shared)
    calls = timing.profile(graph, call_batch, split_.stage_models, repeats=repeats)
    smallest = min(sizes)
    by_size = {}
    if smallest != call_batch:  # `Profile.calls_at` interpolates between the two
        small = timing.profile(graph, smallest, split_.stage_models, repeats=repeats)
        by_size[smallest] = [small.fused, small.split]
    optimizer = getattr(model, "optimizer", None)
    update = 0.0 if optimizer is None else update_seconds(
        optimizer, list(model.trainable_variables), repeats)
    profile = Profile(calls.fused, call_batch, steps, threads_.in_use("intra"), update, splits,
                      base_bytes=base, call_split_seconds=calls.split,
                      inter_op=threads_.in_use("inter") or os.cpu_count() or 1,
                      calls_by_size=by_size, whole_sizes=whole)
    pieces = {b: [float(np.sum(t)) for t in profile.calls_at(b)] for b in set(sizes)}
    scale = [1.0, 1.0]
    if whole:
        scale = [steps[whole[0]] / pieces[whole[0]][0], splits[whole[0]] / pieces[whole[0]][1]]
    for b in set(sizes) - set(whole):
        profile.step_seconds[b] = pieces[b][0] * scale[0]
        profile.split_seconds[b] = pieces[b][1] * scale[1]
    return profile


def _time_whole(model, sizes, repeats, shared):
    """Seconds of the whole model at each of `sizes` ({size: fused}, {size: split}), largest
    first: `shared`, by one function a role (compiled for the first size, then once more for
    any size); else by a function a role and size, each freed before the next is made."""
    steps, splits = {}, {}
    roles = None
    for b in sorted(sizes, reverse=True):
        for role, seconds in (("fused", steps), ("split", splits)):
            if roles is None:
                roles = timing.Roles(model)
            try:
                xs = roles.inputs(b)
                seconds[b] = timing.typical(lambda: getattr(roles, role)(xs), repeats)
            finally:
                roles.restore()
            if not shared:
                roles = None
                gc.collect()  # (its functions are in a cycle)
    return steps, splits


def whole_fits(graph, base_bytes, b, memory_per_rank):
    """Whether timing the whole of `graph` on b samples a step is predicted to fit
    `memory_per_rank` bytes, holding `base_bytes` besides: one process's step, each call
    holding what a stage before the last holds (its forward under a tape, `costs.HELD`),
    the most either role timed holds (ResNet-110 at 32 samples: predicted 1.36 GiB, timed
    1.28)."""
    need = predict(graph, Profile.for_memory(graph, base_bytes), 1, 1, 1, b).memory_bytes
    under_tape = costs_.held_per_call("split") - costs_.held_per_call("whole")
    return need + len(graph) * under_tape <= memory_per_rank


def sizes_to_measure(model, ranks, batch_size, *, memory_per_rank=None,
                     microbatches=(1, 2, 4, 8, 16, 32), keep_nested=False, **options):
    """The micro-batch sizes `plan` needs measured: with `memory_per_rank` (bytes, or the
    `memory_.Budget` they come from, which its error then names) only those of the
    configurations predicted to fit it (memory is predicted without timing, each
    configuration at the cut where it needs least: whatever cut the times choose, it needs
    no less), so the measuring times nothing no chosen configuration runs.

    `options`: `plan`'s (schedules, chunks, step_graph, shard_optimizer, ranks_per_node, ...).

    Raises:
        ValueError: `plan`'s, before anything is measured: no configuration fits.
    """
    limit = memory_per_rank
    if isinstance(limit, memory_.Budget):
        limit = limit.bytes
    if limit is None:
        return microbatch_sizes(batch_size, ranks, microbatches) or [1]
    graph = LayerGraph.of(model, keep_nested)
    fitting = plan(model, ranks, batch_size, microbatches=microbatches, keep_nested=keep_nested,
                   profile=Profile.for_memory(graph, memory_.resident(), cut="memory"),
                   memory_per_rank=memory_per_rank, verbose=0, **options)
    return sorted({p.microbatch_size for p in fitting.predictions})


def update_seconds(optimizer, variables, repeats=3):
    """Seconds of one update of `variables` by `optimizer` as a stage takes it (its
    gradients arrive as numpy arrays and are handed to one compiled ``apply``), timed with
    a copy of the optimizer on zeroed copies of the variables: even a zero gradient moves a
    weight that decays, and rank 0's weights are every rank's."""
    import keras

    from hyparflow.keras import optimizers as optimizers_

    twins = [keras.Variable(np.zeros(v.shape, v.dtype), dtype=v.dtype, name=v.name)
             for v in variables]
    apply = optimizers_.compiled_apply(type(optimizer).from_config(optimizer.get_config()),
                                       twins)
    grads = [np.zeros(v.shape, v.dtype) for v in variables]
    return timing.typical(lambda: apply(optimizers_.as_tensors(grads)), repeats)


def measure_contention(model, b, comm, profile, busy=None, seconds=1.0, rounds=3):
    """`profile` with its `contention`: the compiled step at `b`, rank 0 alone then
    every rank at once.

    Collective. Rank 0 times a loop of the compiled forward + backward lasting
    about `seconds` while the others wait without spinning; then every rank
    runs the same loop at once. A round's slowdown is the median over ranks of
    their loop's time over rank 0's alone; the contention is the median of
    `rounds` rounds (a shared machine's speed drifts between loops), recorded as
    measured with `busy` ranks per node (default: all of `comm`'s). A failure on
    any rank is raised on every rank.
    """
    from hyparflow.mpi import comm as comm_
    from hyparflow.mpi import guard as guard_

    wait = guard_.bounded(comm, "every rank's timing of the model (hf.plan)")

    def agreed(value, what):
        """`value` (ok, result) from every rank; raise on all if any failed."""
        values = comm_.allgather_objects(value, comm, wait)
        errors = [v for ok, v in values if not ok]
        if errors:
            raise RuntimeError(f"hf.plan: {what} failed: {errors[0]}")
        return [v for _, v in values]

    def attempt(work):
        try:
            return True, work()
        except BaseException as exc:  # every rank must hear of it, or the others wait
            return False, f"{type(exc).__name__}: {exc}"

    def prepare():
        roles = timing.Roles(model)
        xs = roles.inputs(b)
        roles.fused(xs)  # trace outside the timing, each rank at its own pace
        return roles, xs

    ok, prepared = attempt(prepare)
    agreed((ok, None if ok else prepared), "tracing the model on every rank")
    roles, xs = prepared
    run = lambda: roles.fused(xs)  # noqa: E731

    def alone():
        start = time.perf_counter()
        run()
        calls = max(3, math.ceil(seconds / (time.perf_counter() - start)))
        return calls, _loop(run, calls)

    slowdowns = []
    try:
        for _ in range(rounds):
            calls, alone_s = comm_.from_root(comm, alone, "hf.plan: timing the model alone")
            comm_.barrier(comm, wait)
            together = agreed(attempt(lambda: _loop(run, calls)), "timing the model at once")
            slowdowns.append(float(np.median([t / alone_s for t in together])))
    finally:
        roles.restore()
    return replace(profile, contention=max(1.0, float(np.median(slowdowns))),
                   contention_ranks=busy or comm.Get_size())


def measure_link(comm, nbytes=4 << 20, rounds=5, pings=100):
    """The `Network` between rank 0's node and the next node of `comm`, or None on one node
    (`link.measure`: collective)."""
    from hyparflow.mpi import link

    figures = link.measure(comm, nbytes, rounds, pings)
    if figures is None:
        return None
    latency, bandwidth, ring = figures
    return Network(latency=latency, bandwidth=bandwidth, allreduce_bandwidth=ring)


def _loop(run, calls):
    """Seconds per call of `calls` back-to-back calls of `run`."""
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def time_split(graph, profile, partitions, microbatch_size=None, step_graph=False):
    """Calls per stage of the exact split by the profile's per-call times on
    `microbatch_size` samples (None: at `call_batch`) — `balance="time"`, which times the
    calls at the micro-batch size, without its message costs, which hf.fit prices by fixed
    defaults — each stage's calls timed in its role (the last fused, the others split, when
    both were measured; every stage fused with the step graph): cuts only where a stage may
    start (as `partition` cuts: `balance.cuts_for`)."""
    fused, split = profile.calls_at(microbatch_size or profile.call_batch)
    if partitions == 1:
        return [len(fused)]
    costs = costs_.Costs("time", "s", fused if step_graph else split, np.zeros(len(fused)),
                         dict.fromkeys(graph.tensors, 0.0), last=fused)
    return balance_.split(costs, partitions, graph, balance_.cuts_for(graph, partitions))[0]


def memory_split(graph, partitions, microbatches, microbatch_size, schedule="1f1b", chunks=1,
                 step_graph=False):
    """Calls per stage of the split where the stage holding most holds least, as
    ``balance="memory"`` makes it (`partitions` counts every stage, `chunks` a rank's)."""
    if partitions == 1:
        return [len(graph)]
    costs = costs_.costs(graph, "memory", partitions=partitions, microbatch_size=microbatch_size,
                         microbatches=microbatches, schedule=schedule, chunks=chunks,
                         step_graph=step_graph)
    return balance_.split(costs, partitions, graph, balance_.cuts_for(graph, partitions))[0]


@dataclass(frozen=True)
class _SplitTerms:
    """What a split's stages hold and exchange, per stage, whatever the batch and network."""

    param_bytes: list     # trainable parameters, bytes
    links: list           # (receiver, sender, messages, bytes per sample) per micro-batch:
                          # every boundary tensor forward and its error backward
    static_bytes: list    # weights, gradient sums and optimizer slots
    kept_bytes: list      # per sample of one micro-batch: outputs and boundaries, bytes


def _split_terms(graph, sizes):
    """`_SplitTerms` of a split (calls per stage), kept on the graph: every prediction of the
    same split reuses them."""
    cache = graph.__dict__.setdefault("_planner_terms", {})
    key = tuple(int(n) for n in sizes)
    if key in cache:
        return cache[key]
    P = len(sizes)
    stage_of = np.repeat(np.arange(P), sizes)
    seen, param_bytes = set(), [0.0] * P
    for c in graph.calls:
        trainable, _ = costs_._param_count(c.layer, seen)
        param_bytes[stage_of[c.index]] += 4.0 * trainable
    pairs = {}  # (receiver, sender) → [messages, bytes per sample]
    outputs = set(graph.outputs)
    for key_, producer in graph.producer.items():
        if producer is None:
            continue  # a model input: every stage reads its own copy
        src = int(stage_of[producer])
        nbytes = costs_.bytes_per_sample(graph.tensors[key_])
        for d in split_.readers(graph, stage_of, key_, outputs):
            # the activation, received forward by d; its error, received backward by src
            for pair in ((d, src), (src, d)):
                pair_ = pairs.setdefault(pair, [0, 0.0])
                pair_[0] += 1
                pair_[1] += nbytes
    links = [(r, s, n, nbytes) for (r, s), (n, nbytes) in sorted(pairs.items())]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    optimizer = getattr(graph.model, "optimizer", None)
    weights = costs_.weight_bytes(graph, optimizer)
    static = [float(weights[a:z].sum()) for a, z in zip(bounds, bounds[1:])]
    kept = costs_.costs(graph, "memory", partitions=P, microbatch_size=1, microbatches=1,
                        optimizer=optimizer)
    per_sample = balance_.stage_costs(
        replace(kept, calls=np.zeros(len(kept.calls)), last=None, in_flight=(1,) * P), graph,
        bounds)
    cache[key] = _SplitTerms(param_bytes, links, static, per_sample)
    return cache[key]


def _node(rank, per_node):
    """The node of `rank` when each node holds `per_node` consecutive ranks (as placement
    arranges them; Topology's rank = replica · P + stage)."""
    return rank // per_node


def _transfers(terms, P, R, b, per_node, intra, inter):
    """Seconds each stage spends receiving per micro-batch, for the replica whose messages
    cost most: a message between stages of one node by `intra`, across nodes by `inter`
    (stage s on the pipeline's rank s mod P: with several a rank, interleaved)."""
    V = len(terms.param_bytes)
    worst = [0.0] * V
    # where the pipeline starts within its node decides which boundaries cross: at most
    # per_node different starts, whatever R
    for start in sorted({(r * P) % per_node for r in range(R)}):
        seconds = [0.0] * V
        for receiver, sender, n, nbytes in terms.links:
            crosses = _node(start + receiver % P, per_node) != \
                _node(start + sender % P, per_node)
            net = inter if crosses else intra
            seconds[receiver] += n * net.latency + nbytes * b / net.bandwidth
        worst = [max(w, x) for w, x in zip(worst, seconds)]
    return worst


def _allreduce(param_bytes, P, R, per_node, intra, inter):
    """Seconds of every stage's gradient allreduce over its R replicas, run at once.

    Each stage's ranks reduce in a ring ordered by replica: 2(R − 1) steps, each
    sending a 1/R chunk of the stage's gradients to the next replica and lasting as
    long as its slowest hop. The hops that leave a node share that node's link with
    every other stage's hops leaving it at the same step (a hybrid's stages reduce
    concurrently), so a step between nodes costs the link's latency plus the node's
    busiest load over its bandwidth; within a node, a hop costs its own chunk. A
    network's `allreduce_bandwidth`, when measured, stands for its bandwidth here.
    hyparflow's sum is this ring below 4 replicas (`mpi/sums.py`); from 4, MPI's
    out-of-place allreduce, which moves no more bytes across nodes (Open MPI's halving then
    doubling: at 2 nodes × 2 ranks the array once each way, the ring 1.5 times).
    """
    if R == 1:
        return 0.0
    load, inside = {}, 0.0  # bytes leaving each node per step; the largest chunk inside one
    for s in range(P):
        chunk = param_bytes[s] / R
        for r in range(R):
            here = _node(r * P + s, per_node)
            there = _node(((r + 1) % R) * P + s, per_node)
            if here != there:
                load[here] = load.get(here, 0.0) + chunk
            else:
                inside = max(inside, chunk)
    step = intra.latency + inside / (intra.allreduce_bandwidth or intra.bandwidth) \
        if inside else 0.0
    if load:
        step = max(step, inter.latency
                   + max(load.values()) / (inter.allreduce_bandwidth or inter.bandwidth))
    return 2 * (R - 1) * step


def _last_bucket(nbytes, limit):
    """Bytes of a stage's last bucket (its first layers'), reduced after the backward: the
    gradients packed from the last layer back into buckets of `limit` bytes (None: as
    `buckets.layout` chooses), exactly — the remainder, or a whole bucket."""
    if nbytes <= 0:
        return 0.0
    limit = buckets.limit_of(nbytes, limit)
    return nbytes - limit * math.ceil(nbytes / limit - 1)


def predict(graph, profile, partitions, replicas, microbatches, batch_size, schedule="1f1b",
            network="shm", allreduce_network=None, ranks_per_node=None, handoff=None,
            split=None, bucket_bytes=None, chunks=2, step_graph=False):
    """The predicted `Prediction` of one configuration (see the module's formula).

    The split is `split` (calls per stage) if given, else the `"time"` split
    hf.fit would make (`time_split`). `handoff` (seconds per call) overrides the
    profile's H(b) (`step_graph`: each stage's step one graph, no hand-off).
    `bucket_bytes`: as `buckets.cap()` reads `$HYPARFLOW_BUCKET_MB` (None:
    hyparflow's choice; 0: one allreduce after the backward). `chunks`: the stages a
    rank holds under the interleaved schedule (P > 1).
    """
    P, R, m = partitions, replicas, microbatches
    kind = schedule_.by_name(schedule)
    v = chunks if kind.chunked and P > 1 else 1
    b = max(1, batch_size // (R * m))
    intra = _network(network, "network")
    inter = _network(allreduce_network or network, "allreduce_network")
    per_node = ranks_per_node or P * R
    calls = profile.calls_at(b)[0]  # each stage's share of the whole model's time
    V = P * v  # stages
    if split is not None:
        sizes = list(split)
    elif profile.cut == "memory":
        sizes = memory_split(graph, V, m, b, schedule, v, step_graph)
    else:
        sizes = time_split(graph, profile, V, b, step_graph)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    total = calls.sum() or 1.0
    share = [calls[a:z].sum() / total for a, z in zip(bounds, bounds[1:])]
    terms = _split_terms(graph, sizes)
    # a rank's parameters: those of every stage it holds
    param_bytes = [sum(terms.param_bytes[p::P]) for p in range(P)]
    transfer = _transfers(terms, P, R, b, per_node, intra, inter)
    compute = profile.compute(b)
    per_call = handoff if handoff is not None else 0.0 if step_graph else profile.handoff(b)
    work = [share[s] * compute + (per_call * sizes[s] if s < V - 1 else 0.0) for s in range(V)]
    fill = profile.slowdown(min(R, max(1, per_node // P)))  # a stage of each pipeline
    steady = profile.slowdown(min(P * R, per_node))  # then every rank of the node
    stage_s = [steady * work[s] + transfer[s] for s in range(V)]
    if v == 1 and (not kind.split or P == 1):
        pipeline = sum(fill * work[s] + transfer[s] for s in range(P)) + (m - 1) * max(stage_s)
    else:  # the schedule run on the clock, each stage's forward ⅓ of its time, backward ⅔
        # (split, ZB-H1: its weight gradients `W_SHARE` of it)
        split = kind.split
        parts = {schedule_.FORWARD: 1 / 3, schedule_.FUSED: 1.0,
                 schedule_.BACKWARD: 2 / 3 * (1 - W_SHARE if split else 1),
                 schedule_.WEIGHT: 2 / 3 * W_SHARE}
        length = lambda a: parts[a.kind] * stage_s[a.stage]  # noqa: E731
        starts = schedule_.simulate(schedule_.lower(schedule_.build(schedule, P, m, v)),
                                    durations=length)
        pipeline = max(t + length(a) for a, t in starts.items())
    allreduce = _allreduce(param_bytes, P, R, per_node, intra, inter)
    if allreduce and bucket_bytes != 0 and profile.inter_op >= 2 and v == 1:
        # during the last backward (a rank holding several stages reduces after it)
        last = [_last_bucket(n, bucket_bytes) for n in param_bytes]
        allreduce = max(allreduce - 2 / 3 * steady * work[0],
                        _allreduce(last, P, R, per_node, intra, inter))
    total = sum(param_bytes) or 1.0
    update = steady * profile.update_seconds * max(nbytes / total for nbytes in param_bytes)
    step = pipeline + allreduce + update
    in_flight = schedule_.kept(schedule, P, m, v, step_graph)
    roles = [costs_.role(s, V, step_graph) for s in range(V)]
    held = [static + calls * costs_.held_per_call(role, m, R > 1)
            + costs_.HELD[role].kept * f * b * kept
            for static, f, kept, calls, role in zip(
                terms.static_bytes, in_flight, terms.kept_bytes, sizes, roles)]
    memory = profile.base_bytes + max(sum(held[p::P]) for p in range(P))
    return Prediction(P, R, m, schedule, b, step, batch_size / step, stage_s, allreduce,
                      [int(s) for s in sizes], update, memory)


def plan(model: keras.Model, ranks: int, batch_size: int, *,
         microbatches: Iterable[int] = (1, 2, 4, 8, 16, 32),
         schedules: Collection[str] | None = None, chunks: int = 2,
         network: str | Network | dict[str, float] = "shm",
         allreduce_network: str | Network | dict[str, float] | None = None,
         ranks_per_node: int | None = None, profile: Profile | None = None,
         contention: float | None = None,
         memory_per_rank: float | memory_.Budget | Literal["auto"] | None = "auto",
         keep_nested: bool = False, shard_optimizer: bool = False, step_graph: bool = False,
         verbose: int = 1) -> Plan:
    """Predict the step time of every (P, R, m, schedule) with P × R = `ranks`, fastest first.

    Args:
        model: a built functional or Sequential keras.Model (not changed).
        ranks: N, the ranks the job will have.
        batch_size: the global batch.
        microbatches: the m to consider (those that leave at least one sample per
            micro-batch and replica are kept; with one stage only m = 1, unless
            `memory_per_rank` is set: then more micro-batches accumulate gradients
            in less memory).
        schedules: the schedules to list (None: 1F1B and GPipe, and with `step_graph` the
            interleaved too: the schedules whose predictions were measured within ±15 %
            of runs, benchmarks/README.md; with the executor its per-action costs at
            many micro-batches are not modelled and interleaved m = 8 ran 22 % slower
            than predicted). "zb-h1" is priced only when listed (with `step_graph`).
        network: the messages' cost between ranks of a node: "shm" (default),
            "infiniband", a `Network`, or ``{"latency": s, "bandwidth": bytes/s}``.
        allreduce_network: the cost of what crosses nodes, when P × R exceeds
            `ranks_per_node` (default: `network`): the allreduce rings' hops between
            nodes and the pipeline boundaries the placement puts across them.
        ranks_per_node: ranks on one node (default: all of them).
        profile: a `Profile` from an earlier plan (``plan.profile``): nothing is measured.
        contention: how much slower a rank computes while every rank of its node
            computes (e.g. 1.1; ≥ 1). Measured when hf.fit plans ("auto"); in one
            process it cannot be, and is the profile's (1 unless measured).
        memory_per_rank: bytes a rank may use; configurations predicted to need
            more are left out. "auto" (default): this machine's share for each of
            `ranks_per_node` (default all `ranks`) ranks: the job's memory limit (cgroup)
            or the node's memory, or ``$HYPARFLOW_MEMORY_PER_RANK`` GiB
            (`hyparflow.mpi.memory.per_rank`, which returns the `Budget` this also
            takes); pass the bytes when planning for another machine, None for no
            limit. A rank's prediction is the profile's `base_bytes` plus its stages'
            weights, gradient sums, optimizer slots, what their calls hold in the way
            they run and the activations of the micro-batches they keep (the
            partitioner's ``balance="memory"`` estimate, with `costs.REPLICATED` a call
            more with replicas: the module's memory formula).
        keep_nested: as in `hf.fit`: keep models used as layers whole.
        shard_optimizer: as in `hf.fit`. Unsharded, the gradients are summed in buckets
            during the backward (`$HYPARFLOW_BUCKET_MB`, read here as hf.fit reads it)
            where the profile was measured with two or more TensorFlow inter-op threads;
            sharded, after it.
        step_graph: as in `hf.fit`: each stage's training step compiled as one graph, a
            non-last stage priced as the last is (no hand-off per layer call) and split so.
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
    if schedules is None:
        schedules = tuple(s.name for s in schedule_.SCHEDULES.values() if s.planned == "always"
                          or s.planned == "step_graph" and step_graph is True)
    for s in schedules:
        if s not in ORDER:
            raise ValueError(f"schedules={schedules!r}: each must be one of "
                             f"{', '.join(map(repr, ORDER))}.")
    for s in schedules:
        schedule_.by_name(s).refuse_without_step_graph(
            step_graph, f"schedules={schedules!r} with step_graph={step_graph!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r}: the stages a rank holds under the interleaved "
                         "schedule, a whole number ≥ 1.")
    if not isinstance(step_graph, bool):
        raise ValueError(f"step_graph={step_graph!r}: True (each stage's step one compiled "
                         "graph, as hf.Schedule(step_graph=True) gives hf.fit) or False.")
    _network(network, "network")
    if allreduce_network is not None:
        _network(allreduce_network, "allreduce_network")
    budget = None  # what the limit is, for messages
    if isinstance(memory_per_rank, str) and memory_per_rank == "auto":
        memory_per_rank = memory_.per_rank(ranks_per_node or ranks)
    given = memory_per_rank  # (a Budget names where the limit comes from)
    if isinstance(memory_per_rank, memory_.Budget):
        memory_per_rank, source = memory_per_rank
        if memory_per_rank is not None:
            budget = f"the {memory_per_rank / 2**30:.2f} GiB a rank may use ({source})"
    elif memory_per_rank is not None and (isinstance(memory_per_rank, bool) or not isinstance(
            memory_per_rank, (int, float)) or not memory_per_rank > 0):
        raise ValueError(f"memory_per_rank={memory_per_rank!r}: give the bytes a rank may use "
                         "(e.g. 16 * 2**30), 'auto' for this machine's share, or None for no "
                         "limit.")
    if memory_per_rank is not None and budget is None:
        budget = f"memory_per_rank={memory_per_rank / 2**30:.2f} GiB"
    if contention is not None and (isinstance(contention, bool) or not isinstance(
            contention, (int, float)) or not contention >= 1):
        raise ValueError(f"contention={contention!r}: give a slowdown ≥ 1 (1.0: none), the "
                         "time of a step with every rank of a node busy over its time alone.")
    bucket_bytes = 0 if shard_optimizer else buckets.cap()  # a bad value: its error, now
    graph = LayerGraph.of(model, keep_nested)
    cuts = int(balance_.allowed_starts(graph, tie=True)[1:-1].sum())
    if profile is None:
        sizes = sizes_to_measure(
            model, ranks, batch_size, memory_per_rank=given, microbatches=ms,
            keep_nested=keep_nested, schedules=schedules, chunks=chunks, network=network,
            allreduce_network=allreduce_network, ranks_per_node=ranks_per_node,
            shard_optimizer=shard_optimizer, step_graph=step_graph)
        profile = measure(model, sizes, keep_nested=keep_nested, memory_per_rank=memory_per_rank)
    if contention is not None:
        profile = replace(profile, contention=float(contention),
                                      contention_ranks=min(ranks, ranks_per_node or ranks))
    predictions = []
    for P in _divisors(ranks):
        if P > cuts + 1:
            continue  # cannot be cut into P stages (a shared layer with state, strings)
        R = ranks // P
        for m in ms:
            if batch_size // (R * m) < 1:
                continue
            for schedule in schedules:
                if schedule_.by_name(schedule).chunked and (
                        P * chunks > cuts + 1 if P > 1 else len(schedules) > 1):
                    continue  # too few places to cut; or one stage a rank, which runs as
                    # the other schedules' (listed alone, as hf.fit's "auto" asks, it stays:
                    # hf.fit(schedule="interleaved", partitions=1) is data parallel)
                predictions.append(predict(graph, profile, P, R, m, batch_size, schedule,
                                           network, allreduce_network, ranks_per_node,
                                           bucket_bytes=bucket_bytes, chunks=chunks,
                                           step_graph=step_graph))
    too_big = []
    if memory_per_rank is not None:
        too_big = [p for p in predictions if p.memory_bytes > memory_per_rank]
        predictions = [p for p in predictions if p.memory_bytes <= memory_per_rank]
        if too_big and not predictions:
            least = min(too_big, key=lambda p: p.memory_bytes)
            raise ValueError(
                f"hf.plan: no configuration of ranks={ranks} fits {budget}; the least needs "
                f"{least.memory_bytes / 2**30:.2f} GiB (P={least.partitions}, "
                f"R={least.replicas}, m={least.microbatches}, {least.schedule}): use more "
                "ranks, a smaller batch_size, or more memory per rank.")
    # One stage: micro-batches only add time (unless m was given), but keep fewer activations:
    # m > 1 stays only under a memory limit, where m = 1 does not fit it.
    whole = {(p.replicas, p.schedule) for p in predictions
             if p.partitions == 1 and p.microbatches == 1}
    predictions = [p for p in predictions if not (
        p.partitions == 1 and p.microbatches > 1 and len(ms) > 1
        and (memory_per_rank is None or (p.replicas, p.schedule) in whole))]
    order = {s: i for i, s in enumerate(ORDER)}
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
        if too_big:
            print(f"hf.plan: {len(too_big)} configurations left out, predicted above "
                  f"{budget}", flush=True)
        if profile.contention_ranks > 1:
            print(f"hf.plan: compute {profile.contention:.2f}× slower with "
                  f"{profile.contention_ranks} ranks of a node computing at once", flush=True)
        print(f"hf.plan: fastest predicted: partitions={best.partitions}, "
              f"replicas={best.replicas}, microbatches={best.microbatches}, "
              f"schedule={best.schedule!r}: {best.step_s * 1e3:.1f} ms per step, "
              f"{best.images_per_s:.1f} images/s", flush=True)
    return result
