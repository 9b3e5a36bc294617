"""Gather every stage's weights and optimizer state into the user's model;
save one standard Keras file atomically."""

import contextlib
import errno
import hashlib
import os
import socket

import numpy as np

from hyparflow.engine.stage import to_tensor
from hyparflow.keras import optimizers as optimizers_
from hyparflow.keras import replica_state
from hyparflow.keras import variables as variables_
from hyparflow.mpi import comm as comm_


def start_from_rank0(trainer, train=False):
    """Every rank starts from rank 0's model: all its weights, and (`train`) its optimizer state.

    Ranks that built the model with different seeds, or trained it differently
    before, then train exactly what `model.fit` on rank 0's model trains. The
    structure of the model was agreed before (the call's fingerprint), so every
    rank's weights line up. With `train`, this rank's stage optimizer then takes
    its slots, step count and scalars from the user's optimizer.
    """
    model, world = trainer.model, trainer.world
    user = trainer.user_optimizer if train else None
    built = user is not None and user.built
    if world is not None and world.Get_size() > 1:
        wait = trainer.guard.bounded("rank 0's weights and optimizer state")
        held = list(model.weights) + (list(user.variables) if built else [])
        digests = comm_.allgather_objects((built, digest(held)), world, wait)
        if all(d == digests[0] for d in digests):  # (what the previous call left on every rank)
            if built:
                optimizers_.take_state(trainer.executor.optimizer, user)
            return
        _from_root(model.weights, world, wait)
        if user is not None:
            built = comm_.broadcast_object(built, 0, world, wait)
            if built and not user.built:
                user.build(model.trainable_variables)
            if built:
                _from_root(user.variables, world, wait)
    if built:
        optimizers_.take_state(trainer.executor.optimizer, user)


def digest(variables):
    """A BLAKE2 digest of the variables' bytes, in order: equal on two ranks when their
    values are, bit for bit (and only then, but for a 2⁻¹²⁸ chance)."""
    h = hashlib.blake2b(digest_size=16)
    for v in variables:
        value = np.ascontiguousarray(variables_.value(v))
        h.update(f"{value.dtype}{value.shape}".encode())
        h.update(value.reshape(-1).view(np.uint8))
    return h.hexdigest()


def _from_root(variables, comm, wait, root=0):
    """Set `variables` to rank `root`'s values, a message of at most comm.CHUNK bytes at a
    time (so that no rank holds a second copy of them all)."""
    variables = list(variables)
    done = 0
    lazily = (variables_.value(v) for v in variables)  # each read as the broadcast takes it
    for values in comm_.broadcast_chunks(lazily, root, comm, wait=wait):
        if comm.Get_rank() != root:  # over the received buffer, no copy when aligned
            variables_.assign(variables[done:done + len(values)], map(to_tensor, values))
        done += len(values)


def gather_weights(trainer):
    """Every rank's model gets every stage's current weights.

    Trainable weights are equal on all replicas (same summed gradients); the
    non-trainable state each replica updated on its own samples (e.g.
    BatchNormalization's moving statistics, a layer's counters) is made one value
    over the replicas first, as each variable's `aggregation` asks (`replica_state`).
    """
    _gather(trainer, lambda model: model.weights, "weights")


def gather_state(trainer):
    """Every rank's model gets every stage's non-trainable state, made one over the replicas
    first: after forwards alone (validation, hf.evaluate, hf.predict), which may update
    state a layer's call() keeps but no weight."""
    _gather(trainer, replica_state.of, "non-trainable state")


def merge_replicas(trainer):
    """The non-trainable state each replica updated on its own samples made one value over
    the replicas (`replica_state.merge`), on this rank's stages only."""
    replica_state.merge(replica_state.held(trainer.partition, trainer.topology), trainer.added,
                        trainer.executor.replicas, trainer.guard.bounded)


def _gather(trainer, variables, what):
    merge_replicas(trainer)
    pipeline = trainer.executor.pipeline
    if pipeline is None or pipeline.Get_size() == 1:
        return
    for other in trainer.partition.stages:  # from the rank holding it
        _from_root(variables(other.model), pipeline,
                   trainer.guard.bounded(f"the {what} of stage {other.index}"),
                   root=other.index % pipeline.Get_size())


_HOST = "".join(c if c.isalnum() else "_" for c in socket.gethostname()) or "host"


