"""hf.fit, evaluate, predict and save: validate collectively,
build (or reuse) this rank's trainer, run the loop."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from hyparflow import trace as trace_
from hyparflow.data import batches as data_
from hyparflow.data import sources
from hyparflow.engine import buckets as buckets_
from hyparflow.engine import schedule as schedule_
from hyparflow.engine import shard as shard_
from hyparflow.engine.own_steps import OwnSteps
from hyparflow.keras import batch_norm, keras_private, reduction, replica_state, streams, user_loss
from hyparflow.keras import optimizers as optimizers_
from hyparflow.keras.user_loss import UserLoss
from hyparflow.mpi import comm as comm_
from hyparflow.mpi import guard as guard_
from hyparflow.mpi import placement
from hyparflow.mpi.topology import Topology
from hyparflow.partitioner.costs import DEFAULT as DEFAULT_BALANCE
from hyparflow.partitioner.graph import LayerGraph, functional_of, is_graph_model
from hyparflow.partitioner.split import check_partitions
from hyparflow.training import callbacks as callbacks_
from hyparflow.training import checkpoint, loop, preemption
from hyparflow.training.callbacks import ReturnedLogs, StepLogs, callback_list, quiet

if TYPE_CHECKING:  # keras loads TensorFlow: imported where hyparflow runs, not for the hints
    import os
    from collections.abc import Collection, Mapping, Sequence

    import keras

_VERBOSE = ("auto", 0, 1, 2)


class Call:
    """The arguments of one hf.fit, evaluate or predict call, by name; those a call does not
    take read as Model.fit's defaults."""

    y = sample_weight = class_weight = steps = steps_per_epoch = None
    shuffle = shard_optimizer = step_graph = False
    batch_hooks_read_weights = True
    chunks = None

    def __init__(self, **arguments):
        vars(self).update(arguments)


@dataclasses.dataclass
class Plan:
    """What every rank follows for one call, as `_validate` found it."""

    P: int
    R: int
    m: object  # micro-batches of each replica's share; None: each batch's default
    batch_size: int
    own: bool  # the model's own steps run (`own_steps.OwnSteps`)
    chunks: int = 1  # stages each rank holds (the interleaved schedule)
    source: object = None  # the call's `sources.Source`
    epochs: int = None
    val: object = None  # fit's validation Source, or None
    val_batch_size: int = None
    val_m: object = None


class Trainer:
    """Everything one rank keeps between calls for one model and configuration."""

    def __init__(self, model, topology, world, partition, executor, logs, guard, balance,
                 user_optimizer):
        self.model = model
        # model.optimizer as compiled: the stage trains with its own copy
        # (executor.optimizer) and gives the state back to this one after hf.fit.
        self.user_optimizer = user_optimizer
        self.balance = balance  # as given: evaluate/predict with "auto" reuse fit's
        self.topology = topology
        self.world = world
        self.partition = partition
        self.executor = executor
        self.logs = logs
        self.guard = guard
        # what this replica's steps add to its stage's aggregation="sum" variables
        self.added = replica_state.Added(replica_state.held(partition, topology),
                                          topology.replicas)


def _whole_number(name, value, minimum=1):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be a whole number ≥ {minimum}.")
    return int(value)


def _positive_or_none(name, value):
    return None if value is None else _whole_number(name, value)


def _check_model(model, P, keep_nested, mode, chunks=1):
    """Errors of the model itself, whatever the launch (`chunks`: stages a rank holds)."""
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}.")
    _check_no_strategy(model, mode)
    if mode != "predict" and (not model.compiled or (
            mode == "fit" and getattr(model, "optimizer", None) is None)):
        raise ValueError(f"model {model.name!r} is not compiled. Call "
                         f"model.compile(optimizer=..., loss=...) before hf.{mode}.")
    own = keras_private.overridden(model, keras_private.STEP_METHODS)
    if P > 1 and own:
        raise ValueError(
            f"model {model.name!r} overrides {', '.join(own)}: partitions={P} cuts the model "
            "into stages on different ranks, where code written for the whole model cannot "
            "run. Use partitions=1 (any replicas): the model's own steps then run as "
            "written on each replica's share of the batch, gradients combined over replicas. "
            "(compute_loss and compute_metrics overrides run at any partitions.)")
    if mode == "fit" and P > 1:
        optimizers_.copy_of(model.optimizer)  # raises the explanation if it cannot be copied
    clip = optimizers_.global_clipnorm(getattr(model, "optimizer", None))
    if mode == "fit" and P > 1 and clip and getattr(
            optimizers_.updating(model.optimizer), "gradient_accumulation_steps", None):
        raise ValueError(
            f"model.optimizer has global_clipnorm={clip} and gradient_accumulation_steps: Keras "
            "clips the accumulated gradients, by the norm over all the model's variables, "
            f"which partitions={P} spreads over stages; hyparflow combines "
            "that norm across stages only for each step's own gradients. Use hyparflow's "
            "micro-batches to accumulate instead (a larger batch_size with microbatches), or "
            "partitions=1.")
    if P > 1 and not is_graph_model(model):
        functional_of(model)  # raises the explanation (subclassed / unbuilt Sequential)
    if P > 1:
        check_partitions(LayerGraph(model, keep_nested=keep_nested), P * chunks)


def _check_no_strategy(model, mode):
    """Refuse a model built under a tf.distribute strategy's scope, or a call inside one:
    the strategy's variables and replica context are not hyparflow's (it failed deep inside
    a traced function)."""
    import tensorflow as tf

    built = keras_private.distribute_strategy(model)
    strategy = built or (tf.distribute.get_strategy() if tf.distribute.has_strategy()
                         else None)
    if strategy is not None:
        where = "was built under" if built is not None else f"hf.{mode} was called inside"
        raise ValueError(
            f"model {model.name!r} {where} a tf.distribute {type(strategy).__name__} "
            f"scope: hyparflow distributes the work itself, over MPI ranks, and cannot run "
            f"a strategy's variables and replica context. Build, compile and call hf.{mode} "
            "without the strategy's scope (launch with hyparflow-run -n N for several "
            "ranks).")


def _check_norms_called_once(model, trainer):
    """Refuse, alike on every rank, a BatchNormalization layer called more than once in a
    model trained with several micro-batches a step: model.fit updates its moving
    statistics once per call, from that call's moments, where the pool of a step's
    micro-batches (`batch_norm.Norms`) holds one layer's moments, not one call's."""
    graph = trainer.partition.graph
    if graph is None and is_graph_model(model):
        graph = LayerGraph(model)
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


