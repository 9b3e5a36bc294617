"""hf.fit, evaluate, predict and save: validate collectively,
build (or reuse) this rank's trainer, run the loop."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from hyparflow import agreement, arguments, auto, defaults
from hyparflow import trace as trace_
from hyparflow import trainer as trainer_
from hyparflow.engine import schedule as schedule_
from hyparflow.engine import shard as shard_
from hyparflow.keras import keras_private, replica_state, streams
from hyparflow.keras import optimizers as optimizers_
from hyparflow.mpi import comm as comm_
from hyparflow.mpi import guard as guard_
from hyparflow.partitioner.costs import DEFAULT as DEFAULT_BALANCE
from hyparflow.training import callbacks as callbacks_
from hyparflow.training import checkpoint, elastic, loop, preemption
from hyparflow.training.callbacks import callback_list, quiet

if TYPE_CHECKING:  # keras loads TensorFlow: imported where hyparflow runs, not for the hints
    import os
    from collections.abc import Collection, Mapping, Sequence

    import keras

    from hyparflow.arguments import Schedule
    from hyparflow.partitioner.split import Partition


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
        balance: str | Sequence[int] | Sequence[str] | Partition | None = None,
        schedule: Literal["1f1b", "gpipe", "interleaved", "zb-h1", "auto"] | Schedule | None = None,
        recompute: bool = False, shard_optimizer: bool = False,
        timeout: float | None = guard_.DEFAULT_TIMEOUT) -> keras.callbacks.History:
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
            one standard file, written by one rank, atomically. Before each
            training-batch hook of your own (a class's ``on_train_batch_end``, a
            LambdaCallback's) every rank gets every stage's current weights (at P > 1,
            one broadcast of the model per step), so the hook sees what it would under
            `model.fit`; a callback whose batch hooks read no weights (timing steps,
            counting, logging `logs`) says so with ``batch_hooks_read_weights = False``
            (an attribute of its class or of the instance) and costs nothing. Keras' own
            callbacks never need it. ``hf.Trace(path)`` records every rank's timeline.
        validation_split: the last fraction of `x`/`y` held out for validation,
            as in `Model.fit`.
        validation_data: `(x_val, y_val)` or `(x_val, y_val, sample_weight_val)`,
            evaluated (pipelined) after each epoch; logs get `val_` names.
        shuffle: shuffle the samples each epoch (the same order on every rank), from
            the seed given to `keras.utils.set_random_seed` if the script called it (so
            that a resumed run shuffles as the uninterrupted one), else from rank 0's draw.
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
            or replicas is "auto", or when the defaults choose the step graph, below),
            "params", "layers",
            "time" (measured on rank 0, shared), "memory", or an explicit split;
            see `hyparflow.partition`. Or a `Partition` that `hf.partition` made of this
            model (``hf.partition(model, P, keep_nested=True)`` keeps models used as layers
            whole, where hyparflow otherwise cuts through them wherever it can).
        schedule: None (default): hyparflow's choice for the job. A call over arrays
            that plans at least `hyparflow.defaults.LONG_JOB_STEPS` (300) steps at
            partitions > 1 runs "interleaved" (1F1B for a model with a layer called at
            several places) in the step graph, cut by "time" — its fastest on a CPU,
            whose first step, ~35 s longer on a ResNet-110, the faster steps repay after
            230–280 (120–250 on keras-hub's GPT-2 and BERT), where its memory is predicted
            to fit what a rank may use; any other call "1f1b" on the executor, cut by
            "flops". A schedule, step graph or balance given is kept,
            the others still chosen so. Rank 0 prints the choice and why (unless
            verbose=0). Or a schedule by name: "1f1b" (keeps at most P − s
            micro-batches' activations on stage s), "gpipe" (all forwards, then all
            backwards) or "interleaved" (Megatron-LM's interleaved 1F1B: the model is
            cut into 2 × partitions stages, rank p holding stages p, p + P, …; the
            pipeline's idle time shrinks by half, for twice the messages), or "zb-h1"
            (in the step graph: 1F1B with each backward split in two, the partial errors
            sent first and the weight gradients computed while the stage would wait; the
            step graph's memory).
            Same results. "auto": the planner's fastest of those it ranks by default
            (1F1B and GPipe; interleaved too with the step graph), as partitions="auto"
            measures it. ``hf.Schedule(name, chunks=..., step_graph=...)`` pins the
            stages a rank holds under "interleaved" and whether each rank's whole step
            is one compiled graph (see `hyparflow.Schedule`).
        recompute: keep only each stage's inputs per micro-batch and run the forward
            again inside the backward: less memory, about one more forward of work;
            the same results up to float32 rounding.
        shard_optimizer: split the optimizer's state (Adam's moments, momentum) over
            the replicas, as ZeRO stage 1: each replica updates its share of every
            stage's variables and keeps only their slots (about 1/replicas of them),
            gradients are reduce-scattered to the owner and the new weights
            all-gathered (the bytes of one allreduce). The same weights; after
            hf.fit, `model.optimizer` holds the whole state again on every rank.
            Not for a model with its own train_step or compute_loss at partitions=1.
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
    # (an elastic job: its backup, and fewer replicas on the ranks a loss left)
    args = elastic.fitted(arguments.Call(**locals()), comm_.launched_size())
    args = defaults.resolve(model, auto.resolve(model, args))
    world, guard, plan = agreement.start("fit", model, args)
    args = args.replace(step_graph=arguments.step_graph_of(args))
    seed = _shuffling_seed(world, guard)
    before = None  # an elastic job that lost ranks: the History of the epochs before
    while True:
        try:
            return elastic.joined(before, _fit(model, plan, args, seed, world))
        except BaseException as exc:  # one rank failing must end the job, not hang the others
            if guard_.lost_ranks(exc):  # a process of the job failed (ULFM)
                trainer = model.__dict__.get("_hyparflow_fit")
                if elastic.refusal(trainer) is not None:
                    guard.fail(elastic.ended(exc, trainer, world))
                before = elastic.joined(before, model.history)
                try:
                    went = elastic.go_on(model, trainer, args.callbacks)
                except elastic.NotInPlace as why:  # (the survivors' word: restart)
                    guard.fail(elastic.ended(why, trainer, world, str(why)))
                except BaseException as again:  # (another loss, or a backup not written)
                    guard.fail(elastic.ended(again, trainer, world, (
                        f"going on in place failed: {type(again).__name__}: "
                        f"{guard_.cause(again)}")))
                world = went.world
                args = args.replace(replicas=world.Get_size() // args.partitions)
                if world.Get_rank() == 0:
                    print(elastic.went_on_line(went, trainer.topology, plan.epochs),
                          file=sys.stderr, flush=True)
                world, guard, plan = agreement.start("fit", model, args)
                continue
            if not guard.agreed(exc):  # (raised alike on every rank: the job is healthy)
                guard.fail(exc)
            raise


def _shuffling_seed(world, guard):
    """The shuffling seed: keras.utils.set_random_seed's seed if the script set one (so a
    restarted script shuffles alike), else a fresh draw; rank 0's either way."""
    seed = keras_private.random_seed()
    if seed is None:
        seed = int(np.random.default_rng().integers(2**31))
    if world is not None and world.Get_size() > 1:
        seed = comm_.broadcast_object(seed, 0, world, guard.bounded("rank 0's shuffling seed"))
    return seed


def _fit(model, plan, a, seed, world):
    """The training of `fit`, after validation."""
    earlier = model.__dict__.get("_hyparflow_fit")
    if earlier is not None:  # (not this call's: nothing for an elastic job to resume from)
        earlier.position = earlier.resumable = None
    trainer = trainer_.make(model, plan, a.balance, a.keep_nested, world, a.verbose, a.schedule,
                       a.shard_optimizer, a.step_graph)
    top = trainer.topology
    if model.__dict__.get("_hyparflow_fit") is not trainer and a.verbose != 0 and \
            world is not None and world.Get_size() > 1 and top.rank == 0:  # a new choice
        print(trainer_.choice_line(trainer, plan, a), flush=True)
    trainer.position = trainer.resumable = None  # (not training yet: `loop.train` sets them)
    # whose optimizer state hf.save gathers, and whose P × R evaluate/predict("auto") reuse
    model.__dict__["_hyparflow_fit"] = trainer
    arguments.remember_trainable(model)
    elastic.record(trainer, a.callbacks)  # (for the launcher)
    executor = trainer.executor
    executor.configure(schedule_.by_name(a.schedule), a.recompute, a.step_graph, plan.m)
    tracer = callbacks_.tracer(a.callbacks)
    if tracer is not None:
        executor.recorder = trace_.Recorder()
        # a common time zero for every rank's timeline
        comm_.barrier(world, trainer.guard.bounded("every rank to start its timeline"))
        executor.recorder.restart()
    checkpoint.start_from_rank0(trainer, train=True)
    feed = trainer_.feed(trainer, plan.source, plan.batch_size, plan.m, a.steps_per_epoch,
                 a.shuffle, seed, train=True)
    validation = None
    if plan.val is not None:
        validation = trainer_.feed(trainer, plan.val, plan.val_batch_size, plan.val_m,
                           a.validation_steps)
    cbs = callback_list(model, a.callbacks, a.verbose, plan.epochs,
                        feed.steps or feed.num_batches,
                        top.rank == top.logging_rank, trainer.guard, trainer, world)
    # (of every callback the ranks were given and agreed on: the file writers run on one)
    readers = callbacks_.batch_readers(a.callbacks)
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
            trainer_.check_norms_called_once(model, trainer)
        with quiet(top.rank != top.logging_rank), \
                checkpoint.saves_in_training(model, trainer, world), \
                executor.norms.training(deferred), \
                streams.apart(model, top.replica), \
                preemption.Watch(world, trainer.guard, elastic.Clock(top.rank == 0)) as watch:
            with callbacks_.recording(tracer):
                logs = loop.train(trainer, feed, plan.epochs, a.initial_epoch, cbs,
                                  validation, a.validation_freq, watch,
                                  gather_each_batch=bool(readers),
                                  merge_each_batch=elastic.merges_each_step(trainer))
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
    if tracer is not None:
        trainer_.write_trace(tracer.path, executor, world, top.partitions, top.replicas,
                     trainer_.planned_m(plan), a.schedule)
    with checkpoint.saves_in_training(model, trainer, world, whole=True):  # all whole again
        cbs.on_train_end(logs)
    # what the logging rank wrote is complete
    comm_.barrier(world, trainer.guard.bounded(
        "every rank to end hf.fit (the logging rank closing its files)"))
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
          "step; if they read none, say so with the callback's attribute "
          "batch_hooks_read_weights = False).", flush=True)