def temporary_name(filepath, pid=None):
    """A name beside `filepath` that keeps its suffix (Keras dispatches on it): this process's,
    or process `pid`'s on this host (ranks of other hosts may write beside it at once, on a
    shared file system)."""
    head, tail = os.path.split(os.path.abspath(filepath))
    return os.path.join(head, f".tmp-{_HOST}-{os.getpid() if pid is None else pid}-{tail}")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def _remove_stale(filepath):
    """Remove the temporaries of `filepath` that writers killed mid-save left behind."""
    head, tail = os.path.split(os.path.abspath(filepath))
    for name in os.listdir(head):
        pid = name[len(f".tmp-{_HOST}-"):-len(tail) - 1]
        path = os.path.join(head, name)
        if pid.isdigit() and path == temporary_name(filepath, int(pid)) \
                and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                os.remove(path)
            except OSError:
                pass


def write_atomically(write, filepath):
    """Call `write(tmp)` and move the file into place in one rename.

    A crash or kill before the rename leaves the previous `filepath` untouched;
    after it, the new file is complete (it was flushed to disk first). The
    folder is created if missing, as `Model.save` does; temporaries a killed
    writer left beside `filepath` go; an error names `filepath`, not the
    temporary.
    """
    filepath = os.fspath(filepath)
    tmp = temporary_name(filepath)
    try:
        folder = os.path.dirname(os.path.abspath(filepath))
        try:
            os.makedirs(folder, exist_ok=True)
        except FileExistsError:  # makedirs' word when a file stands in the way
            raise NotADirectoryError(errno.ENOTDIR, "a file stands where a folder should be")
        _remove_stale(filepath)
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        replace(tmp, filepath)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise type(exc)(exc.errno, f"{exc.strerror or exc} (writing {filepath!r})") \
            if exc.errno else type(exc)(f"{exc} (writing {filepath!r})") from exc
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    folder = os.open(os.path.dirname(os.path.abspath(filepath)), os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def replace(tmp, filepath):
    """The rename that publishes a checkpoint (a seam for the fault-injection tests)."""
    os.replace(tmp, filepath)


def unwritable(callbacks):
    """The first ModelCheckpoint or BackupAndRestore whose folder cannot be written, as a
    ValueError naming it and the fix (None if all can): checked before training starts."""
    from keras import callbacks as callbacks_module

    for cb in callbacks or []:
        if isinstance(cb, callbacks_module.BackupAndRestore):
            what, folder = f"BackupAndRestore(backup_dir={cb.backup_dir!r})", cb.backup_dir
        elif isinstance(cb, callbacks_module.ModelCheckpoint):
            what = f"ModelCheckpoint(filepath={cb.filepath!r})"
            folder = os.path.dirname(os.path.abspath(cb.filepath.split("{")[0] + "x"))
        else:
            continue
        existing = os.path.abspath(os.fspath(folder))
        while not os.path.exists(existing):  # Keras creates the missing part when it saves
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            why = "is not a folder" if not os.path.isdir(existing) else "cannot be written"
            return ValueError(
                f"{what}: {existing!r} {why}, so nothing could be saved there. Choose a "
                "folder this job can write (on a shared file system, seen by every rank).")
    return None


def save(model, filepath, trainer=None, world=None, weights_only=None, overwrite=True,
         guard=None, training=False, options=None):
    """Collective: write `model` with every stage's weights and optimizer state to one file.

    Every rank of the job calls it; the logging rank writes. See `hyparflow.save`.
    Its waits go through `guard` (default: the trainer's), so a rank that never
    comes is reported, not waited for forever. With `training` (a checkpoint
    callback inside hf.fit) every stage's weights and optimizer state are gathered
    first; outside training every rank's model already holds them (hf.fit gave
    them back), and the model is written as it is, with `model.optimizer`.
    `options`: the user's further keyword arguments to `Model.save` /
    `save_weights` (`include_optimizer=False`, ...), written as Keras writes them
    (`one_file`).
    """
    options = dict(options or {})
    guard = guard or trainer.guard
    arrive = guard.bounded("every rank to call hf.save (a save is collective: call it on "
                            "every rank, like hf.fit, and hyparflow writes from one)")
    done = guard.bounded("the writing rank to finish the save")
    filepath = os.fspath(filepath)
    if weights_only is None:
        weights_only = filepath.endswith(".weights.h5")
    error = None
    writer = trainer.topology.logging_rank if trainer is not None else 0
    rank = world.Get_rank() if world is not None else 0
    try:
        one_file("save_weights" if weights_only else "save", filepath, options)
        if not (filepath.endswith(".keras") or filepath.endswith(".weights.h5")
                or filepath.endswith(".h5")):
            raise ValueError(f"filepath={filepath!r}: use a name ending in .keras (the whole "
                             "model) or .weights.h5 (weights and optimizer state), as "
                             "Model.save and Model.save_weights do.")
        if not overwrite and os.path.exists(filepath):
            raise ValueError(f"filepath={filepath!r} exists and overwrite=False.")
    except ValueError as exc:
        error = exc
    comm_.agree(error, world, wait=arrive, call="hf.save")
    state = None
    if trainer is not None and training:  # the state is in the stages (stage optimizers)
        gather_weights(trainer)
        state = _gather_optimizer_state(trainer)
    if rank == writer:
        try:
            _write(model, filepath, state, weights_only,
                   trainer.user_optimizer if trainer is not None and training else None,
                   options)
        except Exception as exc:  # every rank raises it, nothing hangs
            error = exc
    comm_.agree(error, world, wait=done, call="hf.save")


def _gather_optimizer_state(trainer):
    """On the writer (replica 0's last stage): every stage's optimizer state, in stage order."""
    top = trainer.topology
    optimizer = trainer.executor.optimizer  # this stage's: its state is the current one
    if optimizer is None:
        return None
    # sharded, every replica holds a share: all take part before the others leave
    state = trainer.executor.optimizer_state(
        wait=trainer.guard.bounded("the optimizer state of every replica's share"))
    if top.replica != 0:
        return None
    pipeline = trainer.executor.pipeline
    if pipeline is None or pipeline.Get_size() == 1:
        return [state]
    return comm_.gather_objects(state, top.partitions - 1, pipeline,
                                wait=trainer.guard.bounded("the optimizer state of every stage"))


def one_file(name, filepath, options):
    """Raise the clear error if `options` (keyword arguments to `Model.<name>` during hf.fit)
    would make Keras write several files, which a save during training cannot publish in
    one rename; the rest (``include_optimizer=False``, ...) Keras is given as they are."""
    for option, several, what in (("zipped", lambda v: v is False, "an unzipped folder"),
                                  ("max_shard_size", lambda v: v is not None,
                                   "weights in shards")):
        if option in options and several(options[option]):
            raise ValueError(
                f"model.{name}({filepath!r}, {option}={options[option]!r}) during hf.fit: "
                f"Keras writes {what}, several files, and hyparflow publishes a save made "
                "during training in one rename, so that a job killed mid-save leaves the "
                f"last complete file. Leave {option} out while training (hf.fit's callbacks), "
                "or save so after hf.fit returns (the model is then Keras' own).")


def _write(model, filepath, states, weights_only, template=None, options=None):
    """Write on this rank: the model, with a whole-model optimizer holding `states` if given.

    The optimizer written is configured as `template` (the user's optimizer; by
    default `model.optimizer`); `options` go to Keras' save as they are.
    """
    options = options or {}
    optimizer = getattr(model, "optimizer", None)
    swap = None
    if states is not None and optimizer is not None:
        # A copy over all the model's variables, as Model.save would find after model.fit.
        swap = optimizers_.stage_copy(template or optimizer, model.trainable_variables)
        optimizers_.give_state(swap, model.trainable_variables, states, len(states) - 1)
    if swap is not None:
        model.optimizer = swap
    global _writing
    try:
        _writing = True  # (during hf.fit: the model's own save, not `saves_in_training`'s)
        if weights_only:
            write_atomically(lambda tmp: model.save_weights(tmp, overwrite=True, **options),
                             filepath)
        else:
            write_atomically(lambda tmp: model.save(tmp, overwrite=True, **options), filepath)
    finally:
        _writing = False
        if swap is not None:
            model.optimizer = optimizer


_writing = False  # whether `_write` is writing (its model.save is the model's own)


@contextlib.contextmanager
def saves_in_training(model, trainer, world, whole=None):
    """While hf.fit trains, the user's `model.save` / `model.save_weights` (from a callback of
    their own, a LambdaCallback's closure) write what Model.save writes after model.fit.

    A rank holds only its stage's optimizer (`model.optimizer` is it during training)
    and, at P > 1, its stage's weights as of the last gathering; every rank that saves
    at once writes the same file. So at P = 1 unsharded, where each rank holds the
    whole model and its optimizer, whichever rank calls writes, atomically (every
    rank at once: the same bytes, one rename after another; rank 0 alone, as with
    Horovod: it alone); otherwise the save is `save`'s collective with training
    state — every rank must make it at the same step: a save on some ranks only is
    one clear error within seconds (`Guard.agree_raise`). `whole=True`: every rank holds the
    whole model and optimizer state already (after training, at `on_train_end`). Meanwhile
    `hf.save` gathers the training state too (`training_now`).
    """
    if whole is None:
        whole = trainer.topology.partitions == 1 and \
            getattr(trainer.executor, "shard", None) is None
    made = 0  # saves so far: every rank's n-th save is the same one

    own = {name: model.__dict__[name] for name in ("save", "save_weights")
           if name in model.__dict__}

    def saving(weights_only):
        name = "save_weights" if weights_only else "save"
        original = own.get(name) or getattr(type(model), name).__get__(model)

        def write(filepath, overwrite=True, **kwargs):
            nonlocal made
            if _writing:  # hyparflow's own write, inside `save`
                return original(filepath, overwrite=overwrite, **kwargs)
            filepath = os.fspath(filepath)
            if whole:
                one_file(name, filepath, kwargs)
            else:
                made += 1
                # every rank must be here: one that is not is told within seconds
                trainer.guard.agree_raise(ValueError(
                    f"model.{name}({filepath!r}) during hf.fit on this rank, but not on "
                    f"every rank: at P = {trainer.topology.partitions} (or with "
                    "shard_optimizer=True) each rank holds only its part of the weights and "
                    "optimizer state, so a save is collective, as hf.save is. Call it on every "
                    "rank at the same step (hyparflow writes the file from one)."),
                    (f"model.{name} during hf.fit", made))
                return save(model, filepath, trainer, world, weights_only=weights_only,
                            overwrite=overwrite, training=True, options=kwargs)
            if not overwrite and os.path.exists(filepath):
                raise ValueError(f"filepath={filepath!r} exists and overwrite=False.")
            write_atomically(lambda tmp: original(tmp, overwrite=True, **kwargs), filepath)
        return write

    model.__dict__["save"], model.__dict__["save_weights"] = saving(False), saving(True)
    model.__dict__["_hyparflow_training"] = not whole
    try:
        yield
    finally:
        for name in ("save", "save_weights", "_hyparflow_training"):
            model.__dict__.pop(name, None)
        model.__dict__.update(own)


def training_now(model):
    """Whether `model` is being trained by hf.fit on this rank now (a callback saving it): its
    stages hold the current weights and optimizer state, which a save must gather."""
    return bool(model.__dict__.get("_hyparflow_training"))


class SavingModel:
    """Stands for the user's model inside a checkpointing callback: its saves are collective.

    `ModelCheckpoint` calls ``self.model.save(...)`` or ``save_weights(...)`` on
    every rank at the same step (same logs, same counters); here each such call
    gathers every stage's weights and optimizer state and the logging rank
    writes one file atomically. Everything else is the user's model.
    """

    def __init__(self, model, trainer, world):
        object.__setattr__(self, "_hf", (model, trainer, world))

    def save(self, filepath, overwrite=True, **kwargs):
        model, trainer, world = self._hf
        save(model, filepath, trainer, world, weights_only=False, overwrite=overwrite,
             training=True, options=kwargs)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        model, trainer, world = self._hf
        save(model, filepath, trainer, world, weights_only=True, overwrite=overwrite,
             training=True, options=kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """Load into the user's model and optimizer (built over all the model's variables, as
        the file's), then give this stage's optimizer its part of the state (BackupAndRestore
        restoring at the start of training)."""
        model, trainer, _ = self._hf
        user, stage = trainer.user_optimizer, trainer.executor.optimizer
        if trainer.executor.shard is not None and user is not None and not user.built:
            # sharded: the whole state passes through a copy that is dropped afterwards, so
            # that no rank keeps every slot while it trains (hf.fit's end fills the user's)
            user = optimizers_.stage_copy(user, model.trainable_variables)
        if user is not None and not user.built:
            user.build(model.trainable_variables)
        model.optimizer = user
        try:
            model.load_weights(filepath, *args, **kwargs)
        finally:
            model.optimizer = stage
        optimizers_.take_state(stage, user)

    def __getattr__(self, name):
        return getattr(self._hf[0], name)

    def __setattr__(self, name, value):
        setattr(self._hf[0], name, value)
