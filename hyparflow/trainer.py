"""This rank's trainer for one model and configuration: the partition, the executor of its
stages, the logs and the feed of its share of every batch, built once and reused."""

from __future__ import annotations

import warnings

import numpy as np

from hyparflow import arguments
from hyparflow import trace as trace_
from hyparflow.data import batches as data_
from hyparflow.engine import buckets as buckets_
from hyparflow.engine import schedule as schedule_
from hyparflow.engine import shard as shard_
from hyparflow.engine.own_steps import OwnSteps
from hyparflow.keras import batch_norm, keras_private, replica_state, user_loss
from hyparflow.keras import optimizers as optimizers_
from hyparflow.keras.user_loss import UserLoss
from hyparflow.mpi import comm as comm_
from hyparflow.mpi import guard as guard_
from hyparflow.mpi import placement
from hyparflow.mpi.topology import Topology
from hyparflow.partitioner.graph import LayerGraph, functional_of, is_graph_model
from hyparflow.training.callbacks import ReturnedLogs, StepLogs


class Trainer:
    """Everything one rank keeps between calls for one model and configuration."""

    def __init__(self, model, topology, world, partition, executor, logs, guard, balance,
                 user_optimizer, placement=None):
        self.model = model
        # on rank 0 of a job: each rank's `placement.entry()` (its node, its launcher's
        # number), gathered once for the report; None elsewhere
        self.placement = placement
        # model.optimizer as compiled: the stage trains with its own copy
        # (executor.optimizer) and gives the state back to this one after hf.fit.
        self.user_optimizer = user_optimizer
        self.balance = balance  # as given: evaluate/predict with "auto" reuse fit's
        self.topology, self.world, self.partition = topology, world, partition
        self.executor, self.logs, self.guard = executor, logs, guard
        # what this replica's steps add to its stage's aggregation="sum" variables
        self.added = replica_state.Added(replica_state.held(partition, topology),
                                          topology.replicas)
        # while hf.fit trains (`loop.train`; None otherwise): the last step this rank finished
        # (epoch, index in it; None before the first), and whether its input replays from a
        # step — what an elastic job that loses ranks resumes from (`elastic.go_on`)
        self.position = None
        self.settled = True  # (its replicas' state one at `position`: `elastic.reached`)
        self.resumable = None
        self.kept = None  # (`elastic.Kept`: the state a step's forward changes, at `position`)


def check_norms_called_once(model, trainer):
    """Refuse, alike on every rank, a BatchNormalization layer called more than once in a
    model trained with several micro-batches a step: model.fit updates its moving
    statistics once per call, from that call's moments, where the pool of a step's
    micro-batches (`batch_norm.Norms`) holds one layer's moments, not one call's."""
    graph = trainer.partition.graph
    if graph is None and is_graph_model(model):
        graph = LayerGraph.of(model)
    if graph is None or not trainer.executor.norms.layers:
        return
    norms = {id(layer): layer.name for layer in trainer.executor.norms.layers}
    repeated = sorted(norms[k] for k in graph.layer_calls() if k in norms)
    if repeated:
        raise guard_.Guard.mark_agreed(ValueError(
            f"BatchNormalization layer(s) {', '.join(repeated)} are called more than once in "
            f"model {model.name!r}: with several micro-batches a step, hyparflow updates a "
            "layer's moving statistics once a step from its pooled moments, where model.fit "
            "updates them at each call. Use microbatches=1, or one layer per call."))


