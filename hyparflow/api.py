"""hf.fit: validate collectively, build (or reuse) this rank's trainer, run the Keras loop."""

import numpy as np

from hyparflow import comm as comm_
from hyparflow import data as data_
from hyparflow import guard as guard_
from hyparflow import schedule as schedule_
from hyparflow import trace as trace_
from hyparflow.callbacks import StepLogs, callback_list
from hyparflow.partitioner.graph import LayerGraph, functional_of, is_graph_model
from hyparflow.partitioner.split import check_partitions
from hyparflow.topology import Topology

_VERBOSE = ("auto", 0, 1, 2)


class Trainer:
    """Everything one rank keeps between calls for one model and configuration."""

    def __init__(self, model, topology, world, partition, executor, logs, guard):
        self.model = model
        self.topology = topology
        self.world = world
        self.partition = partition
        self.executor = executor
        self.logs = logs
        self.guard = guard


def _whole_number(name, value, minimum=1):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be a whole number ≥ {minimum}.")
    return int(value)


def _validate(model, x, y, partitions, replicas, microbatches, batch_size, epochs, verbose,
              schedule, recompute, keep_nested, timeout, world_size, mode="fit"):
    """Check the call before any message; returns (topology args, x arrays, y arrays).

    `mode` is "fit", "evaluate" (no optimizer needed) or "predict" (no compile, no y).
    """
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}.")
    P = _whole_number("partitions", partitions)
    R = _whole_number("replicas", replicas)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout={timeout!r}: use a number of seconds > 0, or None for no "
                         "watchdog.")
    if not isinstance(keep_nested, bool):
        raise ValueError(f"keep_nested={keep_nested!r}: use True or False.")
    if mode != "predict" and (not model.compiled or (
            mode == "fit" and getattr(model, "optimizer", None) is None)):
        raise ValueError(f"model {model.name!r} is not compiled. Call "
                         f"model.compile(optimizer=..., loss=...) before hf.{mode}.")
    if mode != "predict" and model._compile_loss is None:
        raise ValueError(f"model {model.name!r} was compiled without a loss. Call "
                         f"model.compile(optimizer=..., loss=...) with a loss before hf.{mode}.")
    if mode == "fit" and P > 1 and getattr(model.optimizer, "global_clipnorm", None):
        raise ValueError(
            f"model.optimizer has global_clipnorm={model.optimizer.global_clipnorm}: it clips by "
            f"the norm over all the model's gradients, which partitions={P} spreads over stages, "
            "and hyparflow does not combine that norm across stages yet. Use clipnorm or "
            "clipvalue (per variable), or partitions=1.")
    if P > 1 and not is_graph_model(model):
        functional_of(model)  # raises the explanation (subclassed / unbuilt Sequential)
    if P > 1:
        check_partitions(LayerGraph(model, keep_nested=keep_nested), P)
    # Then the launch (model errors come first: they hold however the job is launched).
    if P * R != world_size:
        if world_size == 1:
            raise ValueError(
                f"partitions={P} × replicas={R} needs {P * R} MPI ranks, but this process is "
                f"not part of an MPI job. Launch it with `hyparflow-run -n {P * R} python "
                f"script.py` (or `mpirun -n {P * R} python script.py`).")
        raise ValueError(
            f"partitions={P} × replicas={R} = {P * R}, but the job has {world_size} MPI ranks. "
            f"Launch with -n {P * R}, or choose partitions × replicas = {world_size}.")
    batch_size = _whole_number("batch_size", batch_size)
    _whole_number("epochs", epochs, minimum=0)
    schedule_.by_name(schedule)
    if not isinstance(recompute, bool):
        raise ValueError(f"recompute={recompute!r}: use True or False.")
    if verbose not in _VERBOSE:
        raise ValueError(f"verbose={verbose!r}: use 'auto', 0, 1 or 2, as in Model.fit.")
    if batch_size < R:
        raise ValueError(f"batch_size={batch_size} is smaller than replicas={R}: every replica "
                         f"needs at least one sample. Use batch_size ≥ {R}.")
    share = batch_size // R
    if microbatches is not None:
        m = _whole_number("microbatches", microbatches)
        if m > share:
            raise ValueError(
                f"microbatches={m} is larger than each replica's share of the batch "
                f"(batch_size={batch_size} / replicas={R} = {share} samples). Use "
                f"microbatches ≤ {share}, or a larger batch_size.")
    else:
        m = data_.default_microbatches(P, share)
    inputs, outputs, in_names, out_names = _io(model)
    x_arrays = data_.as_arrays(x, inputs, in_names, "x")
    y_arrays = [] if mode == "predict" else data_.as_arrays(y, outputs, out_names, "y")
    data_.num_samples(x_arrays, y_arrays)
    for a, t, name in zip(x_arrays, inputs or [], in_names or []):
        want = tuple(t.shape[1:])
        if len(a.shape) != len(t.shape) or any(
                w is not None and w != g for w, g in zip(want, a.shape[1:])):
            raise ValueError(f"x for input {name!r} has samples of shape {a.shape[1:]}, but the "
                             f"model expects {want}.")
    return P, R, m, batch_size, x_arrays, y_arrays