def _build_sequential(model, x):
    """Build a Sequential model without an input shape from its data's shapes, as model.fit
    builds it from its first batch (here with the batch axis left open), so that it can be
    cut. Arrays and tf.data datasets tell their shapes without being read; a generator is
    left to `functional_of`'s refusal."""
    import keras

    if not isinstance(model, keras.Sequential) or is_graph_model(model) or not model.layers:
        return
    if keras_private.is_tf_dataset(x):
        spec = x.element_spec
        spec = spec[0] if isinstance(spec, tuple) else spec
        shape = getattr(spec, "shape", None)
    else:
        x = x[0] if isinstance(x, (list, tuple)) and len(x) == 1 else x
        shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 1:
        return
    model.build((None, *tuple(shape)[1:]))


def _chunks(a, P):
    """The stages each rank holds, from hf.fit's `schedule` and `chunks`: 2 by default with
    the interleaved schedule, else 1."""
    chunked = schedule_.by_name(a.schedule).chunked
    if a.chunks is None:
        return 2 if chunked and P > 1 else 1
    v = _whole_number("chunks", a.chunks)
    if v > 1 and not chunked:
        named = [s.name for s in schedule_.SCHEDULES.values() if s.chunked]
        raise ValueError(f"chunks={v} with schedule={a.schedule!r}: only the "
                         f"{' or '.join(named)} schedule gives a rank several stages. Use "
                         f"schedule={named[0]!r}, or leave chunks out.")
    if v > 1 and P == 1:
        raise ValueError(f"chunks={v} with partitions=1: one rank a pipeline has no bubble "
                         "to interleave. Use partitions ≥ 2, or leave chunks out.")
    return v


def _check_trainable(model):
    """Refuse a trainable set changed since the first hf.fit after model.compile.

    Keras' model.fit keeps training the weights that were trainable when its train
    function was first made after compile (and warns: "recompile your model"); a
    trainer made anew (another P × R, balance, ...) would honour the change, so the
    same calls would train differently depending on what hf.fit had cached.
    """
    seen = model.__dict__.get("_hyparflow_trainable")
    if seen is None or not model.built:
        return
    compiled, before = seen
    if compiled is not keras_private.compile_call(model):
        return  # compiled again: the next fit takes the change
    now = {id(v): v.path for v in model.trainable_variables}
    if set(now) == set(before):
        return
    added = [path for k, path in now.items() if k not in before]
    removed = [path for k, path in before.items() if k not in now]
    change = "; ".join(part for part in (
        f"now trainable: {added}" if added else "",
        f"no longer trainable: {removed}" if removed else "") if part)
    raise ValueError(
        f"model {model.name!r}: the trainable weights changed since its first hf.fit after "
        f"model.compile ({change}). Call model.compile(...) again after changing `trainable`, "
        "as Keras asks: its model.fit keeps training the weights that were trainable when it "
        "first ran after compile, which hf.fit cannot promise at another P × R.")


def _remember_trainable(model):
    """The trainable weights of the first fit after this compile (`_check_trainable`)."""
    seen = model.__dict__.get("_hyparflow_trainable")
    compiled = keras_private.compile_call(model)  # a new one at every compile
    if seen is None or seen[0] is not compiled:
        model.__dict__["_hyparflow_trainable"] = (
            compiled, {id(v): v.path for v in model.trainable_variables})


def _check_shard(model, P, R, shard):
    """Errors of shard_optimizer with this model, whatever the launch."""
    if not isinstance(shard, bool):
        raise ValueError(f"shard_optimizer={shard!r}: use True or False.")
    if shard and _own_steps(model, P):
        raise ValueError(
            f"shard_optimizer=True: model {model.name!r} brings its own steps "
            f"({', '.join(keras_private.overridden(model)) or 'a loss from add_loss alone'}"
            "), which apply the optimizer to every variable themselves, so its state "
            "cannot be split over replicas. Leave shard_optimizer=False.")
    clip = optimizers_.global_clipnorm(model.optimizer)
    if shard and R > 1 and clip and getattr(
            optimizers_.updating(model.optimizer), "gradient_accumulation_steps", None):
        raise ValueError(
            f"shard_optimizer=True with global_clipnorm={clip} and "
            "gradient_accumulation_steps: Keras clips the accumulated gradients by their "
            "norm over all the model's variables, which sharding spreads over the "
            "replicas; hyparflow combines that norm only for each step's own gradients. "
            "Use hyparflow's micro-batches to accumulate instead (a larger batch_size "
            "with microbatches), or shard_optimizer=False.")


def _own_steps(model, P):
    """Whether the model's own steps run (`own_steps.OwnSteps`) instead of hyparflow's stages:
    at P = 1, for a model that overrides a step, compute_loss or compute_metrics, or that
    was compiled without a loss (it trains on add_loss losses, as Keras' own step does)."""
    return P == 1 and bool(keras_private.overridden(model, keras_private.STEP_METHODS)
                           or UserLoss.needed(model))


def _check_launch(P, R, world_size):
    if P * R != world_size:
        if world_size == 1:
            raise ValueError(
                f"partitions={P} × replicas={R} needs {P * R} MPI ranks, but this process is "
                f"not part of an MPI job. Launch it with `hyparflow-run -n {P * R} python "
                f"script.py` (or `mpirun -n {P * R} python script.py`).")
        raise ValueError(
            f"partitions={P} × replicas={R} = {P * R}, but the job has {world_size} MPI ranks. "
            f"Launch with -n {P * R}, or choose partitions × replicas = {world_size}.")


