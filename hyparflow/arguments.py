"""hf.fit's, evaluate's and predict's arguments checked, identically on every rank before any
message, and resolved into the `Plan` every rank follows."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from hyparflow.data import batches as data_
from hyparflow.data import sources
from hyparflow.engine import buckets as buckets_
from hyparflow.engine import schedule as schedule_
from hyparflow.keras import batch_norm, keras_private, reduction
from hyparflow.keras import optimizers as optimizers_
from hyparflow.keras.user_loss import UserLoss
from hyparflow.partitioner.graph import LayerGraph, functional_of, is_graph_model
from hyparflow.partitioner.split import Partition, check_partitions
from hyparflow.training import callbacks as callbacks_
from hyparflow.training import checkpoint

_VERBOSE = ("auto", 0, 1, 2)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How `hf.fit` runs the pipeline, beyond the schedule's name:
    ``hf.fit(..., schedule=hf.Schedule("interleaved", chunks=4))`` (a name alone,
    ``schedule="interleaved"``, leaves the rest to hyparflow).

    Args:
        name: "1f1b", "gpipe", "interleaved", "zb-h1", or "auto" (the planner's fastest).
        chunks: with "interleaved", the stages each rank holds (default 2); the pipeline's
            idle time shrinks by this factor, for that many times the messages.
        step_graph: compile each rank's whole training step (every micro-batch's forward
            and backward and the messages between stages) into one graph, instead of one
            compiled function per forward and backward. TensorFlow then optimises a forward
            together with its backward: a deep stage runs faster (ResNet-110, P = 2, m = 8:
            873 ms a step against 944), but the first call compiles m forwards and
            backwards (there 100 s against 40 s), again for each new micro-batch size, and
            holds more memory per micro-batch. The same results up to float32 rounding. Not
            with recompute=True, nor for a model with its own train_step. None (default):
            on for "zb-h1", which only the step graph runs, and for a call long enough to
            repay its first call (`hyparflow.defaults`); off otherwise.
    """

    name: str = "1f1b"
    chunks: int | None = None
    step_graph: bool | None = None

    def __post_init__(self):
        if self.name != "auto" and self.name not in schedule_.SCHEDULES:
            raise ValueError(f"{self!r}: not a schedule; use one of "
                             f"{', '.join(map(repr, schedule_.SCHEDULES))} or 'auto'.")
        if self.chunks is not None and (not isinstance(self.chunks, (int, np.integer))
                                        or isinstance(self.chunks, bool) or self.chunks < 1):
            raise ValueError(f"{self!r}: chunks must be a whole number ≥ 1 (or left out).")
        if self.step_graph is not None and not isinstance(self.step_graph, bool):
            raise ValueError(f"{self!r}: step_graph must be True or False (or left out).")

    def __repr__(self):
        return "hf.Schedule(" + ", ".join([repr(self.name)] + [
            f"{k}={getattr(self, k)!r}" for k in ("chunks", "step_graph")
            if getattr(self, k) is not None]) + ")"


