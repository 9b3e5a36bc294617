"""hf.fit's speed defaults: the schedule, step graph and balance a call leaves out, chosen for
the job it runs, a long first call weighed against the steps that repay it."""

from __future__ import annotations

import math

from hyparflow.data import sources
from hyparflow.partitioner.costs import DEFAULT as DEFAULT_BALANCE

# The step graph and the measured cut ("time") cost a longer first call and repay it a step at
# a time. ResNet-110 v1, P = 2, batch 64, m = 4, one thread per rank (make bench-readme on an
# Intel Xeon, benchmarks/results/readme.md): the first step (from the call's start: rank 0's
# timing of the model included) 9-10 s on the executor against 44-46 s for the interleaved
# schedule in the step graph; a step 0.75-0.81 s against 0.62-0.64 s: 33-37 s / 0.11-0.19 s
# ≈ 180-340 steps. The count is taken for every model; benchmarks/defaults.py measures it on
# others (keras-hub's GPT-2 and BERT).
LONG_JOB_STEPS = 400

# What a call with the defaults runs, by the steps it plans (`resolve`).
SHORT = "1f1b"  # on the executor, cut by FLOPs: no first-call cost beyond tracing
LONG = "interleaved"  # in the step graph, cut by measured time (1F1B where it cannot interleave)


def resolve(model, a):
    """`a` (an `arguments.Call` of hf.fit) with the schedule, step graph and balance it left
    out chosen for its job; what it gave, kept.

    A call that names no schedule, at a whole number of partitions P > 1, over arrays, runs
    the interleaved schedule in the step graph, cut by measured time, when it plans at least
    `LONG_JOB_STEPS` steps and the step graph can run it (no `recompute`, an MPI that lets
    TensorFlow's thread send); else 1F1B on the executor, cut by FLOPs. The choice depends on
    the arguments alone, so every rank makes the same one (and `agreement.start` checks it).
    Under "auto" `auto.resolve` has chosen already. A balance left out is "flops" unless
    the step graph is chosen.
    """
    if a.schedule is not None:
        return a if a.balance is not None else a.replace(balance=DEFAULT_BALANCE)
    short = a.replace(schedule=SHORT, balance=DEFAULT_BALANCE if a.balance is None
                      else a.balance)
    P = a.partitions
    if not isinstance(P, int) or isinstance(P, bool) or P < 2:
        return short
    steps = planned_steps(a)
    if steps is None:
        return short.replace(defaulted=(
            "the defaults for batches read as they come, whose shapes may change: the step "
            "graph would compile anew for each"))
    long = steps >= LONG_JOB_STEPS
    why = (f"the defaults for {steps} steps: the step graph and a measured cut repay their "
           f"longer first call after ~{LONG_JOB_STEPS}")
    if not long or a.recompute is not False or not _step_graph_runs():
        if long:
            why = (f"the defaults for {steps} steps, without the step graph: "
                   + ("recompute=True" if a.recompute else "this MPI keeps sends to one thread"))
        return short.replace(defaulted=why)
    schedule = LONG if a.cut is None and not _explicit(a.balance) and _interleaves(model, a, P) \
        else SHORT
    return a.replace(schedule=schedule, step_graph=True, defaulted=why,
                     balance="time" if a.balance is None else a.balance)


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

    if not comm_.launched():  # hf.fit refuses P > 1 without a launcher itself
        return False
    from mpi4py import MPI

    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED

