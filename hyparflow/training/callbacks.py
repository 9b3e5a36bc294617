"""Keras callbacks on every rank, logs combined over replicas, the progress bar on one rank."""

import contextlib
import os

import numpy as np
from keras import callbacks as callbacks_module

from hyparflow.keras import keras_private, user_loss
from hyparflow.keras import variables as variables_
from hyparflow.mpi import comm as comm_

# Callbacks that only write files: they run on the logging rank alone.
_WRITERS = (callbacks_module.CSVLogger, callbacks_module.TensorBoard)
# Callbacks that save the model: they run on every rank (a save is collective), and
# the logging rank writes.
_SAVERS = (callbacks_module.ModelCheckpoint, callbacks_module.BackupAndRestore)
# Keras' callbacks whose training-batch hooks read no weights (or, saving, gather them).
_BATCH_SAFE = (callbacks_module.Callback, callbacks_module.ProgbarLogger,
               callbacks_module.History, callbacks_module.TerminateOnNaN) + _WRITERS + _SAVERS
_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")


class Trace(callbacks_module.Callback):
    """Record every rank's timeline of `hf.fit`'s training steps (forwards, backwards,
    receive waits, allreduces, optimizer; not validation) and write it to `path` at the end
    as one Chrome trace: ``hf.fit(..., callbacks=[hf.Trace("run.json")])``; draw it with
    ``python -m hyparflow.trace run.json -o run.png``."""

    def __init__(self, path):
        super().__init__()
        self.path = os.fspath(path)
        self.recording = False  # hf.fit records while it trains

    def on_train_begin(self, logs=None):
        if not self.recording:
            raise ValueError(
                "hf.Trace records hf.fit's steps; under model.fit use "
                "keras.callbacks.TensorBoard(profile_batch=...) for a timeline.")


def tracer(callbacks):
    """The call's `Trace` callback, or None; more than one refused."""
    found = [cb for cb in _listed(callbacks) if isinstance(cb, Trace)]
    if len(found) > 1:
        raise ValueError(
            f"callbacks: {len(found)} hf.Trace callbacks "
            f"({', '.join(repr(cb.path) for cb in found)}); a run records one timeline: "
            "keep one.")
    return found[0] if found else None


@contextlib.contextmanager
def recording(trace):
    """`trace` (a `Trace`, or None) records inside."""
    if trace is None:
        yield
        return
    trace.recording = True
    try:
        yield
    finally:
        trace.recording = False


def _listed(callbacks):
    if isinstance(callbacks, callbacks_module.CallbackList):
        return callbacks.callbacks
    return callbacks or []


def batch_readers(callbacks):
    """The callbacks whose training-batch hooks may read the model: every one whose hook is
    the user's code (a method of their class, or one given to a LambdaCallback), not one of
    Keras' own that reads no weights, unless it says its hooks read none
    (``batch_hooks_read_weights = False``, on its class or the instance).

    A rank holds only its stage's weights current during an epoch; these callbacks
    need every stage's before each `on_train_batch_end` (`loop.train` gathers them).
    """
    readers = []
    for cb in _listed(callbacks):
        if getattr(cb, "batch_hooks_read_weights", True) is False:
            continue
        for hook in _BATCH_HOOKS:
            if hook in vars(cb):  # given to this instance (LambdaCallback)
                readers.append(cb)
                break
            owner = next(k for k in type(cb).__mro__ if hook in vars(k))
            if owner not in _BATCH_SAFE:
                readers.append(cb)
                break
    return readers


def callback_list(model, callbacks, verbose, epochs, steps, is_logging_rank, guard, trainer=None,
                  world=None):
    """A Keras CallbackList for one rank of the job.

    History runs on every rank and the progress bar on the logging rank, as do
    callbacks that only write files (CSVLogger, TensorBoard). Every other
    callback runs on every rank with the same logs, so that their decisions
    (stop_training, learning-rate changes, restoring weights) agree. Model
    checkpoints (ModelCheckpoint, BackupAndRestore) save through a collective
    that gathers every stage's weights and optimizer state; the logging rank
    writes the file, atomically. A hook that raises on every rank at the same
    step raises there on every rank, the job healthy (`guard.Guard.agree_raise`).
    """
    if verbose == "auto":
        verbose = 1
    if isinstance(callbacks, callbacks_module.CallbackList):
        callbacks = callbacks.callbacks
    # (a save is collective where each rank holds part of the model: see `_EmbeddingSaves`)
    collective = trainer is not None and (trainer.topology.partitions > 1 or getattr(
        trainer.executor, "shard", None) is not None)
    kept = []
    for cb in callbacks or []:
        if is_logging_rank or not isinstance(cb, _WRITERS):
            kept.append(cb)
        elif collective and _EmbeddingSaves.needed(cb):
            kept.append(_EmbeddingSaves(cb))
    result = callbacks_module.CallbackList(
        kept, add_history=True, add_progbar=bool(verbose) and is_logging_rank,
        model=model, verbose=verbose if is_logging_rank else 0, epochs=epochs, steps=steps)
    if trainer is not None:
        from hyparflow.training.checkpoint import SavingModel

        proxy = SavingModel(model, trainer, world)
        for cb in result.callbacks:
            if isinstance(cb, _SAVERS):
                cb.set_model(proxy)
                if not is_logging_rank:
                    _follow(cb, proxy)
                else:  # (one an earlier call, where this rank did not write, made to follow)
                    _lead(cb)
    return Agreeing(result, guard)


@contextlib.contextmanager
def quiet(silent):
    """While `silent` (a rank other than the logging rank): what callbacks print through Keras
    (TerminateOnNaN's notice, EarlyStopping's and ReduceLROnPlateau's words), which every rank
    would print alike, goes to Keras' non-interactive log instead of the screen."""
    import keras

    before = keras.config.is_interactive_logging_enabled()
    if silent:
        keras.config.disable_interactive_logging()
    try:
        yield
    finally:
        if silent and before:
            keras.config.enable_interactive_logging()


class Agreeing:
    """A CallbackList whose hooks, when they raise, first find out whether every rank raised
    at the same hook and step (then the exception reaches the caller, the job healthy)."""

    def __init__(self, callbacks, guard):
        self.callbacks, self.guard = callbacks, guard

    def __getattr__(self, name):
        hook = getattr(self.callbacks, name)
        if not name.startswith("on_"):
            return hook

        def agreeing(*args, **kwargs):
            try:
                return hook(*args, **kwargs)
            except Exception as exc:
                self.guard.agree_raise(exc, (name,) + tuple(
                    a for a in args if isinstance(a, int)))
                raise
        return agreeing


class _EmbeddingSaves(callbacks_module.Callback):
    """On a rank that does not write: TensorBoard's saves of the model's weights
    (`embeddings_freq`), at the epochs it makes them, so that each is the collective save
    it is during hf.fit (the writing rank writes the file)."""

    @staticmethod
    def needed(cb):
        """Whether the writer `cb` saves the model's weights (TensorBoard's embeddings)."""
        return isinstance(cb, callbacks_module.TensorBoard) and bool(cb.embeddings_freq)

    def __init__(self, cb):
        super().__init__()
        self.tensorboard = cb

    def on_epoch_end(self, epoch, logs=None):
        freq = self.tensorboard.embeddings_freq
        if epoch % freq == 0:  # as TensorBoard.on_epoch_end; the path is the writer's
            self.model.save_weights(os.path.join(
                self.tensorboard.log_dir, "train", f"keras_embedding.ckpt-{epoch}.weights.h5"))


def _lead(cb):
    """On the rank that writes: the callback's own saves (undoing an earlier `_follow`)."""
    followed = cb.__dict__.pop("_hyparflow_followed", None)
    if followed is None:
        return
    keras_private.undo_redirected_saves(cb)
    cb.__dict__.pop("on_train_end", None)
    if "verbose" in followed:
        cb.verbose = followed["verbose"]


def _follow(cb, proxy):
    """On a rank that does not write: take part in the callback's saves, touch no file."""
    followed = cb.__dict__.setdefault("_hyparflow_followed", {})  # (what `_lead` gives back)
    if isinstance(cb, callbacks_module.ModelCheckpoint):
        followed.setdefault("verbose", cb.verbose)
        cb.verbose = 0

        keras_private.redirect_checkpoint_saves(cb, lambda path, weights_only: (
            proxy.save_weights if weights_only else proxy.save)(path, overwrite=True))
    else:  # BackupAndRestore: every rank reads the backup; the logging rank writes and removes it
        keras_private.redirect_backup_saves(
            cb, lambda path: proxy.save_weights(path, overwrite=True))
        cb.on_train_end = lambda logs=None: None


