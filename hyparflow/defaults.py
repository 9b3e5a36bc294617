"""hf.fit's speed defaults: the schedule, step graph and balance a call leaves out, chosen for
the job it runs, a long first call weighed against the steps that repay it."""

from __future__ import annotations

import math

from hyparflow.data import sources
from hyparflow.partitioner.costs import DEFAULT as DEFAULT_BALANCE

# The step graph and the measured cut ("time") cost a longer first call and repay it a step at
# a time. Measured at P = 2, one thread per rank, on an Intel Xeon (benchmarks/defaults.py,
# results/defaults.md; the first step from the call's start, rank 0's timing of the model
# included): ResNet-110 (batch 64, interleaved) a first step 35 s longer for 0.13-0.15 s a
# step, repaid after 228-281 steps; keras-hub's GPT-2 (1F1B: its tied embedding) 8-9 s for
# 0.03-0.05 s, after 173-243; BERT 12 s for 0.08-0.09 s, after 123-142. The count is the
# largest of those nine rounds, rounded up: a call that long repays the step graph on each.
LONG_JOB_STEPS = 300

# What a call with the defaults runs, by the steps it plans (`resolve`).
SHORT = "1f1b"  # on the executor, cut by FLOPs: no first-call cost beyond tracing
LONG = "interleaved"  # in the step graph, cut by measured time (1F1B where it cannot interleave)


def resolve(model, a):
    """`a` (an `arguments.Call` of hf.fit) with the schedule, step graph and balance it left
    out chosen for its job, each on its own; what it gave, kept.

    At a whole number of partitions P > 1, a call over arrays that plans at least
    `LONG_JOB_STEPS` steps, where the step graph can run (no `recompute`, an MPI that lets
    TensorFlow's thread send) and is predicted to fit the memory a rank may use, runs the
    interleaved schedule (1F1B where the model cannot interleave) in the step graph, cut by
    measured time; any other call 1F1B on the executor, cut by FLOPs. So
    ``schedule="gpipe"`` alone gets the step graph and the measured cut on a long call, and
    ``balance=[...]`` alone 1F1B (its P stages) in the step graph. The choice reads the
    arguments and the memory every rank showed the others (`auto.resolve`), so every rank
    makes the same one (and `agreement.start` compares them). Under "auto" the planner
    chose: kept.
    """
    if a.predicted_speedup is not None:  # "auto": the planner's choice
        return a
    P = a.partitions
    pipeline = isinstance(P, int) and not isinstance(P, bool) and P > 1
    steps = planned_steps(a) if pipeline else None
    weighed = (f"the defaults for {steps} steps: the step graph and a measured cut repay "
               f"their longer first call after ~{LONG_JOB_STEPS}")
    why = None  # why not the step graph
    if steps is None:
        why = ("the defaults for batches read as they come, whose shapes may change: the "
               "step graph would compile anew for each")
    elif steps < LONG_JOB_STEPS:
        why = weighed
    elif a.recompute is not False:
        why = f"the defaults for {steps} steps, without the step graph: recompute=True"
    elif not _step_graph_runs():
        why = (f"the defaults for {steps} steps, without the step graph: this MPI keeps "
               "sends to one thread")
    schedule = a.schedule
    if why is None and schedule is None:
        schedule = LONG if a.cut is None and not _explicit(a.balance) \
            and _interleaves(model, a, P) else SHORT
    if why is None:
        why = _over_memory(model, a, schedule or SHORT, steps)
    step_graph = why is None
    changes = {}
    if a.schedule is None:
        changes["schedule"] = schedule if step_graph else SHORT
    if a.step_graph is None and step_graph:
        changes["step_graph"] = True
    if a.balance is None:
        changes["balance"] = "time" if step_graph else DEFAULT_BALANCE
    if pipeline and (set(changes) - {"balance"} or step_graph):
        changes["defaulted"] = weighed if step_graph else why
    return a.replace(**changes)


def _over_memory(model, a, schedule, steps):
    """Why the step graph does not fit the memory a rank may use (its planner's prediction
    above the tightest rank's room, `a.memory`), or None: it fits, or the room is unknown."""
    if a.memory is None or a.memory[0] is None:
        return None
    room, source, held = a.memory
    from hyparflow import planner
    from hyparflow.data.batches import default_microbatches
    from hyparflow.engine import schedule as schedule_
    from hyparflow.partitioner.graph import LayerGraph

    try:
        graph = LayerGraph.of(model, a.keep_nested)
        R = a.replicas if isinstance(a.replicas, int) else 1
        batch = 32 if a.batch_size is None else int(a.batch_size)
        m = a.microbatches or default_microbatches(a.partitions, max(1, batch // R))
        chunks = (a.chunks or 2) if schedule_.by_name(schedule).chunked else 1
        need = planner.predict(graph, planner.Profile.for_memory(graph, held), a.partitions,
                               R, m, batch, schedule, step_graph=True, chunks=chunks).memory_bytes
    except (ValueError, TypeError):  # arguments hf.fit refuses: `arguments.validate` says why
        return None
    if need <= room:
        return None
    return (f"the defaults for {steps} steps, without the step graph: its memory, predicted "
            f"{need / 2**30:.2f} GiB a rank, is above the {room / 2**30:.2f} GiB a rank may use "
            f"({source})")


def planned_steps(a):
    """Optimizer steps the call plans over arrays ((epochs − initial_epoch) × steps a epoch),
    or None: a dataset, generator or PyDataset (whose batches may change shape, which the step
    graph compiles anew for), or arguments `arguments.validate` will refuse."""
    import keras

    try:
        if sources.streamed(a.x):
            return None
        epochs = int(a.epochs) - int(a.initial_epoch)
        if a.steps_per_epoch is not None:
            return max(0, epochs) * int(a.steps_per_epoch)
        leaves = keras.tree.flatten(a.x)
        n = int(leaves[0].shape[0])
        split = float(a.validation_split or 0.0)
        if split and a.validation_data is None:
            n = int(math.ceil(n * (1.0 - split)))  # as Model.fit holds the last part out
        batch = 32 if a.batch_size is None else int(a.batch_size)
        return max(0, epochs) * math.ceil(n / batch)
    except (TypeError, ValueError, AttributeError, IndexError):
        return None


def _explicit(balance):
    """Whether `balance` is a split given by hand (calls per stage, or layer names), which
    fixes the number of stages."""
    return balance is not None and not isinstance(balance, str)


def _interleaves(model, a, P):
    """Whether the model cuts into the 2P stages the interleaved schedule runs, with no layer
    called at several places (a tied embedding), whose weights it cannot hold on several
    stages of a rank (`Executor`)."""
    from hyparflow.partitioner.graph import LayerGraph
    from hyparflow.partitioner.split import check_partitions

    try:
        graph = LayerGraph.of(model, a.keep_nested)
        check_partitions(graph, 2 * P)
    except Exception:  # a model hf.fit refuses: arguments.validate says why
        return False
    return all(len(calls) == 1 for calls in graph.layer_calls().values())


def _step_graph_runs():
    """Whether this MPI lets TensorFlow's own thread send (`arguments.check_step_graph`)."""
    from hyparflow.mpi import comm as comm_

    # (hf.fit refuses P > 1 without a launcher itself)
    return comm_.launched() and comm_.any_thread_sends()

