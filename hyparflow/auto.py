"""partitions="auto", replicas="auto", schedule="auto": the planner's fastest choice, made on
rank 0 and the same on every rank, kept on the model for later calls."""

from __future__ import annotations

import numpy as np

from hyparflow import arguments
from hyparflow.data import sources
from hyparflow.mpi import comm as comm_
from hyparflow.mpi import guard as guard_
from hyparflow.mpi import memory as memory_
from hyparflow.mpi import placement
from hyparflow.partitioner.graph import LayerGraph, is_graph_model


def resolve(model, a):
    """`a` (an `arguments.Call`) with ``partitions="auto"`` / ``replicas="auto"`` /
    ``schedule="auto"`` resolved into the planner's fastest choice, and the default balance.

    Collective: on a launched job every rank first shows the others its P, R, m,
    batch size and schedule (ranks that disagree fail together, instead of some
    waiting for a plan) and its memory (kept in the call as `memory`: the least a rank may
    use, the most a rank holds, for `defaults.resolve`); then `_choose` measures the model
    and every rank gets the same P, R and schedule (and m, when `microbatches` is None). An
    error, on rank 0 or in the arguments, is raised on every rank. The choice is kept on
    the model, so later calls with the same arguments do not plan again (and
    cannot pick another split). Under "auto" the default balance is "time", the
    split the planner assumed, and a schedule left out (None) is 1F1B's; otherwise both are
    left to `defaults.resolve`.
    """
    P, R = a.partitions, a.replicas
    auto = "auto" in (P, R, a.schedule)
    if auto and a.balance is None:
        a = a.replace(balance="time")
    if auto and a.schedule is None:
        a = a.replace(schedule="1f1b")
    world = comm_.world() if comm_.launched() else None
    N = world.Get_size() if world is not None else 1
    if world is not None and N > 1:
        asked = (repr(P), repr(R), repr(a.microbatches), repr(a.batch_size), repr(a.schedule))
        # (the call's first collective: bounded, as `agreement.start`'s agreement is)
        arrive = guard_.bounded(
            world, "every rank to call hf.fit (it is collective: call it on every rank)")
        everyone = comm_.allgather_objects((asked, _room(N)), world, wait=arrive)
        if len({given for given, _ in everyone}) > 1:
            raise ValueError(
                "hf.fit got different partitions, replicas, microbatches, batch_size or "
                "schedule on different ranks (one passing 'auto', another a value?): pass the "
                "same on every rank.")
        a = a.replace(memory=_tightest([room for _, room in everyone]))
    if not auto:
        return a
    key = (N, repr(P), repr(R), repr(a.microbatches), repr(a.batch_size),
           repr(a.schedule), repr(a.chunks), repr(a.step_graph), a.keep_nested)
    chosen = model.__dict__.setdefault("_hyparflow_auto", {})
    if key not in chosen:
        chosen[key] = _choose(model, N, P, R, a, world)
    P, R, m, schedule, speedup = chosen[key]
    return a.replace(partitions=P, replicas=R, schedule=schedule, predicted_speedup=speedup,
                     microbatches=m if a.microbatches is None else a.microbatches)


def _room(N):
    """This rank's (bytes it may use or None, where that comes from, bytes it holds now)."""
    try:
        budget = memory_.per_rank(placement.ranks_per_node() or N)
    except ValueError:  # a bad $HYPARFLOW_MEMORY_PER_RANK: refused where it is read
        budget = memory_.Budget(None, "unknown")
    return budget.bytes, budget.source, memory_.resident()


def _tightest(rooms):
    """Of every rank's `_room`, the least any rank may use (with where it comes from) and the
    most any holds: the same on every rank, for `defaults.resolve` to size its choice by."""
    known = [(nbytes, source) for nbytes, source, _ in rooms if nbytes is not None]
    nbytes, source = min(known) if known else (None, rooms[0][1])
    return nbytes, source, max(held for _, _, held in rooms)