class StepLogs:
    """Combines the loss and metrics of all ranks into the logs `Model.fit` would show.

    The loss of a step is the sum of every rank's contribution (data loss on last
    stages, regularisation anywhere). A metric lives on the stage that updates it: a
    metric a layer keeps (updated in its call()) on that layer's stage, every other one
    (compiled metrics, the model's own) on the last stage. Their state variables (totals
    and counts) are summed over the ranks that update them, which reproduces the metric
    of the whole global batch exactly for Keras' built-in metrics. One allreduce and one
    broadcast per step give every rank the same logs.
    """

    def __init__(self, model, topology, world, is_last, guard, executor=None):
        """`executor`: this rank's `Executor`, which tells the keys the model's own
        compute_metrics gave the step's logs (`metric_keys`, agreed on every rank; None: the
        loss and every metric)."""
        self.model = model
        self.executor = executor
        self.guard = guard
        self.topology = topology
        self.world = world
        self.is_last = is_last
        self.tracker = keras_private.loss_tracker(model)
        self.metrics = self.state = self.names = None

    def _prepare(self):
        """Find the metric state and agree on the logs' layout (collective; once).

        Deferred to the first `reset`, when the last stage has built its compiled
        loss and metrics, so that `predict` never needs them.
        """
        self.metrics = [m for m in self.model.metrics if m is not self.tracker]
        # Keras logs the loss through its tracker only when model.metrics lists it (a model
        # may override the metrics property and leave it out)
        self.logs_loss = self.tracker is not None and any(
            m is self.tracker for m in self.model.metrics)
        self.state = [v for m in self.metrics for v in m.variables]
        here = self._updated_here()
        self.mine = [here(m) for m in self.metrics for _ in m.variables]
        layout = None
        if self.topology.rank == self.topology.logging_rank:
            layout = (sum(int(np.prod(v.shape)) for v in self.state),
                      [(k, np.shape(r)) for k, r in self._results().items()])
        if self.world is not None and self.world.Get_size() > 1:
            layout = comm_.broadcast_object(
                layout, self.topology.logging_rank, self.world,
                self.guard.bounded("the logs' layout from the logging rank"))
        self.state_size, self.names = layout

    def _updated_here(self):
        """Whether this rank's stage updates a metric: one a layer of this stage keeps, or,
        on the last stage, any metric no layer keeps."""
        top = self.topology
        if self.executor is None or top.partitions == 1:
            return lambda metric: self.is_last
        kept = {id(m): st.index for st in self.executor.partition.stages
                for layer in st.model.layers for m in layer.metrics}
        last = len(self.executor.partition.stages) - 1
        return lambda metric: kept.get(id(metric), last) in top.stages

    def reset(self):
        """Start an epoch (or an evaluation): zero the running loss and every metric."""
        if self.names is None:
            self._prepare()
        self.total = 0.0
        self.count = 0
        self.summed = None  # the metrics' state over every rank, as of the last step
        if self.tracker is not None:
            self.tracker.reset_state()
        for m in self.metrics:
            m.reset_state()

    def settle(self):
        """Every rank's loss tracker and metrics take the state the logs were made from (of
        the whole global batch, all steps so far): what model.fit's model holds after an
        epoch or an evaluation. Until then each rank holds its own share."""
        if self.names is None or not self.count:
            return
        if self.tracker is not None:
            self.tracker.total.assign(self.total)
            self.tracker.count.assign(self.count)
        if self.summed is not None:
            _assign(self.state, self.summed)

    def _results(self):
        """{name: value}: a float, or an array for a metric with one value per class
        (F1Score with average=None), as Model.fit's logs hold them."""
        out = {}
        for m in [self.tracker] + self.metrics if self.logs_loss else self.metrics:
            r = m.result()
            for k, v in (r.items() if isinstance(r, dict) else [(m.name, r)]):
                v = np.asarray(v, np.float64)
                out[k] = float(v) if v.ndim == 0 else v
        return out

    def step(self, contribution, batch_size):
        """Combine one step's contributions; returns the running logs of the epoch."""
        # [contribution, the metrics' state]
        vec = np.zeros(1 + self.state_size, np.float64)
        vec[0] = contribution
        if self.state:
            vec[1:] = np.concatenate([np.ravel(v.numpy()) if mine else np.zeros(
                int(np.prod(v.shape))) for v, mine in zip(self.state, self.mine)])
        multi = self.world is not None and self.world.Get_size() > 1
        if multi:
            comm_.allreduce(vec, self.world, "sum", self.guard.bounded(
                "the allreduce of the step's loss and metrics over all ranks"))
        self.total += float(vec[0]) * batch_size
        self.count += batch_size
        self.summed = vec[1:]
        values = np.zeros(sum(int(np.prod(shape)) for _, shape in self.names), np.float64)
        if self.topology.rank == self.topology.logging_rank:
            if self.tracker is not None:
                self.tracker.total.assign(self.total)
                self.tracker.count.assign(self.count)
            results = _results_with(self.state, vec[1:], self._results)
            values[:] = np.concatenate([np.ravel(results[k]) for k, _ in self.names]) \
                if self.names else []
        if multi:
            comm_.broadcast_array(values, self.topology.logging_rank, self.world,
                                  self.guard.bounded("the step's logs from the logging rank"))
        return self._returned(_unpack(values, self.names))

    def _returned(self, logs):
        """`logs` as the model's own compute_metrics names them (its keys)."""
        keys = None if self.executor is None else self.executor.metric_keys
        if keys is None:
            return logs
        unknown = [k for k in keys if k not in logs]
        if unknown:  # (found before the first step already: `user_loss.UserLoss.settle`)
            raise user_loss.not_metric_results(self.model, unknown, logs, self.topology.partitions)
        return {k: logs[k] for k in keys}