@dataclasses.dataclass(frozen=True)
class Call:
    """The arguments of one hf.fit, evaluate or predict call, by name, as given (those a call
    does not take hold Model.fit's defaults). Frozen: a value resolved later ("auto", the
    default balance, what fit chose) makes a new record (`replace`)."""

    model: Any = None
    x: Any = None
    y: Any = None
    partitions: int | str = 1
    replicas: int | str = 1
    microbatches: int | None = None
    batch_size: int | None = 32
    epochs: int = 1
    verbose: int | str = "auto"
    callbacks: Any = None
    validation_split: float = 0.0
    validation_data: Any = None
    shuffle: bool = False
    class_weight: Any = None
    sample_weight: Any = None
    initial_epoch: int = 0
    steps_per_epoch: int | None = None
    validation_steps: int | None = None
    validation_batch_size: int | None = None
    validation_freq: Any = 1
    balance: Any = None
    schedule: Any = "1f1b"  # a name (fit: None, `defaults.resolve`'s); an `hf.Schedule` is
    # unpacked into the next two
    chunks: int | None = None
    recompute: bool = False
    step_graph: bool | None = None  # None: on for a schedule that needs it (`step_graph_of`)
    shard_optimizer: bool = False
    timeout: float | None = None
    steps: int | None = None
    return_dict: bool = False
    keep_nested: bool = False  # from a `Partition` given as balance
    cut: Any = None  # that Partition
    predicted_speedup: float | None = None  # over one process, of what "auto" chose
    defaulted: str | None = None  # why, where `defaults.resolve` chose the schedule
    # (bytes the tightest rank may use or None, where that comes from, the most a rank holds
    # now), the same on every rank (`auto.resolve`); None in one process
    memory: tuple | None = None

    def __post_init__(self):
        given = self.schedule
        if isinstance(given, Schedule):
            for name, value in (("schedule", given.name), ("chunks", given.chunks),
                                ("step_graph", given.step_graph)):
                object.__setattr__(self, name, value)
        elif given is not None and not isinstance(given, str):
            raise ValueError(
                f"schedule={given!r}: use a schedule's name ("
                f"{', '.join(map(repr, schedule_.SCHEDULES))} or 'auto') or hf.Schedule(...) "
                "for more than the name.")
        if isinstance(self.balance, Partition):
            cut = self.balance
            object.__setattr__(self, "cut", cut)
            object.__setattr__(self, "balance", [len(st.calls) for st in cut.stages])
            object.__setattr__(self, "keep_nested", bool(cut.graph and cut.graph.keep_nested))

    def replace(self, **changes):
        """A new record with `changes`."""
        return dataclasses.replace(self, **changes)

    def named_schedule(self):
        """How the call gave its schedule, for messages: ``'1f1b'``, or
        ``hf.Schedule('interleaved', chunks=4)`` when it gave more than the name."""
        if self.chunks is None and self.step_graph is None:
            return repr(self.schedule)
        return repr(Schedule(self.schedule, self.chunks, self.step_graph))


@dataclasses.dataclass
class Plan:
    """What every rank follows for one call, as `validate` found it."""

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


def whole_number(name, value, minimum=1):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be a whole number ≥ {minimum}.")
    return int(value)


def _positive_or_none(name, value):
    return None if value is None else whole_number(name, value)


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
        check_partitions(LayerGraph.of(model, keep_nested), P * chunks)


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
    v = whole_number("chunks", a.chunks)
    if v > 1 and not chunked:
        named = [s.name for s in schedule_.SCHEDULES.values() if s.chunked]
        raise ValueError(f"schedule={a.named_schedule()}: only the {' or '.join(named)} "
                         "schedule gives a rank several stages. Use "
                         f"{Schedule(named[0], chunks=v)!r}, or leave chunks out.")
    if v > 1 and P == 1:
        raise ValueError(f"schedule={a.named_schedule()} with partitions=1: one rank a "
                         "pipeline has no bubble to interleave. Use partitions ≥ 2, or leave "
                         "chunks out.")
    return v


def _check_cut(model, cut, P, v):
    """Refuse a `Partition` given as balance that is not a cut of this model into the
    stages the call runs (P × v, v stages a rank)."""
    if cut is None:
        return
    given = f"balance=<a Partition into {len(cut.stages)} stages>"
    if cut.model is not model:
        raise ValueError(f"{given}: it cuts model {cut.model.name!r}, not model "
                         f"{model.name!r}. Give hf.partition this model.")
    if len(cut.stages) != P * v:
        each = f", {v} a rank" if v > 1 else ""
        raise ValueError(f"{given}: hf.fit(partitions={P}) cuts the model into {P * v} "
                         f"stages{each}. Make the Partition with partitions={P * v}, or pass "
                         "partitions to match it.")


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