def _io(model):
    """Model input/output tensors and names (None for a subclassed model: taken as given)."""
    if is_graph_model(model):
        f = functional_of(model)
        return (f.inputs, f.outputs, [t._keras_history.operation.name for t in f.inputs],
                list(model.output_names))
    return None, None, None, None


def _trainer(model, P, R, m, batch_size, balance, keep_nested, world, x_first, y_first=()):
    """This rank's Trainer for (model, P, R, balance, ...), built once and cached on the model."""
    from hyparflow.executor import Executor
    from hyparflow.partitioner import partition
    from hyparflow.partitioner.split import whole_model

    cache = model.__dict__.setdefault("_hyparflow_trainers", {})
    # A new model.compile (optimizer, loss, metrics) needs new compiled stage functions.
    key = (P, R, repr(balance), keep_nested, world.Get_size() if world is not None else 1,
           id(getattr(model, "optimizer", None)), id(getattr(model, "_compile_loss", None)),
           id(getattr(model, "_compile_metrics", None)))
    if key in cache:
        return cache[key]
    rank = world.Get_rank() if world is not None else 0
    topology = Topology(partitions=P, replicas=R, rank=rank)
    if world is not None and world.Get_size() > 1:
        pipeline, stage_group = topology.communicators(world)
    else:
        pipeline = stage_group = None
    if is_graph_model(model):
        part = partition(model, P, balance=balance, keep_nested=keep_nested,
                         microbatch_size=max(1, batch_size // R // m), microbatches=m,
                         comm=world)
    else:  # subclassed, P = 1 (validated): the whole model is the one stage
        part = whole_model(model, len(x_first))
        model([a[:1] for a in x_first] if len(x_first) > 1 else x_first[0][:1])
    guard = guard_.for_job(world)
    guard.first_step = True  # new functions to trace: the first step may wait longer
    executor = Executor(part, topology, pipeline, stage_group, model,
                        getattr(model, "optimizer", None), guard)
    logs = StepLogs(model, topology, world, topology.is_last_stage, guard)
    trainer = Trainer(model, topology, world, part, executor, logs, guard)
    cache[key] = trainer
    return trainer


def _build_loss(trainer, x_arrays, y_arrays):
    """Build the compiled loss and metrics on the last stage (eagerly; once)."""
    if trainer.topology.is_last_stage and y_arrays:
        trainer.executor.worker.build_loss([a[:1] for a in x_arrays], [a[:1] for a in y_arrays])


def _sync_stage_weights(trainer, root_replica=0):
    """Give every replica of this stage replica 0's weights (replicas start equal)."""
    st = trainer.partition.stages[trainer.topology.stage]
    group = trainer.executor.replicas
    if group is None:
        return
    weights = st.model.weights
    values = comm_.broadcast_arrays([w.numpy() for w in weights], root_replica, group)
    for w, v in zip(weights, values):
        w.assign(v)


def _gather_weights(trainer):
    """After training, every rank's model gets every stage's weights.

    Trainable weights are equal on all replicas (same summed gradients); the
    non-trainable state each replica updated on its own samples (e.g.
    BatchNormalization's moving statistics) is averaged over replicas first.
    """
    st = trainer.partition.stages[trainer.topology.stage]
    group = trainer.executor.replicas
    state = [w for w in st.model.non_trainable_weights if "float" in str(w.dtype)]
    if group is not None and state:
        summed = comm_.allreduce_sum([w.numpy() for w in state], group)
        for w, v in zip(state, summed):
            w.assign(v / group.Get_size())
    pipeline = trainer.executor.pipeline
    if pipeline is None:
        return
    for st in trainer.partition.stages:
        weights = st.model.weights
        values = comm_.broadcast_arrays([w.numpy() for w in weights], st.index, pipeline)
        if st.index != trainer.topology.stage:
            for w, v in zip(weights, values):
                w.assign(v)


def _write_trace(path, executor, world, P, R, m, schedule):
    """Gather every rank's timeline on rank 0 and write one Chrome trace file."""
    events = executor.recorder.events
    executor.recorder = trace_.SILENT
    per_rank = world.gather(events, root=0) if world is not None and world.Get_size() > 1 \
        else [events]
    if per_rank is not None:
        trace_.write(str(path), trace_.chrome_trace(per_rank, P, R, m, schedule))


def _start(mode, model, x, y, partitions, replicas, microbatches, batch_size, epochs, verbose,
           schedule, recompute, keep_nested, timeout, extra):
    """Validate on every rank, agree, and set up the guard; returns (world, guard, checked).

    Raises the same ValueError/TypeError on every rank if any rank found bad input,
    or if the ranks were given different data or arguments.
    """
    world = comm_.world() if (partitions != 1 or replicas != 1 or comm_.launched()) else None
    world_size = world.Get_size() if world is not None else 1
    error, checked = None, None
    try:
        checked = _validate(model, x, y, partitions, replicas, microbatches, batch_size, epochs,
                            verbose, schedule, recompute, keep_nested, timeout, world_size, mode)
    except (ValueError, TypeError) as exc:
        error = exc
    fingerprint = None
    if checked is not None:
        P, R, m, batch_size, x_arrays, y_arrays = checked
        fingerprint = {
            "numbers of samples": len(x_arrays[0]),
            "partitions × replicas": (P, R), "batch_size": batch_size, "microbatches": m,
            "epochs": epochs, "schedule": schedule, "recompute": recompute, **extra,
            "input shapes and dtypes": [(a.shape[1:], str(a.dtype)) for a in x_arrays],
            "target shapes and dtypes": [(a.shape[1:], str(a.dtype)) for a in y_arrays],
        }
    comm_.agree(error, world, fingerprint)
    P, R = checked[0], checked[1]
    rank = world.Get_rank() if world is not None else 0
    guard = guard_.for_job(world, Topology(partitions=P, replicas=R, rank=rank).where(), timeout)
    return world, guard, checked


def fit(model, x=None, y=None, *, partitions=1, replicas=1, microbatches=None, batch_size=32,
        epochs=1, verbose="auto", shuffle=True, callbacks=None, balance="params", seed=None,
        schedule="1f1b", recompute=False, trace=None, keep_nested=False,
        timeout=guard_.DEFAULT_TIMEOUT):
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
            `hyparflow.data.default_microbatches` for why).
        batch_size: the global batch, as in `Model.fit`: one optimizer step consumes
            this many samples, split over replicas and then micro-batches.
        epochs: passes over the data.
        verbose: "auto", 0, 1 or 2, as in `Model.fit`; one rank prints.
        shuffle: shuffle the samples each epoch (the same order on every rank).
        callbacks: Keras callbacks, called on every rank with the same logs.
        balance: how to cut the model: "params" (default), "layers", "flops",
            "time" (measured on rank 0, shared), "memory", or an explicit split;
            see `hyparflow.partition`.
        seed: shuffling seed; default: drawn on rank 0 and shared.
        schedule: "1f1b" (default; keeps at most P − s micro-batches' activations on
            stage s) or "gpipe" (all forwards, then all backwards). Same results.
        recompute: keep only each stage's inputs per micro-batch and run the forward
            again inside the backward: less memory, about one more forward of work;
            the same results up to float32 rounding.
        trace: a path: record every rank's timeline (forwards, backwards, receive
            waits, allreduce, optimizer) and write it there as a Chrome trace
            (draw it with ``python -m hyparflow.trace PATH -o PNG``).
        keep_nested: keep models used as layers whole instead of splitting through
            their layers.
        timeout: seconds any one wait for a message, allreduce or broadcast may
            last before the watchdog reports what it waited for and ends the job
            (default 600; the first step of a new configuration, which traces
            and compiles, gets 3×; None: no watchdog).

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
    world, guard, checked = _start("fit", model, x, y, partitions, replicas, microbatches,
                                   batch_size, epochs, verbose, schedule, recompute, keep_nested,
                                   timeout, {"balance": repr(balance), "shuffle": bool(shuffle)})
    P, R, m, batch_size, x_arrays, y_arrays = checked
    world_size = world.Get_size() if world is not None else 1
    if seed is None:
        seed = int(np.random.default_rng().integers(2**31))
        if world is not None and world_size > 1:
            seed = world.bcast(seed, root=0)

    try:
        return _train(model, x_arrays, y_arrays, P, R, m, batch_size, epochs, verbose, shuffle,
                      callbacks, balance, seed, schedule, recompute, trace, keep_nested, world)
    except BaseException as exc:  # one rank failing must end the job, not hang the others
        guard.fail(exc)
        raise


def _train(model, x_arrays, y_arrays, P, R, m, batch_size, epochs, verbose, shuffle, callbacks,
           balance, seed, schedule, recompute, trace, keep_nested, world):
    """The training loop of `fit`, after validation."""
    world_size = world.Get_size() if world is not None else 1
    trainer = _trainer(model, P, R, m, batch_size, balance, keep_nested, world, x_arrays,
                       y_arrays)
    top, executor = trainer.topology, trainer.executor
    _build_loss(trainer, x_arrays, y_arrays)
    executor.schedule = schedule_.by_name(schedule)
    executor.worker.recompute = recompute
    if trace is not None:
        executor.recorder = trace_.Recorder()
        if world is not None and world_size > 1:
            world.Barrier()  # a common time zero for every rank's timeline
        executor.recorder.restart()
    stage = trainer.partition.stages[top.stage]
    data_positions = stage.data_positions
    _sync_stage_weights(trainer)

    n = len(x_arrays[0])
    steps = -(-n // batch_size)
    cbs = callback_list(model, callbacks, verbose, epochs, steps, top.rank == top.logging_rank)
    model.stop_training = False
    cbs.on_train_begin()
    logs = {}
    for epoch in range(epochs):
        trainer.logs.reset()
        cbs.on_epoch_begin(epoch)
        order = data_.epoch_order(n, shuffle, seed, epoch)
        for step, batch in enumerate(data_.batches(order, batch_size)):
            cbs.on_train_batch_begin(step)
            micro = data_.shard(batch, R, m, top.replica)
            xs = [[x_arrays[p][idx] for p in data_positions] for idx in micro]
            ys = [[a[idx] for a in y_arrays] if top.is_last_stage else None for idx in micro]
            contribution = executor.train_step([len(i) for i in micro], xs, ys, len(batch))
            logs = trainer.logs.step(contribution, len(batch))
            cbs.on_train_batch_end(step, logs)
            if model.stop_training:
                break
        cbs.on_epoch_end(epoch, dict(logs))
        if model.stop_training:
            break
    _gather_weights(trainer)
    if trace is not None:
        _write_trace(trace, executor, world, P, R, m, schedule)
    cbs.on_train_end(dict(logs))
    return model.history


def _inference(mode, model, x, y, partitions, replicas, microbatches, batch_size, verbose,
               callbacks, balance, keep_nested, timeout):
    """The shared loop of `evaluate` and `predict`: forwards only, samples in order."""
    world, guard, checked = _start(mode, model, x, y, partitions, replicas, microbatches,
                                   batch_size, 1, verbose, "1f1b", False, keep_nested, timeout,
                                   {"balance": repr(balance)})
    P, R, m, batch_size, x_arrays, y_arrays = checked
    try:
        trainer = _trainer(model, P, R, m, batch_size, balance, keep_nested, world, x_arrays)
        top, executor = trainer.topology, trainer.executor
        _build_loss(trainer, x_arrays, y_arrays)
        positions = trainer.partition.stages[top.stage].data_positions
        _sync_stage_weights(trainer)
        n = len(x_arrays[0])
        steps = -(-n // batch_size)
        cbs = callback_list(model, callbacks, verbose, 1, steps, top.rank == top.logging_rank)
        begin, batch_begin, batch_end, end = (
            (cbs.on_test_begin, cbs.on_test_batch_begin, cbs.on_test_batch_end, cbs.on_test_end)
            if mode == "evaluate" else
            (cbs.on_predict_begin, cbs.on_predict_batch_begin, cbs.on_predict_batch_end,
             cbs.on_predict_end))
        if mode == "evaluate":
            trainer.logs.reset()
        logs, kept = {}, []
        begin()
        for step, batch in enumerate(data_.batches(np.arange(n), batch_size)):
            batch_begin(step)
            micro = data_.shard(batch, R, m, top.replica)
            xs = [[x_arrays[p][idx] for p in positions] for idx in micro]
            ys = [[a[idx] for a in y_arrays] for idx in micro] if y_arrays else None
            contribution, outputs = executor.infer_step(
                [len(i) for i in micro], xs, ys, len(batch), keep_outputs=mode == "predict")
            if mode == "evaluate":
                logs = trainer.logs.step(contribution, len(batch))
            kept += [(idx, outs) for idx, outs in zip(micro, outputs)]
            batch_end(step, dict(logs))
        end(dict(logs) if mode == "evaluate" else None)
        if mode == "evaluate":
            return logs
        return _assemble(trainer, kept, n, world)
    except BaseException as exc:  # one rank failing must end the job, not hang the others
        guard.fail(exc)
        raise


def _assemble(trainer, kept, n, world):
    """Every rank gets every prediction, in sample order, in the model's output structure."""
    pieces = kept if world is None or world.Get_size() == 1 else [
        p for rank_pieces in world.allgather(kept) for p in rank_pieces]
    if trainer.partition.graph is not None:
        outputs = trainer.partition.graph.functional.outputs
        specs = [(tuple(t.shape[1:]), np.dtype(t.dtype)) for t in outputs]
    else:
        specs = [(a.shape[1:], a.dtype) for a in pieces[0][1]]
    arrays = [np.empty((n,) + tuple(shape), dtype) for shape, dtype in specs]
    for idx, outs in pieces:
        for a, o in zip(arrays, outs):
            a[idx] = o
    if trainer.partition.graph is None:
        return arrays[0] if len(arrays) == 1 else arrays
    from keras.src import tree

    struct = trainer.partition.graph.functional._outputs_struct
    return tree.pack_sequence_as(struct, arrays)


def evaluate(model, x=None, y=None, *, partitions=1, replicas=1, microbatches=None,
             batch_size=32, verbose="auto", callbacks=None, return_dict=False,
             balance="params", keep_nested=False, timeout=guard_.DEFAULT_TIMEOUT):
    """Evaluate `model` like `model.evaluate`, pipelined over `partitions` × `replicas` ranks.

    Forwards only (inference mode: dropout off, BatchNormalization's moving
    statistics), the samples in order, each replica taking its share of every
    batch. Reuses the stages a previous `hf.fit` built for the same model and
    configuration. Arguments as for `fit`.

    Returns:
        What `Model.evaluate` returns, on every rank: the loss, or a list of the
        loss and the metrics in `model.metrics_names` order, or a dict with
        `return_dict=True`.
    """
    logs = _inference("evaluate", model, x, y, partitions, replicas, microbatches, batch_size,
                      verbose, callbacks, balance, keep_nested, timeout)
    return dict(logs) if return_dict else model._flatten_metrics_in_order(logs)


def predict(model, x=None, *, partitions=1, replicas=1, microbatches=None, batch_size=32,
            verbose="auto", callbacks=None, balance="params", keep_nested=False,
            timeout=guard_.DEFAULT_TIMEOUT):
    """Predict like `model.predict`, pipelined over `partitions` × `replicas` ranks.

    The model need not be compiled. Arguments as for `fit`.

    Returns:
        What `Model.predict` returns — an array per output, in the model's output
        structure, one row per sample in order — on every rank.
    """
    return _inference("predict", model, x, None, partitions, replicas, microbatches, batch_size,
                      verbose, callbacks, balance, keep_nested, timeout)