class ReturnedLogs:
    """Combines the logs a model's own step returns (`own_steps.OwnSteps`) over replicas.

    A returned value that is one of the model's metric results (as
    `model.get_metrics_result()` names and computes it) becomes that metric's
    result over every replica's state summed, as `StepLogs` combines compiled
    metrics (exact for Keras' totals-and-counts metrics, such as the loss
    tracker and the Means a GAN keeps). Any other value becomes the mean of the
    replicas' values weighted by their share of the batch: the whole batch's
    value, for a per-sample mean. The logging rank decides which is which, and
    one allreduce and one broadcast per step give every rank the same logs.
    """

    def __init__(self, model, topology, world, guard):
        self.model, self.topology, self.world, self.guard = model, topology, world, guard
        self.multi = world is not None and world.Get_size() > 1
        self.state = self.summed = None

    def reset(self):
        """Start an epoch (or an evaluation), as Model.fit's reset_metrics."""
        self.model.reset_metrics()
        self.summed = None  # the metrics' state over every replica, as of the last step

    def settle(self):
        """Every rank's metrics take their state over every replica (`StepLogs.settle`)."""
        if self.summed is not None:
            _assign(self.state, self.summed)

    def step(self, returned, batch_size):
        """Combine one step's returned logs (a `Returned`) into the logs Model.fit shows."""
        local = {k: np.asarray(v, np.float64)
                 for k, v in user_loss.flat_logs(returned.logs).items()}
        if not self.multi:
            return {k: _log_value(v) for k, v in local.items()}
        state = self.model.metrics_variables
        n = sum(int(np.prod(v.shape)) for v in state)
        vec = np.concatenate([np.ravel(v.numpy()).astype(np.float64) for v in state]
                             + [np.ravel(v) * returned.share for v in local.values()]
                             + [np.zeros(0)])
        comm_.allreduce(vec, self.world, "sum",
                        self.guard.bounded("the allreduce of the step's logs over all ranks"))
        self.state, self.summed = state, vec[:n]
        values = vec[n:]  # the returned values, share-weighted means
        if self.topology.rank == self.topology.logging_rank:
            before = self._results()
            summed = _results_with(state, vec[:n], self._results)
            offset = 0
            for k, v in local.items():
                if k in before and before[k].shape == v.shape and np.array_equal(before[k], v):
                    values[offset:offset + v.size] = np.ravel(summed[k])  # a metric's result
                offset += v.size
        comm_.broadcast_array(values, self.topology.logging_rank, self.world,
                              self.guard.bounded("the step's logs from the logging rank"))
        return _unpack(values, [(k, v.shape) for k, v in local.items()])

    def _results(self):
        return {k: np.asarray(r, np.float64) for k, r in self.model.get_metrics_result().items()}


def _results_with(state, flat, results):
    """`results()` computed with the metric variables `state` set to `flat` (their values
    summed over ranks, one flat array), the variables then put back."""
    local = [variables_.value(v) for v in state]
    _assign(state, flat)
    try:
        return results()
    finally:
        variables_.assign(state, local)


def _assign(state, flat):
    """Set the variables `state` to the values of one flat array, in order."""
    offset, values = 0, []
    for v in state:
        n = int(np.prod(v.shape))
        values.append(flat[offset:offset + n].reshape(v.shape))
        offset += n
    variables_.assign(state, values)  # (cast to each variable's dtype)


def _unpack(values, layout):
    """One flat array → {name: value} by the layout's (name, shape), as `_log_value`s."""
    logs, offset = {}, 0
    for k, shape in layout:
        n = int(np.prod(shape))
        logs[k] = _log_value(values[offset:offset + n].reshape(shape))
        offset += n
    return logs


def _log_value(v):
    """A float for a scalar, else a float32 array, as Model.fit's logs hold them."""
    v = np.asarray(v)
    return float(v) if v.ndim == 0 else v.astype(np.float32)