def remember_trainable(model):
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
    m = whole_number("microbatches", microbatches)
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
            whole_number("validation_freq", freq)
        except ValueError:
            raise ValueError(f"validation_freq={freq!r}: use a whole number ≥ 1 (validate "
                             "every that many epochs) or a list of epoch numbers, as in "
                             "Model.fit.") from None
    _positive_or_none("validation_steps", a.validation_steps)
    batch_size = _positive_or_none("validation_batch_size", a.validation_batch_size) \
        or a.batch_size
    if a.validation_data is not None:
        vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(a.validation_data)
        val = sources.source_of(model_io(model), vx, vy, vsw, None, "evaluate",
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


def _splits(schedule):
    """Whether `schedule` (a name, or "auto") splits each backward: only the step graph runs it."""
    return schedule in schedule_.SCHEDULES and schedule_.by_name(schedule).split


def step_graph_of(a):
    """The call's step graph: as given, else (None) on exactly for a schedule only the step
    graph runs (the zero-bubble one)."""
    return _splits(a.schedule) if a.step_graph is None else a.step_graph


def check_step_graph(a, world_size):
    """Refuse a step graph asked for or implied (`step_graph_of`) with `recompute`, the
    zero-bubble schedule without it, or one this MPI cannot run."""
    named = f"schedule={a.named_schedule()}"
    if a.step_graph is None and _splits(a.schedule) and a.recompute:
        raise ValueError(
            f"{named} with recompute=True: the zero-bubble schedule runs in the step graph, "
            "which keeps every micro-batch's activations from its forward to its backward, "
            "where recompute=True keeps only the inputs. Choose one: "
            f"{named} for speed, or schedule='1f1b' with recompute=True for memory.")
    step_graph = step_graph_of(a)
    if a.schedule != "auto":
        schedule_.by_name(a.schedule).refuse_without_step_graph(step_graph, named,
                                                                "Leave step_graph out")
    if step_graph and a.recompute:
        raise ValueError(
            f"{named} with recompute=True: the step graph keeps every micro-batch's "
            "activations from its forward to its backward inside the graph, where "
            "recompute=True keeps only the inputs. Choose one (the step graph for speed, "
            "recompute for memory).")
    if step_graph and world_size > 1:
        from hyparflow.mpi import comm as comm_

        if not comm_.any_thread_sends():
            raise ValueError(
                f"{named}: the step graph exchanges messages from TensorFlow's own thread, "
                "which this MPI does not allow (it gives MPI_THREAD_FUNNELED or less). Use "
                "hf.Schedule(step_graph=False), or an MPI that provides "
                "MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE.")


def validate(model, mode, world_size, a):
    """Check the call before any message; returns the `Plan` every rank follows.

    `mode` is "fit", "evaluate" (no optimizer needed) or "predict" (no compile,
    no y). `a` is the `Call`.
    """
    P = whole_number("partitions", a.partitions)
    R = whole_number("replicas", a.replicas)
    v = _chunks(a, P) if mode == "fit" else a.chunks or 1
    timeout = a.timeout
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout={timeout!r}: use a number of seconds > 0, or None for no "
                         "watchdog.")
    _check_cut(model, a.cut, P, v)
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
    batch_size = 32 if a.batch_size is None else whole_number("batch_size", a.batch_size)
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
        raise ValueError(f"schedule={a.named_schedule()}: model {model.name!r} brings its own "
                         "train_step, which runs as Keras compiles it. Leave step_graph out.")
    plan = Plan(P=P, R=R, m=m, batch_size=batch_size, own=own, chunks=v)
    if mode == "fit":
        refused = batch_norm.refusal(batch_norm.of([model]), m, R)
        if refused is not None:
            raise refused
        epochs = whole_number("epochs", a.epochs, minimum=0)
        whole_number("initial_epoch", a.initial_epoch, minimum=0)
        _positive_or_none("steps_per_epoch", a.steps_per_epoch)
        if not isinstance(a.recompute, bool):
            raise ValueError(f"recompute={a.recompute!r}: use True or False.")
        check_step_graph(a, world_size)
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
        callbacks_.tracer(a.callbacks)  # (more than one refused)
    else:
        _positive_or_none("steps", a.steps)
        if callbacks_.tracer(a.callbacks) is not None:
            raise ValueError(f"callbacks: hf.Trace records training steps, which hf.{mode} "
                             "runs none of. Pass it to hf.fit.")
    # Model.fit's split (the last fraction of the arrays) comes before anything else is read.
    split_asked = mode == "fit" and a.validation_split and a.validation_data is None
    if split_asked and streamed:
        raise sources.unsplittable(a.x)
    source = sources.source_of(
        model_io(model), a.x, a.y, a.sample_weight,
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
    io = model_io(model)
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


def model_io(model):
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