def make(model, plan, balance, keep_nested, world, verbose=0, schedule="1f1b",
             shard=None, step_graph=False):
    """This rank's Trainer for (model, P, R, balance, ...), built once and cached on the model.

    `schedule` is what `balance="memory"` counts the micro-batches in flight by, and
    `step_graph` how `balance="time"` costs a non-last stage (and `"memory"` every stage),
    for the call that builds the trainer (later calls reuse its split). `shard`: whether
    the optimizer's state is sharded over replicas (fit), None: either (evaluate, predict
    reuse whichever trainer fit built).

    A new trainer of a job of several ranks prints where its ranks run (one line
    per node, `placement.report`) unless `verbose` is 0.
    """
    from hyparflow.engine.executor import Executor
    from hyparflow.partitioner import partition
    from hyparflow.partitioner.split import whole_model

    P, R, batch_size = plan.P, plan.R, plan.batch_size
    m = planned_m(plan)
    bucket_bytes = buckets_.cap()  # traced into the stage's functions: part of the key
    cache = model.__dict__.setdefault("_hyparflow_trainers", {})
    # A new model.compile (optimizer, loss, metrics) needs new compiled stage functions.
    key = (P, R, repr(balance), keep_nested, world.Get_size() if world is not None else 1,
           id(getattr(model, "optimizer", None)), id(keras_private.compile_call(model)),
           id(keras_private.compiled_loss(model)) if model.compiled else None,
           id(keras_private.compiled_metrics(model)) if model.compiled else None,
           # the structure of x, in which a subclassed model or a compute_loss takes it
           None if is_graph_model(model) and not UserLoss.needed(model)
           else repr(vars(plan.source.structures[0])),
           bucket_bytes, plan.chunks)
    # one replica: nothing to split; None (evaluate, predict): either trainer serves
    wanted = (False, True) if shard is None else (bool(shard) and R > 1 and not plan.own,)
    found = [key + (s,) for s in wanted if key + (s,) in cache]
    shard = wanted[0]
    key += (shard,)
    if found:
        if plan.source.sample[1] and keras_private.compile_unbuilt(model):
            _build(model, plan)  # made by predict, which builds no loss or metrics
        return cache[found[0]]
    rank = world.Get_rank() if world is not None else 0
    topology = Topology(partitions=P, replicas=R, rank=rank, chunks=plan.chunks)
    entries = None
    if world is not None and world.Get_size() > 1:
        pipeline, stage_group = topology.communicators(world)
        entries = comm_.gather_objects(placement.entry(), 0, world, guard_.for_job(world).bounded(
            "every rank's placement"))
        if entries is not None and verbose != 0:
            for line in placement.report(entries, P, R):
                print(f"hyparflow placement: {line}", flush=True)
    else:
        pipeline = stage_group = None
    _build(model, plan)
    if is_graph_model(model) and not plan.own:
        try:
            part = partition(model, P * plan.chunks, balance=balance, keep_nested=keep_nested,
                             microbatch_size=max(1, batch_size // R // m), microbatches=m,
                             comm=world, schedule=schedule, chunks=plan.chunks,
                             step_graph=step_graph)
        except ValueError as exc:  # the same split, so the same error, on every rank
            raise guard_.Guard.mark_agreed(exc)
        if rank == 0 and verbose != 0 and P * plan.chunks > 1:
            for line in part.stage_lines():
                print(f"hyparflow stages: {line}", flush=True)
    else:  # P = 1 (validated): the whole model is the one stage
        source = plan.source
        part = whole_model(model, len(source.sample[0]), source.structures[0].pack)
    guard = guard_.for_job(world)
    guard.first_step = True  # new functions to trace: the first step may wait longer
    user_optimizer = getattr(model, "optimizer", None)
    if plan.own:  # the model's own steps, as written, on each replica's share
        executor = OwnSteps(model, topology, stage_group, guard, plan.source.structures)
        trainer = Trainer(model, topology, world, part, executor,
                          ReturnedLogs(model, topology, world, guard), guard, balance,
                          user_optimizer, entries)
        cache[key] = trainer
        return trainer
    sharded = None
    held = [w for s in topology.stages for w in part.stages[s].model.trainable_variables]
    if shard and user_optimizer is not None:  # this rank's share of the stage's variables
        sharded = shard_.Shard(held, stage_group)
        stage_optimizer = optimizers_.stage_copy(user_optimizer, sharded.owned_variables,
                                                 clip_here=False)
    elif P == 1:  # the stage is the whole model: it steps with the user's optimizer itself
        stage_optimizer = user_optimizer
        if user_optimizer is not None and not user_optimizer.built:
            user_optimizer.build(model.trainable_variables)  # in Model.fit's order
    else:
        stage_optimizer = optimizers_.stage_copy(user_optimizer, held, clip_here=False)
    executor = Executor(part, topology, pipeline, stage_group, model, stage_optimizer, guard,
                        clip_norm=optimizers_.global_clipnorm(user_optimizer)
                        if P > 1 or sharded is not None else None,
                        structures=plan.source.structures,
                        labelled=arguments.model_io(model).labelled, shard=sharded, job=world,
                        bucket_bytes=bucket_bytes)
    logs = StepLogs(model, topology, world, topology.is_last_stage, guard, executor)
    trainer = Trainer(model, topology, world, part, executor, logs, guard, balance,
                      user_optimizer, entries)
    cache[key] = trainer
    return trainer


def choice_line(trainer, plan, a):
    """What hf.fit runs, in one line: stages × replicas, the schedule (where it runs, the
    stages a rank holds), m, the cut, and the planner's predicted speed-up under "auto"."""
    top = trainer.topology
    P, R, v = top.partitions, top.replicas, top.chunks
    line = f"hyparflow: {P} stage{'s' * (P > 1)} × {R} replica{'s' * (R > 1)}"
    if P > 1:
        title = schedule_.by_name(a.schedule).title
        held = f" ({v} stages a rank)" if v > 1 else ""
        where = "in the step graph" if a.step_graph else "on the executor"
        m = planned_m(plan) if plan.m or not plan.source.streamed else "each batch's default"
        sizes = "|".join(str(len(st.calls)) for st in trainer.partition.stages)
        how = f"by {a.balance!r}" if isinstance(a.balance, str) else "as given"
        line += (f", {title}{held} {where}{', recomputing' if a.recompute else ''}, m = {m}, "
                 f"cut {sizes} calls {how}")
    if a.predicted_speedup is not None:
        line += f"; predicted {a.predicted_speedup:.2f}× one process"
    if P > 1 and a.defaulted:
        line += f" ({a.defaulted})"
    return line


def planned_m(plan):
    """m for the plan's batch size (a dataset's batches may each get their own default)."""
    return plan.m or data_.default_microbatches(
        plan.P, max(1, plan.batch_size // plan.R))


def _build(model, plan):
    """Build the model, its compiled loss and metrics on symbolic tensors, as Model.fit does.

    On every rank, though only the last stage computes the loss and metrics:
    callbacks on every rank look metrics up by name (e.g. to tell if
    'val_accuracy' should rise). Nothing runs on real samples. The targets take
    the structure the stages give the compiled loss (the model's outputs'), or,
    for the model's own steps or compute_loss, the user's (sample weights too).
    """
    source = plan.source
    x_s, y_s, sw_s = source.structures
    xs, ys, sws = source.sample
    x = x_s.pack([data_.feedable(a) for a in xs])
    y, sw = ys or None, None
    if y is not None and plan.own:
        y, sw = y_s.pack(y), sw_s.pack(sws)
    elif y is not None and UserLoss.needed(model):  # compute_loss takes them as given
        labelled = arguments.model_io(model).labelled
        y = user_loss.given(y, y_s, labelled)
        sw = None if sws is None else user_loss.given(sws, sw_s, labelled)
    elif y is not None:
        y = keras_private.as_outputs(functional_of(model) if is_graph_model(model) else None, y)
    keras_private.symbolic_build(model, x, y, sw)


def feed(trainer, source, batch_size, m, steps=None, shuffle=False, seed=0, train=False):
    """A Feed cut for this rank, of (x, y, weights) arrays or of a checked dataset (`train`:
    the training batches, which synchronized BatchNormalization layers sum over replicas).

    In groups of the model's steps_per_execution; `steps` limited by
    `keras.config.max_steps_per_epoch()`, with Keras' warning, as Model.fit's epoch
    iterator limits it.
    """
    import keras

    limit = keras.config.max_steps_per_epoch()
    if limit and (not steps or limit < steps):
        warnings.warn(f"Limiting steps_per_epoch to {limit}", stacklevel=3)
        steps = limit
    top = trainer.topology
    # The stage's model inputs (an Executor's last stage may read them all: `reads`).
    reads = getattr(trainer.executor, "reads", trainer.partition.stages[top.stage].data_positions)
    # (the whole model's: every stage of a replica cuts its batches alike)
    synced = batch_norm.synced(batch_norm.of([trainer.model]), top.replicas) if train else []

    def check(size):
        refused = batch_norm.too_few(synced, size, top.replicas)
        if refused is not None:  # (a stream's batch: every rank reads the same)
            raise guard_.Guard.mark_agreed(refused)

    share = data_.Share(top.replicas, m, top.replica, reads, top.is_last_stage, top.partitions,
                        check if synced else None)
    check = _same_batches(trainer, source) if source.streamed else None
    data = source.data(share, batch_size, shuffle, seed, check)
    feed = data_.Feed(data, steps, getattr(trainer.model, "steps_per_execution", 1) or 1)
    feed.quiet = top.rank != top.logging_rank  # Keras' warnings once, from the logging rank
    return feed


def _same_batches(trainer, source):
    """A check that every rank read the same global batch from a stream (collective)."""
    world = trainer.world
    if world is None or world.Get_size() == 1:
        return None

    def check(size, checksum, k):
        v = np.array([size, -size, checksum, -checksum], np.float64)
        comm_.allreduce(v, world, "max",
                        trainer.guard.bounded("the check that every rank read the same batch"))
        if v[0] != -v[1] or v[2] != -v[3]:  # seen alike on every rank: the job stays healthy
            raise trainer.guard.mark_agreed(ValueError(
                f"the {source.kind} gave different ranks different batches (batch {k} of "
                f"this pass: sizes from {-v[1]:.0f} to {v[0]:.0f}, checksums from {-v[3]:.6g} "
                f"to {v[2]:.6g}). Every rank must read the same batches in the same order: "
                f"{source.advice}"))
    return check


def write_trace(path, executor, world, P, R, m, schedule):
    """Gather every rank's timeline on rank 0 and write one Chrome trace file."""
    events = executor.recorder.events
    executor.recorder = trace_.SILENT
    per_rank = comm_.gather_objects(events, 0, world, guard_.for_job(world).bounded(
        "every rank's timeline")) if world is not None else [events]
    if per_rank is not None:
        trace_.write(str(path), trace_.chrome_trace(per_rank, P, R, m, schedule))