def _microbatches(microbatches, P, R, batch_size, what="batch_size"):
    """m for a global batch of `batch_size` (validated), or the default. A batch of fewer
    samples than replicas leaves some without samples: they take part with nothing."""
    share = max(1, batch_size // R)
    if microbatches is None:
        return data_.default_microbatches(P, share)
    m = _whole_number("microbatches", microbatches)
    if m > share:
        split = f"{what}={batch_size} / replicas={R} = {share} samples" if batch_size >= R \
            else f"{what}={batch_size} < replicas={R}: one sample at most"
        raise ValueError(
            f"microbatches={m} is larger than each replica's share of the batch ({split}). "
            f"Use microbatches ≤ {share}, or a larger {what}.")
    return m


def _check_split(split):
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0 <= split < 1:
        raise ValueError(f"validation_split={split!r}: use a fraction in [0, 1), as in "
                         "Model.fit.")


def _validation(model, a, P, R, m, split=None, own=False):
    """fit's validation arguments → (Source or None, its batch size, its m).

    `split` is what `validation_split` held out of the training arrays, if anything.
    """
    import keras

    freq = a.validation_freq
    if not (isinstance(freq, list) and all(isinstance(e, int) for e in freq)):
        try:
            _whole_number("validation_freq", freq)
        except ValueError:
            raise ValueError(f"validation_freq={freq!r}: use a whole number ≥ 1 (validate "
                             "every that many epochs) or a list of epoch numbers, as in "
                             "Model.fit.") from None
    _positive_or_none("validation_steps", a.validation_steps)
    batch_size = _positive_or_none("validation_batch_size", a.validation_batch_size) \
        or a.batch_size
    if a.validation_data is not None:
        vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(a.validation_data)
        val = sources.source_of(_io(model), vx, vy, vsw, None, "evaluate",
                                steps=a.validation_steps, own=own,
                                prefix="validation_data: ", steps_name="validation_steps")
    elif split is not None:
        val = split
    else:
        return None, batch_size, m
    asked = a.microbatches
    if val.streamed:
        return val, batch_size, asked
    m_val = _microbatches(None if asked is None else min(asked, max(1, batch_size // R)),
                          P, R, batch_size, "validation_batch_size")
    return val, batch_size, m_val


def _check_step_graph(step_graph, recompute, world_size, schedule):
    """Refuse a `step_graph` that is not a bool, one asked for with `recompute`, or the
    zero-bubble schedule without it."""
    if not isinstance(step_graph, bool):
        raise ValueError(f"step_graph={step_graph!r}: use True or False.")
    if schedule != "auto":
        schedule_.by_name(schedule).refuse_without_step_graph(step_graph,
                                                               f"schedule={schedule!r}")
    if step_graph and recompute:
        raise ValueError(
            "step_graph=True with recompute=True: the step graph keeps every micro-batch's "
            "activations from its forward to its backward inside the graph, where "
            "recompute=True keeps only the inputs. Choose one (step_graph for speed, "
            "recompute for memory).")
    if step_graph and world_size > 1:
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise ValueError(
                "step_graph=True: the step graph exchanges messages from TensorFlow's own "
                "thread, which this MPI does not allow (it gives MPI_THREAD_FUNNELED or "
                "less). Leave step_graph=False, or use an MPI that provides "
                "MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE.")


def _validate(model, mode, world_size, a):
    """Check the call before any message; returns the `Plan` every rank follows.

    `mode` is "fit", "evaluate" (no optimizer needed) or "predict" (no compile,
    no y). `a` is the `Call`.
    """
    P = _whole_number("partitions", a.partitions)
    R = _whole_number("replicas", a.replicas)
    v = _chunks(a, P) if mode == "fit" else a.chunks or 1
    timeout = a.timeout
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout={timeout!r}: use a number of seconds > 0, or None for no "
                         "watchdog.")
    if not isinstance(a.keep_nested, bool):
        raise ValueError(f"keep_nested={a.keep_nested!r}: use True or False.")
    if not isinstance(a.batch_hooks_read_weights, bool):
        raise ValueError(f"batch_hooks_read_weights={a.batch_hooks_read_weights!r}: use True "
                         "(your callbacks' training-batch hooks may read weights: every stage's "
                         "are gathered before them) or False (they read none).")
    if P > 1:
        _build_sequential(model, a.x)
    _check_model(model, P, a.keep_nested, mode, v)
    if mode == "fit":
        _check_shard(model, P, R, a.shard_optimizer)
        _check_trainable(model)
    buckets_.cap()  # $HYPARFLOW_BUCKET_MB, read by the trainer
    # Then the launch (model errors come first: they hold however the job is launched).
    _check_launch(P, R, world_size)
    # None, as Model.fit takes it: a dataset's or generator's own batches, or 32 samples
    batch_size = 32 if a.batch_size is None else _whole_number("batch_size", a.batch_size)
    if a.verbose not in _VERBOSE:
        raise ValueError(f"verbose={a.verbose!r}: use 'auto', 0, 1 or 2, as in Model.fit.")
    streamed = sources.streamed(a.x)
    if streamed:  # each batch's size is the input's; m None: the default for each
        m = _positive_or_none("microbatches", a.microbatches)
    else:
        m = _microbatches(a.microbatches, P, R, batch_size)
    own = _own_steps(model, P)
    if own and (m or 1) > 1:
        raise ValueError(
            f"microbatches={m}: model {model.name!r} brings its own steps "
            f"({', '.join(keras_private.overridden(model)) or 'a loss from add_loss alone'}), "
            "which take each replica's share of a batch whole. Leave microbatches at 1.")
    if own and mode == "fit" and a.recompute is True:
        raise ValueError(f"recompute=True: model {model.name!r} brings its own train_step, "
                         "inside which hyparflow cannot recompute. Leave recompute=False.")
    if own and mode == "fit" and a.step_graph is True:
        raise ValueError(f"step_graph=True: model {model.name!r} brings its own train_step, "
                         "which runs as Keras compiles it. Leave step_graph=False.")
    plan = Plan(P=P, R=R, m=m, batch_size=batch_size, own=own, chunks=v)
    if mode == "fit":
        refused = batch_norm.refusal(batch_norm.of([model]), m, R)
        if refused is not None:
            raise refused
        epochs = _whole_number("epochs", a.epochs, minimum=0)
        _whole_number("initial_epoch", a.initial_epoch, minimum=0)
        _positive_or_none("steps_per_epoch", a.steps_per_epoch)
        if not isinstance(a.recompute, bool):
            raise ValueError(f"recompute={a.recompute!r}: use True or False.")
        _check_step_graph(a.step_graph, a.recompute, world_size, a.schedule)
        _check_split(a.validation_split)
        import keras

        limit = keras.config.max_epochs()
        if limit and limit < epochs:  # as Model.fit caps them
            warnings.warn(f"Limiting epochs to {limit}", stacklevel=4)
            epochs = limit
        plan.epochs = epochs
        unwritable = checkpoint.unwritable(a.callbacks)
        if unwritable is not None:
            raise unwritable
    else:
        _positive_or_none("steps", a.steps)
    # Model.fit's split (the last fraction of the arrays) comes before anything else is read.
    split_asked = mode == "fit" and a.validation_split and a.validation_data is None
    if split_asked and streamed:
        raise sources.unsplittable(a.x)
    source = sources.source_of(
        _io(model), a.x, a.y, a.sample_weight,
        None if split_asked else a.class_weight, mode, shuffle=a.shuffle,
        steps=a.steps_per_epoch if mode == "fit" else a.steps, own=own)
    split = None
    if split_asked:
        source, split = source.split(a.validation_split, a.class_weight)
    plan.source = source
    if not source.streamed and source.size == 0:  # (before the targets are probed)
        raise ValueError(
            f"x has 0 samples: hf.{mode} has nothing to "
            f"{dict(fit='train on', evaluate='evaluate', predict='predict')[mode]}. Give it "
            "at least one sample (Model.fit would warn that its input ran out of data and "
            "return an empty History).")
    if source.batch_size:
        plan.batch_size = source.batch_size
    if mode == "fit" and not source.streamed:  # (a stream's batches: as they come)
        size = source.size % plan.batch_size or plan.batch_size  # the smallest batch
        refused = batch_norm.too_few(batch_norm.synced(batch_norm.of([model]), R), size, R)
        if refused is not None:
            raise refused
    if mode != "predict":
        _check_reduction(model, source, P, R, m, plan.batch_size)
    if mode == "fit":
        plan.val, plan.val_batch_size, plan.val_m = _validation(model, a, P, R, m,
                                                                         split, own)
        if plan.val is not None:
            _check_reduction(model, plan.val, P, R, plan.val_m,
                             plan.val.batch_size or plan.val_batch_size, "validation_data: ")
    return plan


def _check_reduction(model, source, P, R, m, batch_size, what=""):
    """Refuse a compiled loss that cannot be cut into the step's pieces (`reduction.check`)."""
    io = _io(model)
    if m is None:  # each batch's default
        m = data_.default_microbatches(P, max(1, batch_size // R))
    masked = None if io.outputs is None else [
        keras_private.mask_of(t) is not None for t in io.outputs]
    ys = source.sample[1]
    probes = None if io.outputs is None or not ys or len(ys) != len(io.outputs) else [
        None if data_.is_ragged(y) else (y, tuple(t.shape))  # (a ragged target: the loss's)
        for y, t in zip(ys, io.outputs)]
    own = UserLoss.needed(model) or bool(keras_private.overridden(model))
    if not own:  # the compiled loss is what trains: the targets must fit it
        reduction.fitting(model, io.out_names or ["output"], probes, what)
    reduction.check(model, io.out_names or ["output"], masked, source.sample[2] is not None,
                    own, P, R, m, what, probes)


def _io(model):
    """The model's `data.ModelIO` (tensors None for a subclassed model: data taken as given)."""
    if is_graph_model(model):
        f = functional_of(model)
        names = list(getattr(model, "output_names", None) or f.output_names)  # Sequential: f's
        return data_.ModelIO(f.inputs, f.outputs, keras_private.input_names(f), names,
                             _labelled(model, names), UserLoss.needs_no_targets(model))
    return data_.ModelIO(None, None, None, None)


def _labelled(model, out_names):
    """Per output, whether the compiled loss reads its target (None: every output's does)."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, (list, tuple)) and len(loss) == len(out_names):
        return [v is not None for v in loss]
    if isinstance(loss, dict):
        return [loss.get(n) is not None for n in out_names]
    return None


def _trainer(model, plan, balance, keep_nested, world, verbose=0, schedule="1f1b",
             shard=None, step_graph=False):
    """This rank's Trainer for (model, P, R, balance, ...), built once and cached on the model.

    `schedule` is what `balance="memory"` counts the micro-batches in flight by, and
    `step_graph` how `balance="time"` costs a non-last stage, for the call that builds the
    trainer (later calls reuse its split). `shard`: whether the
    optimizer's state is sharded over replicas (fit), None: either (evaluate, predict
    reuse whichever trainer fit built).

    A new trainer of a job of several ranks prints where its ranks run (one line
    per node, `placement.report`) unless `verbose` is 0.
    """
    from hyparflow.engine.executor import Executor
    from hyparflow.partitioner import partition
    from hyparflow.partitioner.split import whole_model

    P, R, batch_size = plan.P, plan.R, plan.batch_size
    m = _planned_m(plan)
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
    if world is not None and world.Get_size() > 1:
        pipeline, stage_group = topology.communicators(world)
        entries = world.gather(placement.entry(), root=0)
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
                          user_optimizer)
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
                        labelled=_io(model).labelled, shard=sharded, job=world,
                        bucket_bytes=bucket_bytes)
    logs = StepLogs(model, topology, world, topology.is_last_stage, guard, executor)
    trainer = Trainer(model, topology, world, part, executor, logs, guard, balance,
                      user_optimizer)
    cache[key] = trainer
    return trainer


def _planned_m(plan):
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
        labelled = _io(model).labelled
        y = user_loss.given(y, y_s, labelled)
        sw = None if sws is None else user_loss.given(sws, sw_s, labelled)
    elif y is not None:
        y = keras_private.as_outputs(functional_of(model) if is_graph_model(model) else None, y)
    keras_private.symbolic_build(model, x, y, sw)


def _feed(trainer, source, batch_size, m, steps=None, shuffle=False, seed=0, train=False):
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
        trainer.guard.bounded("the check that every rank read the same batch")(
            world.Iallreduce(comm_.mpi().IN_PLACE, v, op=comm_.mpi().MAX))
        if v[0] != -v[1] or v[2] != -v[3]:  # seen alike on every rank: the job stays healthy
            raise trainer.guard.mark_agreed(ValueError(
                f"the {source.kind} gave different ranks different batches (batch {k} of "
                f"this pass: sizes from {-v[1]:.0f} to {v[0]:.0f}, checksums from {-v[3]:.6g} "
                f"to {v[2]:.6g}). Every rank must read the same batches in the same order: "
                f"{source.advice}"))
    return check


def _write_trace(path, executor, world, P, R, m, schedule):
    """Gather every rank's timeline on rank 0 and write one Chrome trace file."""
    events = executor.recorder.events
    executor.recorder = trace_.SILENT
    per_rank = world.gather(events, root=0) if world is not None and world.Get_size() > 1 \
        else [events]
    if per_rank is not None:
        trace_.write(str(path), trace_.chrome_trace(per_rank, P, R, m, schedule))


def _start(mode, model, a):
    """Validate on every rank, agree, and set up the guard; returns (world, guard, plan).

    Raises the same ValueError/TypeError on every rank if any rank found bad input,
    or if the ranks were given different data or arguments.
    """
    partitions, replicas = a.partitions, a.replicas
    world = comm_.world() if (partitions != 1 or replicas != 1 or comm_.launched()) else None
    world_size = world.Get_size() if world is not None else 1
    error, plan = None, None
    try:
        plan = _validate(model, mode, world_size, a)
    except (ValueError, TypeError) as exc:
        error = exc
    fingerprint = None
    if plan is not None:
        source, val = plan.source, plan.val
        readers = callbacks_.batch_readers(a.callbacks)
        fingerprint = {
            "numbers of samples": source.size,
            "partitions × replicas": (plan.P, plan.R), "batch_size": plan.batch_size,
            "microbatches": plan.m,
            **{k: repr(getattr(a, k)) for k in _AGREED[mode]},
            f"${buckets_.ENV}": os.environ.get(buckets_.ENV, "").strip() or None,
            # (which of them have batch hooks: those make every step gather the weights)
            "callbacks": [type(c).__name__ + (" with training-batch hooks" if c in readers
                                              else "") for c in (a.callbacks or [])],
            "models (layers, weights, optimizer, loss, metrics)": _model_fingerprint(model),
            **source.agreed(),
            **({} if val is None else {f"validation {k}": v for k, v in val.agreed().items()}),
            "numbers of validation samples": None if val is None else val.size,
        }
    rank = world.Get_rank() if world is not None else 0
    # The first collective of the call: bounded, and a rank that left its script is seen.
    timeout = a.timeout if error is None else guard_.DEFAULT_TIMEOUT  # a.timeout was checked
    arrive = guard_.Guard(world, f"rank {rank}", timeout, notices=False).bounded(
        f"every rank to call hf.{mode} (it is collective: call it on every rank)")
    comm_.agree(error, world, fingerprint, wait=arrive, call=f"hf.{mode}")
    where = Topology(partitions=plan.P, replicas=plan.R, rank=rank, chunks=plan.chunks).where()
    guard = guard_.for_job(world, where, a.timeout)
    return world, guard, plan


def _model_fingerprint(model):
    """The model's structure as a list of lines: what must be the same on every rank.

    Layer classes and names, every weight's path, shape and dtype, the input and
    output signature, the optimizer's class; not the weights' values (every rank
    starts from rank 0's).
    """
    lines = []

    def walk(layer, prefix):
        for sub in getattr(layer, "layers", None) or []:
            lines.append(f"layer {prefix}{sub.name} ({type(sub).__name__})")
            walk(sub, f"{prefix}{sub.name}/")

    walk(model, "")
    lines += [f"weight {w.path} {tuple(w.shape)} {w.dtype}" for w in model.weights]
    for kind in ("inputs", "outputs"):
        tensors = getattr(model, kind, None) if model.built else None
        try:
            lines += [f"{kind[:-1]} {tuple(t.shape)} {t.dtype}" for t in tensors or []]
        except (AttributeError, ValueError):  # a subclassed model has no symbolic inputs
            pass
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        lines.append(f"optimizer {type(optimizer).__name__}")
    compiled = keras_private.compile_call(model)
    if compiled is not None:  # every rank trains rank 0's loss: the same loss and metrics
        for name in ("loss", "loss_weights", "metrics", "weighted_metrics"):
            lines.append(f"compiled {name} {_described(compiled.config.get(name))}")
    return lines


def _described(value):
    """A compile argument as words the same on every rank that passed the same: strings and
    numbers as they are, losses and metrics by class and config, functions by name."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_described(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_described(v) for v in value) + "]"
    if value is None or isinstance(value, (str, int, float, bool)):
        return repr(value)
    get_config = getattr(value, "get_config", None)
    if get_config is not None:
        try:
            config = get_config()
        except (NotImplementedError, TypeError, ValueError):
            config = None
        return f"{type(value).__name__}({config if config is not None else ''})"
    return getattr(value, "__qualname__", type(value).__name__)


# Arguments that must be the same on every rank, besides the data (checked in _start).
_AGREED = {
    "fit": ("epochs", "initial_epoch", "steps_per_epoch", "schedule", "chunks", "recompute",
            "step_graph", "shard_optimizer", "balance", "batch_hooks_read_weights",
            "shuffle", "seed", "class_weight", "validation_freq", "validation_steps",
            "validation_batch_size"),
    "evaluate": ("balance", "steps"),
    "predict": ("balance", "steps"),
}


def fit(model: keras.Model, x: Any = None, y: Any = None, *,
        partitions: int | Literal["auto"] = 1, replicas: int | Literal["auto"] = 1,
        microbatches: int | None = None, batch_size: int | None = 32, epochs: int = 1,
        verbose: Literal["auto", 0, 1, 2] = "auto",
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True,
        class_weight: Mapping[int, float] | None = None, sample_weight: Any = None,
        initial_epoch: int = 0, steps_per_epoch: int | None = None,
        validation_steps: int | None = None, validation_batch_size: int | None = None,
        validation_freq: int | Collection[int] = 1,
        balance: str | Sequence[int] | Sequence[str] | None = None, seed: int | None = None,
        schedule: Literal["1f1b", "gpipe", "interleaved", "zb-h1", "auto"] = "1f1b",
        chunks: int | None = None, recompute: bool = False,
        step_graph: bool = False, shard_optimizer: bool = False,
        trace: str | os.PathLike[str] | None = None, keep_nested: bool = False,
        timeout: float | None = guard_.DEFAULT_TIMEOUT,
        batch_hooks_read_weights: bool = True) -> keras.callbacks.History:
    """Train `model` like `model.fit`, over `partitions` stages × `replicas` pipelines.

    Run it on partitions × replicas MPI ranks (``hyparflow-run -n N python script.py``),
    every rank with the same script, model and data. ``partitions=1, replicas=1``
    also runs without MPI.

    Args:
        model: a compiled keras.Model (functional or Sequential for partitions > 1).
        x: input data: a numpy array, a list of arrays, or a dict keyed by input name.
        y: targets, likewise per output.
        partitions: pipeline stages P the model is cut into.
        replicas: copies R of the pipeline, each training on its share of every batch.
        microbatches: pieces m each replica's share is cut into. Default: 1 when P = 1,
            else between P and 4P with micro-batches of at least 16 samples (see
            `hyparflow.data.batches.default_microbatches` for why).
        batch_size: the global batch, as in `Model.fit`: one optimizer step consumes
            this many samples, split over replicas and then micro-batches. A dataset,
            generator or PyDataset gives its own batches (leave it None, as for
            `Model.fit`); None with arrays: 32.
        epochs: the epoch to stop after, as in `Model.fit`.
        verbose: "auto", 0, 1 or 2, as in `Model.fit`; one rank prints.
        callbacks: Keras callbacks, called on every rank with the same logs. File
            writers (CSVLogger, TensorBoard) run on one rank; ModelCheckpoint and
            BackupAndRestore save every stage's weights and optimizer state into
            one standard file, written by one rank, atomically.
        validation_split: the last fraction of `x`/`y` held out for validation,
            as in `Model.fit`.
        validation_data: `(x_val, y_val)` or `(x_val, y_val, sample_weight_val)`,
            evaluated (pipelined) after each epoch; logs get `val_` names.
        shuffle: shuffle the samples each epoch (the same order on every rank).
        class_weight: dict class index → weight (single-output models).
        sample_weight: one weight per sample (one array, or one per output).
        initial_epoch: the epoch to start from (to resume a run); the data
            order continues as in the uninterrupted run.
        steps_per_epoch: global batches per epoch; an epoch goes on where the
            previous stopped, as in `Model.fit`.
        validation_steps: batches of validation data per validation.
        validation_batch_size: its global batch (default: `batch_size`).
        validation_freq: validate every this many epochs, or after the epochs listed.
        partitions, replicas: either may be "auto": `hf.plan` measures the model on
            rank 0 and picks the fastest P × R (and m, if `microbatches` is None) for
            the job's ranks (numpy inputs), messages within a node costed as shared
            memory, between nodes by the link measured between two of them.
        balance: how to cut the model: "flops" (default; "time" when partitions
            or replicas is "auto"), "params", "layers",
            "time" (measured on rank 0, shared), "memory", or an explicit split;
            see `hyparflow.partition`.
        seed: shuffling seed, the same on every rank; default: the seed given to
            `keras.utils.set_random_seed` if the script called it (so that a
            resumed run shuffles as the uninterrupted one), else drawn on rank 0.
        schedule: "1f1b" (default; keeps at most P − s micro-batches' activations on
            stage s), "gpipe" (all forwards, then all backwards) or "interleaved"
            (Megatron-LM's interleaved 1F1B: the model is cut into partitions × `chunks`
            stages, rank p holding stages p, p + P, …; the pipeline's idle time shrinks
            by the factor `chunks`, for that many times the messages), or "zb-h1" (with
            step_graph=True: 1F1B with each backward split in two, the partial errors
            sent first and the weight gradients computed while the stage would wait;
            1F1B's memory). Same results.
            "auto": the planner's fastest of those it ranks by default (1F1B and GPipe;
            interleaved too with step_graph=True), as partitions="auto" measures it.
        chunks: with schedule="interleaved", the stages each rank holds (default 2);
            an explicit `balance` list then gives partitions × chunks stages.
        recompute: keep only each stage's inputs per micro-batch and run the forward
            again inside the backward: less memory, about one more forward of work;
            the same results up to float32 rounding.
        step_graph: compile each rank's whole training step, every micro-batch's
            forward and backward and the messages between stages, into one graph,
            instead of one compiled function per forward and backward. TensorFlow
            then optimises a forward together with its backward: a deep stage's step
            runs faster (ResNet-110, P = 2, m = 8: 873 ms a step against 944), but
            the first call compiles m forwards and backwards (there 100 s against
            40 s), again for each new micro-batch size. The same results up to
            float32 rounding. Not with recompute=True.
        shard_optimizer: split the optimizer's state (Adam's moments, momentum) over
            the replicas, as ZeRO stage 1: each replica updates its share of every
            stage's variables and keeps only their slots (about 1/replicas of them),
            gradients are reduce-scattered to the owner and the new weights
            all-gathered (the bytes of one allreduce). The same weights; after
            hf.fit, `model.optimizer` holds the whole state again on every rank.
            Not for a model with its own train_step or compute_loss at partitions=1.
        trace: a path: record every rank's timeline of the training steps (forwards,
            backwards, receive waits, allreduce, optimizer; not validation) and write
            it there as a Chrome trace
            (draw it with ``python -m hyparflow.trace PATH -o PNG``).
        keep_nested: keep models used as layers whole instead of splitting through
            their layers.
        timeout: seconds any one wait for a message, allreduce or broadcast may
            last before the watchdog reports what it waited for and ends the job
            (default 600; the first step of a new configuration, which traces
            and compiles, gets 3×; None: no watchdog).
        batch_hooks_read_weights: whether the training-batch hooks of your own callbacks
            (a class's ``on_train_batch_end``, a LambdaCallback's) may read or change
            weights. True (the default): before each such hook every rank gets every
            stage's current weights (at P > 1, one broadcast of the model per step),
            so the hook sees what it would under `model.fit`. False, for hooks that
            read none (timing steps, counting, logging `logs`): no broadcast; during
            an epoch a rank then holds other stages' weights as of the epoch's start.
            Keras' own callbacks never need it.

    Returns:
        A `keras.callbacks.History`, on every rank, with the keys `Model.fit` gives.
        The model on every rank holds the trained weights afterwards.

    Raises:
        ValueError / TypeError: bad arguments, raised identically on every rank before
            any training message is exchanged. On a multi-rank job, any exception
            after that (in a layer, the loss, a callback, hyparflow, or the watchdog)
            on any rank ends the whole job: that rank prints its traceback, the
            others one line naming it, and MPI aborts with exit code 1.
    """
    args = Call(**locals())
    _auto(model, args)
    world, guard, plan = _start("fit", model, args)
    if seed is None:
        seed = _default_seed(world)
    try:
        return _fit(model, plan, args, seed, world)
    except BaseException as exc:  # one rank failing must end the job, not hang the others
        if not guard.agreed(exc):  # (raised alike on every rank: the job is healthy)
            guard.fail(exc)
        raise


def _auto(model, a):
    """Resolve ``partitions="auto"`` / ``replicas="auto"`` / ``schedule="auto"`` in `a` with the
    planner's fastest choice.

    Collective: on a launched job every rank first shows the others its P, R, m,
    batch size and schedule (ranks that disagree fail together, instead of some
    waiting for a plan); then `_choose` measures the model and every rank gets the
    same P, R and schedule (and m, when `microbatches` is None). An error, on rank 0
    or in the arguments, is raised on every rank. The choice is kept on
    the model, so later calls with the same arguments do not plan again (and
    cannot pick another split). Under "auto" the default balance is "time", the
    split the planner assumed.
    """
    P, R = a.partitions, a.replicas
    auto = "auto" in (P, R, a.schedule)
    if a.balance is None:
        a.balance = "time" if auto else DEFAULT_BALANCE
    world = comm_.world() if comm_.launched() else None
    N = world.Get_size() if world is not None else 1
    if world is not None and N > 1:
        asked = (repr(P), repr(R), repr(a.microbatches), repr(a.batch_size), repr(a.schedule))
        # (the call's first collective: bounded, as `_start`'s agreement is)
        arrive = guard_.Guard(world, f"rank {world.Get_rank()}", guard_.DEFAULT_TIMEOUT,
                              notices=False).bounded(
            "every rank to call hf.fit (it is collective: call it on every rank)")
        if len(set(comm_.allgather_objects(asked, world, wait=arrive))) > 1:
            raise ValueError(
                "hf.fit got different partitions, replicas, microbatches, batch_size or "
                "schedule on different ranks (one passing 'auto', another a value?): pass the "
                "same on every rank.")
    if not auto:
        return
    key = (N, repr(P), repr(R), repr(a.microbatches), repr(a.batch_size),
           repr(a.schedule), repr(a.chunks), repr(a.step_graph), a.keep_nested)
    chosen = model.__dict__.setdefault("_hyparflow_auto", {})
    if key not in chosen:
        chosen[key] = _choose(model, N, P, R, a, world)
    a.partitions, a.replicas, m, a.schedule = chosen[key]
    if a.microbatches is None:
        a.microbatches = m


def _choose(model, N, P, R, a, world):
    """(P, R, m, schedule) from `planner.plan` for N ranks, keeping whichever of P, R and
    the schedule was given (schedule="auto": among those `planner.plan` ranks by default,
    the interleaved one only with the step graph).

    Collective on a launched job (the arguments are the same on every rank, so
    their checks fail alike): rank 0 measures the model alone while the others
    wait, then every rank times the compiled model at once (the contention of a
    node's ranks), and every rank ranks the same predictions.
    """
    from hyparflow import planner

    for name, value in (("partitions", P), ("replicas", R)):
        if value != "auto":
            _whole_number(name, value)
    if a.schedule == "auto" and a.chunks is not None:
        raise ValueError(f"chunks={a.chunks!r} with schedule='auto': the planner chooses the "
                         "schedule (interleaved with 2 stages a rank). Pass "
                         "schedule='interleaved' with chunks, or leave chunks out.")
    _check_step_graph(a.step_graph, a.recompute, 1, a.schedule)  # before planning with it
    one_stage = "1f1b" if a.schedule == "auto" else a.schedule  # the schedule of one stage
    if "auto" not in (P, R) and P * R != N:
        return P, R, None, one_stage  # hf.fit's check of the job's size names it
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
        return 1, 1, None, one_stage
    if not is_graph_model(model):  # a subclassed model cannot be cut: data parallel only
        if P not in ("auto", 1):
            raise ValueError(f"partitions={P!r}: a subclassed model cannot be cut into "
                             "stages; use partitions=1 (or 'auto').")
        return 1, N, None, one_stage
    from hyparflow.mpi import placement

    batch_size = int(batch_size)
    ms = (a.microbatches,) if a.microbatches is not None else (1, 2, 4, 8, 16, 32)
    sizes = planner.microbatch_sizes(batch_size, N, ms) or [1]

    profile = comm_.from_root(
        world, lambda: planner.measure(model, sizes, keep_nested=a.keep_nested),
        f"hf.fit(partitions={P!r}, replicas={R!r}): measuring the model")
    per_node = placement.ranks_per_node()
    between = None  # several nodes: messages between them cost what the link measures
    if world is not None:
        profile = planner.measure_contention(model, max(1, batch_size // N), world, profile,
                                             busy=min(N, per_node or N))
        if per_node is not None and per_node < N:
            between = planner.measure_link(world)
            if between is not None and a.verbose != 0 and world.Get_rank() == 0:
                print(f"hf.plan: between nodes {between.latency * 1e6:.1f} µs one way, "
                      f"{between.bandwidth / 1e6:.0f} MB/s, an allreduce "
                      f"{between.allreduce_bandwidth / 1e6:.0f} MB/s (measured)", flush=True)
    result = planner.plan(model, N, batch_size, microbatches=ms,
                          schedules=None if a.schedule == "auto" else (a.schedule,),
                          chunks=a.chunks or 2,
                          keep_nested=a.keep_nested, ranks_per_node=per_node,
                          allreduce_network=between, profile=profile,
                          shard_optimizer=a.shard_optimizer, step_graph=a.step_graph,
                          verbose=a.verbose != 0 and (world is None or world.Get_rank() == 0))
    fitting = [(p.partitions, p.replicas, p.microbatches, p.schedule)
               for p in result.predictions
               if P in ("auto", p.partitions) and R in ("auto", p.replicas)]
    # rank 0's choice for all: a tie must not break differently on another rank
    choice = world.bcast(fitting[:1], root=0) if world is not None else fitting[:1]
    if not choice:
        raise ValueError(f"partitions={P!r}, replicas={R!r}: no configuration of {N} ranks "
                         f"fits this model and batch_size={batch_size}.")
    return choice[0]


def _default_seed(world):
    """The shuffling seed: keras.utils.set_random_seed's seed if the script set one (so a
    restarted script shuffles alike), else a fresh draw; rank 0's either way."""
    seed = keras_private.random_seed()
    if seed is None:
        seed = int(np.random.default_rng().integers(2**31))
    if world is not None and world.Get_size() > 1:
        seed = world.bcast(seed, root=0)
    return seed


def _fit(model, plan, a, seed, world):
    """The training of `fit`, after validation."""
    trainer = _trainer(model, plan, a.balance, a.keep_nested, world, a.verbose, a.schedule,
                       a.shard_optimizer, a.step_graph)
    # whose optimizer state hf.save gathers, and whose P × R evaluate/predict("auto") reuse
    model.__dict__["_hyparflow_fit"] = trainer
    _remember_trainable(model)
    top, executor = trainer.topology, trainer.executor
    executor.configure(schedule_.by_name(a.schedule), a.recompute, a.step_graph)
    if a.trace is not None:
        executor.recorder = trace_.Recorder()
        if world is not None and world.Get_size() > 1:
            world.Barrier()  # a common time zero for every rank's timeline
        executor.recorder.restart()
    checkpoint.start_from_rank0(trainer, train=True)
    feed = _feed(trainer, plan.source, plan.batch_size, plan.m, a.steps_per_epoch,
                 a.shuffle, seed, train=True)
    validation = None
    if plan.val is not None:
        validation = _feed(trainer, plan.val, plan.val_batch_size, plan.val_m,
                           a.validation_steps)
    cbs = callback_list(model, a.callbacks, a.verbose, plan.epochs,
                        feed.steps or feed.num_batches,
                        top.rank == top.logging_rank, trainer.guard, trainer, world)
    # (of every callback the ranks were given and agreed on: the file writers run on one)
    readers = callbacks_.batch_readers(a.callbacks) if a.batch_hooks_read_weights else []
    if readers and world is not None and world.Get_size() > 1 and a.verbose != 0 and \
            top.rank == top.logging_rank:
        _notice_batch_readers(model, readers, top)
    # Callbacks (learning-rate schedules, checkpoints) work on the optimizer that trains.
    model.optimizer = executor.optimizer
    interrupted = None
    try:
        # BatchNormalization's moving statistics once a step, from the moments of every
        # micro-batch, and synchronized layers' moments over the replicas, as model.fit's
        deferred = plan.m is None or plan.m > 1
        if deferred:
            _check_norms_called_once(model, trainer)
        with quiet(top.rank != top.logging_rank), \
                checkpoint.saves_in_training(model, trainer, world), \
                executor.norms.training(deferred), \
                streams.apart(model, top.replica), \
                preemption.Watch(world, trainer.guard) as watch:
            logs = loop.train(trainer, feed, plan.epochs, a.initial_epoch, cbs, validation,
                              a.validation_freq, watch, gather_each_batch=bool(readers))
    except BaseException as exc:  # Preempted is a SystemExit
        if not trainer.guard.agreed(exc):
            raise
        # Raised on every rank: leave the model as model.fit would, every stage's weights
        # (and, below, optimizer state) on every rank, then raise it.
        interrupted = exc
        checkpoint.gather_weights(trainer)
    finally:
        model.optimizer = trainer.user_optimizer
    optimizers_.gather_into_user(trainer)
    streams.agree(model, world, trainer.guard.bounded("every rank's random generators"))
    if interrupted is not None:
        raise interrupted
    if a.trace is not None:
        _write_trace(a.trace, executor, world, top.partitions, top.replicas,
                     _planned_m(plan), a.schedule)
    with checkpoint.saves_in_training(model, trainer, world, whole=True):  # all whole again
        cbs.on_train_end(logs)
    if world is not None and world.Get_size() > 1:  # what the logging rank wrote is complete
        trainer.guard.bounded("every rank to end hf.fit (the logging rank closing its files)")(
            world.Ibarrier())
    watch.deliver()
    return model.history


def _notice_batch_readers(model, readers, top):
    """Say once what the user's training-batch hooks cost a step (`checkpoint.gather_weights`
    before each): at P > 1 every stage's weights to every rank; at P = 1 the replicas'
    non-trainable state (BatchNormalization's statistics) merged, if any."""
    if top.partitions > 1:
        what, nbytes = "every rank gets every stage's weights", sum(
            shard_.nbytes(w) for w in model.weights)
    else:
        what, nbytes = "the replicas merge their non-trainable state (BatchNormalization's " \
            "statistics)", sum(shard_.nbytes(w) for w in replica_state.of(model))
        if not nbytes:
            return  # no state to merge: the hooks cost nothing
    size = f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"
    print(f"hyparflow: the training-batch hooks of "
          f"{', '.join(sorted({type(cb).__name__ for cb in readers}))} are code of your "
          f"own, which may read any weight: {what} before each on_train_batch_end ({size} a "
          "step; hf.fit(..., batch_hooks_read_weights=False) if they read none).", flush=True)


def _inference(mode, model, a):
    """The shared setup of `evaluate` and `predict`: forwards only, samples in order."""
    fitted = model.__dict__.get("_hyparflow_fit")
    if "auto" in (a.partitions, a.replicas):
        if fitted is None:
            raise ValueError(
                f"hf.{mode}(partitions={a.partitions!r}, replicas={a.replicas!r}) reuses "
                "what hf.fit(..., 'auto') chose for this model, and it has not been trained "
                "with hf.fit yet: pass whole numbers, or call hf.fit first.")
        top = fitted.topology
        a.partitions, a.replicas, a.balance = top.partitions, top.replicas, \
            fitted.balance
    if fitted is not None and (a.partitions, a.replicas) == (fitted.topology.partitions,
                                                             fitted.topology.replicas):
        a.chunks = fitted.topology.chunks  # the stages fit's ranks hold: its trainer serves
    world, guard, plan = _start(mode, model, a)
    try:
        trainer = _trainer(model, plan, a.balance, a.keep_nested, world, a.verbose)
        top = trainer.topology
        checkpoint.start_from_rank0(trainer)
        feed = _feed(trainer, plan.source, plan.batch_size, plan.m, a.steps)
        cbs = callback_list(model, a.callbacks, a.verbose, 1,
                            feed.steps or feed.num_batches, top.rank == top.logging_rank,
                            trainer.guard)
        trainer.added.clear()  # every replica starts from rank 0's model
        if mode == "evaluate":
            out = loop.evaluate(trainer, feed, cbs)
        else:
            out = loop.predict(trainer, feed, cbs, world)
        checkpoint.gather_state(trainer)  # what a layer counted in inference, merged
        return out
    except BaseException as exc:  # one rank failing must end the job, not hang the others
        if not guard.agreed(exc):  # (raised alike on every rank: the job is healthy)
            guard.fail(exc)
        raise


def evaluate(model: keras.Model, x: Any = None, y: Any = None, *,
             partitions: int | Literal["auto"] = 1, replicas: int | Literal["auto"] = 1,
             microbatches: int | None = None, batch_size: int | None = 32,
             verbose: Literal["auto", 0, 1, 2] = "auto", sample_weight: Any = None,
             steps: int | None = None,
             callbacks: Sequence[keras.callbacks.Callback] | None = None,
             return_dict: bool = False,
             balance: str | Sequence[int] | Sequence[str] = DEFAULT_BALANCE,
             keep_nested: bool = False, timeout: float | None = guard_.DEFAULT_TIMEOUT,
             ) -> float | list[float] | dict[str, float]:
    """Evaluate `model` like `model.evaluate`, pipelined over `partitions` × `replicas` ranks.

    Forwards only (inference mode: dropout off, BatchNormalization's moving
    statistics), the samples in order, each replica taking its share of every
    batch. Reuses the stages a previous `hf.fit` built for the same model and
    configuration. `sample_weight` and `steps` as in `Model.evaluate`; the
    other arguments as for `fit`, except that "auto" for partitions or replicas
    means the P × R (and balance) that `hf.fit` last chose for this model.

    Returns:
        What `Model.evaluate` returns, on every rank: the loss, or a list of the
        loss and the metrics in `model.metrics_names` order, or a dict with
        `return_dict=True`.
    """
    logs = _inference("evaluate", model, Call(**locals()))
    return dict(logs) if return_dict else keras_private.metrics_in_order(model, logs)


def predict(model: keras.Model, x: Any = None, *, partitions: int | Literal["auto"] = 1,
            replicas: int | Literal["auto"] = 1, microbatches: int | None = None,
            batch_size: int | None = 32, verbose: Literal["auto", 0, 1, 2] = "auto",
            steps: int | None = None,
            callbacks: Sequence[keras.callbacks.Callback] | None = None,
            balance: str | Sequence[int] | Sequence[str] = DEFAULT_BALANCE,
            keep_nested: bool = False, timeout: float | None = guard_.DEFAULT_TIMEOUT) -> Any:
    """Predict like `model.predict`, pipelined over `partitions` × `replicas` ranks.

    The model need not be compiled. Arguments as for `fit`; `steps` as in
    `Model.predict`.

    Returns:
        What `Model.predict` returns — an array per output, in the model's output
        structure, one row per sample in order — on every rank.
    """
    return _inference("predict", model, Call(**locals()))


def save(model: keras.Model, filepath: str | os.PathLike[str], *, overwrite: bool = True) -> None:
    """Save `model` to one standard Keras file, from the ranks that trained it.

    Call it on every rank, like `hf.fit`. The file holds every stage's weights
    and, for a model trained with `hf.fit`, the optimizer's state of every stage
    in the layout single-process Keras uses: `keras.models.load_model` (or
    `load_weights`) restores it on one process or on any P × R. One rank writes,
    to a temporary name that is renamed into place, so a crash during the save
    leaves the previous file intact.

    Args:
        model: the model passed to `hf.fit` (or any built model).
        filepath: ends in ``.keras`` (the whole model, as `Model.save`) or
            ``.weights.h5`` (weights and optimizer state, as `Model.save_weights`).
        overwrite: replace an existing file (default), as `Model.save`.

    Example:
        >>> history = hf.fit(model, x, y, partitions=2, replicas=2, epochs=3)
        >>> hf.save(model, "trained.keras")   # on every rank; one file
    """
    trainer = model.__dict__.get("_hyparflow_fit")
    world = trainer.world if trainer is not None else (
        comm_.world() if comm_.launched() else None)
    if world is not None and world.Get_size() == 1:
        world = None
    if trainer is not None:
        guard = trainer.guard
    elif guard_.for_job_made() or world is None:
        guard = guard_.for_job(world)
    else:  # no collective yet (making the job's guard is one): a rank that never comes is seen
        guard = guard_.Guard(world, f"rank {world.Get_rank()}", notices=False)
    try:
        checkpoint.save(model, filepath, trainer, world, overwrite=overwrite, guard=guard,
                        training=checkpoint.training_now(model))
    except BaseException as exc:
        if not guard.agreed(exc):  # a rank that never came, or a failure elsewhere
            guard.fail(exc)
        raise  # raised alike on every rank (bad input, a write that failed): the job is healthy