def _inference(mode, model, a):
    """The shared setup of `evaluate` and `predict`: forwards only, samples in order."""
    a = elastic.resized(a, comm_.launched_size())
    fitted = model.__dict__.get("_hyparflow_fit")
    if "auto" in (a.partitions, a.replicas):
        if fitted is None:
            raise ValueError(
                f"hf.{mode}(partitions={a.partitions!r}, replicas={a.replicas!r}) reuses "
                "what hf.fit(..., 'auto') chose for this model, and it has not been trained "
                "with hf.fit yet: pass whole numbers, or call hf.fit first.")
        top = fitted.topology
        a = a.replace(partitions=top.partitions, replicas=top.replicas)
    same = fitted is not None and (a.partitions, a.replicas) == (fitted.topology.partitions,
                                                                 fitted.topology.replicas)
    if same:  # the stages fit's ranks hold: its trainer serves (unless another cut is asked)
        a = a.replace(chunks=fitted.topology.chunks)
    if a.balance is None and same:  # fit's cut, its nested models kept whole as it kept them
        graph = fitted.partition.graph
        a = a.replace(balance=fitted.balance, keep_nested=bool(graph and graph.keep_nested))
    elif a.balance is None:
        a = a.replace(balance=DEFAULT_BALANCE)
    world, guard, plan = agreement.start(mode, model, a)
    try:
        trainer = trainer_.make(model, plan, a.balance, a.keep_nested, world, a.verbose)
        top = trainer.topology
        checkpoint.start_from_rank0(trainer)
        feed = trainer_.feed(trainer, plan.source, plan.batch_size, plan.m, a.steps)
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
        if guard_.lost_ranks(exc):  # (the launcher runs an elastic job again)
            guard.fail(elastic.ended(exc, None, world, f"it came in hf.{mode}"))
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
             balance: str | Sequence[int] | Sequence[str] | Partition | None = None,
             timeout: float | None = guard_.DEFAULT_TIMEOUT,
             ) -> float | list[float] | dict[str, float]:
    """Evaluate `model` like `model.evaluate`, pipelined over `partitions` × `replicas` ranks.

    Forwards only (inference mode: dropout off, BatchNormalization's moving
    statistics), the samples in order, each replica taking its share of every
    batch. Reuses the stages a previous `hf.fit` built for the same model and
    configuration. `sample_weight` and `steps` as in `Model.evaluate`; the
    other arguments as for `fit`, except that "auto" for partitions or replicas
    means the P × R (and balance) that `hf.fit` last chose for this model, and
    `balance=None` (default) the cut `hf.fit` made at this P × R ("flops" without one).

    Returns:
        What `Model.evaluate` returns, on every rank: the loss, or a list of the
        loss and the metrics in `model.metrics_names` order, or a dict with
        `return_dict=True`.
    """
    logs = _inference("evaluate", model, arguments.Call(**locals()))
    return dict(logs) if return_dict else keras_private.metrics_in_order(model, logs)