def _choose(model, N, P, R, a, world):
    """(P, R, m, schedule, predicted speed-up over one process) from `planner.plan` for N
    ranks, keeping whichever of P, R and the schedule was given (schedule="auto": among
    those `planner.plan` ranks by default, the interleaved one only with the step graph).

    Collective on a launched job (the arguments are the same on every rank, so
    their checks fail alike): rank 0 measures the model alone while the others
    wait, then every rank times the compiled model at once (the contention of a
    node's ranks), and every rank ranks the same predictions.
    """
    from hyparflow import planner

    for name, value in (("partitions", P), ("replicas", R)):
        if value != "auto":
            arguments.whole_number(name, value)
    if a.schedule == "auto" and a.chunks is not None:
        raise ValueError(f"schedule={a.named_schedule()}: the planner chooses the schedule "
                         "(interleaved with 2 stages a rank). Pass "
                         f"hf.Schedule('interleaved', chunks={a.chunks!r}), or leave chunks out.")
    if a.cut is not None:
        raise ValueError(f"balance=<a Partition into {len(a.cut.stages)} stages> with "
                         f"partitions={P!r}, replicas={R!r}: the Partition fixes the stages; "
                         "pass whole numbers, or a balance method for the planner to cut by.")
    arguments.check_step_graph(a, 1)  # before planning with it
    one_stage = "1f1b" if a.schedule == "auto" else a.schedule  # the schedule of one stage
    if "auto" not in (P, R) and P * R != N:
        return P, R, None, one_stage, None  # hf.fit's check of the job's size names it
    for name, value in (("partitions", P), ("replicas", R)):
        if value != "auto" and N % value:
            raise ValueError(f"{name}={value} with the other 'auto': the job's {N} MPI "
                             f"ranks must be a multiple of {value}.")
    batch_size = a.batch_size
    if sources.streamed(a.x) or not isinstance(batch_size, (int, np.integer)) \
            or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(
            f"partitions={P!r}, replicas={R!r}, schedule={a.schedule!r} needs numpy inputs and "
            f"a whole batch_size (got batch_size={batch_size!r}); with a dataset or a "
            "generator, choose with hf.plan(model, ranks, batch_size) and pass partitions, "
            "replicas and schedule.")
    if N == 1:
        return 1, 1, None, one_stage, None
    if not is_graph_model(model):  # a subclassed model cannot be cut: data parallel only
        if P not in ("auto", 1):
            raise ValueError(f"partitions={P!r}: a subclassed model cannot be cut into "
                             "stages; use partitions=1 (or 'auto').")
        return 1, N, None, one_stage, None

    batch_size = int(batch_size)
    ms = (a.microbatches,) if a.microbatches is not None else (1, 2, 4, 8, 16, 32)
    memory_.given()  # a bad $HYPARFLOW_MEMORY_PER_RANK: its error on every rank
    per_node = placement.ranks_per_node()
    options = dict(  # `planner.plan`'s, for the sizes to measure and for the plan
        microbatches=ms, schedules=None if a.schedule == "auto" else (a.schedule,),
        chunks=a.chunks or 2, keep_nested=a.keep_nested, ranks_per_node=per_node,
        shard_optimizer=a.shard_optimizer, step_graph=arguments.step_graph_of(a))

    def measure():
        """Rank 0's profile of the model and the memory a rank may use (available memory
        moves from rank to rank), or the error of a job no configuration fits (predicted
        before anything is timed): the same for all."""
        limit = memory_.per_rank(per_node or N)
        try:
            sizes = planner.sizes_to_measure(model, N, batch_size, memory_per_rank=limit,
                                             **options)
        except ValueError as exc:
            return None, limit, str(exc)
        return planner.measure(model, sizes, keep_nested=a.keep_nested,
                               memory_per_rank=limit.bytes), limit, None

    profile, limit, refused = comm_.from_root(
        world, measure, f"hf.fit(partitions={P!r}, replicas={R!r}): measuring the model")
    if refused is not None:
        raise guard_.Guard.mark_agreed(ValueError(refused))
    between = None  # several nodes: messages between them cost what the link measures
    if world is not None:
        # every rank at once times the whole model where one process fits it (none: the
        # contention is not measured, 1)
        fits = [b for b in profile.whole_sizes if b <= max(1, batch_size // N)]
        if fits:
            profile = planner.measure_contention(model, max(fits), world, profile,
                                                 busy=min(N, per_node or N))
        if per_node is not None and per_node < N:
            between = planner.measure_link(world)
            if between is not None and a.verbose != 0 and world.Get_rank() == 0:
                print(f"hf.plan: between nodes {between.latency * 1e6:.1f} µs one way, "
                      f"{between.bandwidth / 1e6:.0f} MB/s, an allreduce "
                      f"{between.allreduce_bandwidth / 1e6:.0f} MB/s (measured)", flush=True)
    try:  # (from rank 0's profile and limit: the same verdict on every rank)
        result = planner.plan(
            model, N, batch_size, allreduce_network=between, profile=profile,
            memory_per_rank=limit, verbose=a.verbose != 0 and (
                world is None or world.Get_rank() == 0), **options)
    except ValueError as exc:
        raise guard_.Guard.mark_agreed(exc)
    one = planner.predict(LayerGraph.of(model, a.keep_nested), result.profile, 1, 1, 1,
                          batch_size).step_s  # (rank 0's profile: alike on every rank)
    fitting = [(p.partitions, p.replicas, p.microbatches, p.schedule, one / p.step_s)
               for p in result.predictions
               if P in ("auto", p.partitions) and R in ("auto", p.replicas)]
    # rank 0's choice for all: a tie must not break differently on another rank
    choice = comm_.broadcast_object(fitting[:1], 0, world, guard_.bounded(
        world, "rank 0's choice of configuration")) if world is not None else fitting[:1]
    if not choice:
        raise ValueError(f"partitions={P!r}, replicas={R!r}: no configuration of {N} ranks "
                         f"fits this model and batch_size={batch_size}.")
    return choice[0]