def predict(model: keras.Model, x: Any = None, *, partitions: int | Literal["auto"] = 1,
            replicas: int | Literal["auto"] = 1, microbatches: int | None = None,
            batch_size: int | None = 32, verbose: Literal["auto", 0, 1, 2] = "auto",
            steps: int | None = None,
            callbacks: Sequence[keras.callbacks.Callback] | None = None,
            balance: str | Sequence[int] | Sequence[str] | Partition | None = None,
            timeout: float | None = guard_.DEFAULT_TIMEOUT) -> Any:
    """Predict like `model.predict`, pipelined over `partitions` × `replicas` ranks.

    The model need not be compiled. Arguments as for `evaluate` (`balance=None`: the cut
    `hf.fit` made at this P × R); `steps` as in `Model.predict`.

    Returns:
        What `Model.predict` returns — an array per output, in the model's output
        structure, one row per sample in order — on every rank.
    """
    return _inference("predict", model, arguments.Call(**locals()))


def save(model: keras.Model, filepath: str | os.PathLike[str], *, overwrite: bool = True) -> None:
    """Save `model` to one standard Keras file, from the ranks that trained it.

    arguments.Call it on every rank, like `hf.fit`. The file holds every stage's weights
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
    if trainer is not None and comm_.gone(trainer.world):  # (an elastic job lost ranks since)
        trainer = None
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
        if guard_.lost_ranks(exc):  # (the launcher runs an elastic job again)
            guard.fail(elastic.ended(exc, None, world, "it came in hf.save"))
        if not guard.agreed(exc):  # a rank that never came, or a failure elsewhere
            guard.fail(exc)
        raise  # raised alike on every rank (bad input, a write that failed): the job is healthy
