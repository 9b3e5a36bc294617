"""Gather every stage's weights and optimizer state into the user's model; save one standard Keras file atomically."""

import os

from hyparflow import comm as comm_


def sync_stage_weights(trainer):
    """Give every replica of this rank's stage replica 0's weights (replicas start equal)."""
    st = trainer.partition.stages[trainer.topology.stage]
    group = trainer.executor.replicas
    if group is None:
        return
    weights = st.model.weights
    values = comm_.broadcast_arrays([w.numpy() for w in weights], 0, group,
                                    wait=trainer.guard.bounded("replica 0's weights of this stage"))
    for w, v in zip(weights, values):
        w.assign(v)


def gather_weights(trainer):
    """Every rank's model gets every stage's current weights.

    Trainable weights are equal on all replicas (same summed gradients); the
    non-trainable state each replica updated on its own samples (e.g.
    BatchNormalization's moving statistics) is averaged over replicas first.
    """
    st = trainer.partition.stages[trainer.topology.stage]
    group = trainer.executor.replicas
    state = [w for w in st.model.non_trainable_weights if "float" in str(w.dtype)]
    if group is not None and group.Get_size() > 1 and state:
        summed = comm_.allreduce_sum(
            [w.numpy() for w in state], group,
            wait=trainer.guard.bounded("the average of this stage's statistics over replicas"))
        for w, v in zip(state, summed):
            w.assign(v / group.Get_size())
    pipeline = trainer.executor.pipeline
    if pipeline is None or pipeline.Get_size() == 1:
        return
    for other in trainer.partition.stages:
        weights = other.model.weights
        values = comm_.broadcast_arrays(
            [w.numpy() for w in weights], other.index, pipeline,
            wait=trainer.guard.bounded(f"the weights of stage {other.index}"))
        if other.index != trainer.topology.stage:
            for w, v in zip(weights, values):
                w.assign(v)


def _slot_prefix(variable):
    """Keras names an optimizer slot of `variable` '<path with _ for />_<slot>'."""
    return variable.path.replace("/", "_")


def _owners(names, variables):
    """Map each optimizer-variable name to the model variable it is a slot of (or None).

    The longest matching prefix wins, so 'dense_kernel_2_momentum' belongs to
    'dense/kernel_2', not 'dense/kernel'.
    """
    prefixes = sorted(((_slot_prefix(v), v) for v in variables), key=lambda p: -len(p[0]))
    out = {}
    for n in names:
        out[n] = next((v for p, v in prefixes if n.startswith(p + "_")), None)
    return out


def stage_optimizer_state(optimizer, stage_variables, model_variables):
    """This stage's optimizer slots by name, and the step count.

    Returns:
        ({slot name: array} for the slots of `stage_variables`, iterations).
    """
    if optimizer is None or not optimizer.built:
        return {}, 0
    own = {id(v) for v in stage_variables}
    owners = _owners([v.name for v in optimizer.variables], model_variables)
    slots = {v.name: v.numpy() for v in optimizer.variables
             if owners[v.name] is not None and id(owners[v.name]) in own}
    return slots, int(optimizer.iterations.numpy())


def full_optimizer(optimizer, variables, slots, iterations):
    """A copy of `optimizer` built on all of `variables`, holding the gathered state.

    Raises:
        ValueError: the model's variables give two slots the same name (layers
            with equal names in different nested models), so they cannot be told apart.
    """
    full = optimizer.__class__.from_config(optimizer.get_config())
    full.build(variables)
    names = [v.name for v in full.variables]
    owned = _owners(names, variables)
    missing = [n for n in names if owned[n] is not None and n not in slots]
    if slots and missing:
        raise ValueError(
            f"cannot save the optimizer state: the slots {missing[:3]} of the model's variables "
            "were not gathered from any stage. Save with hf.save after hf.fit on the same "
            "ranks, or with model.save for a model trained in one process.")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"cannot save the optimizer state: the optimizer variables {twice[:3]} appear "
            "more than once, because layers in different nested models share a name. Give "
            "those layers distinct names.")
    for v in full.variables:
        if v.name in slots:
            v.assign(slots[v.name])
        elif v.name == "iteration":
            v.assign(iterations)
        else:  # learning rate and other scalars: the same on every rank
            mine = next((u for u in optimizer.variables if u.name == v.name), None)
            if mine is not None and tuple(mine.shape) == tuple(v.shape):
                v.assign(mine.numpy())
    return full


def temporary_name(filepath):
    """A name beside `filepath` that keeps its suffix (Keras dispatches on it)."""
    head, tail = os.path.split(os.path.abspath(filepath))
    return os.path.join(head, f".tmp-{os.getpid()}-{tail}")


def write_atomically(write, filepath):
    """Call `write(tmp)` and move the file into place in one rename.

    A crash or kill before the rename leaves the previous `filepath` untouched;
    after it, the new file is complete (it was flushed to disk first).
    """
    filepath = os.fspath(filepath)
    tmp = temporary_name(filepath)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        replace(tmp, filepath)
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


def save(model, filepath, trainer=None, world=None, weights_only=None, overwrite=True,
         guard=None):
    """Collective: write `model` with every stage's weights and optimizer state to one file.

    Every rank of the job calls it; the logging rank writes. See `hyparflow.save`.
    Its waits go through `guard` (default: the trainer's), so a rank that never
    comes is reported, not waited for forever.
    """
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
        if not (filepath.endswith(".keras") or filepath.endswith(".weights.h5")
                or filepath.endswith(".h5")):
            raise ValueError(f"filepath={filepath!r}: use a name ending in .keras (the whole "
                             "model) or .weights.h5 (weights and optimizer state), as "
                             "Model.save and Model.save_weights do.")
        if not overwrite and os.path.exists(filepath):
            raise ValueError(f"filepath={filepath!r} exists and overwrite=False.")
    except ValueError as exc:
        error = exc
    comm_.agree(error, world, wait=arrive)
    state = None
    if trainer is not None:
        gather_weights(trainer)
        state = _gather_optimizer_state(model, trainer)
    if rank == writer:
        try:
            _write(model, filepath, state, weights_only)
        except Exception as exc:  # every rank raises it, nothing hangs
            error = exc
    comm_.agree(error, world, wait=done)


def _gather_optimizer_state(model, trainer):
    """On the writer (replica 0's last stage): (slots by name, iterations) of all stages."""
    top = trainer.topology
    if top.replica != 0 or getattr(model, "optimizer", None) is None:
        return None
    stage = trainer.partition.stages[top.stage]
    slots, iterations = stage_optimizer_state(model.optimizer, stage.model.trainable_variables,
                                              model.trainable_variables)
    pipeline = trainer.executor.pipeline
    if pipeline is None or pipeline.Get_size() == 1:
        return slots, iterations
    parts = comm_.gather_objects((slots, iterations), top.partitions - 1, pipeline,
                                 wait=trainer.guard.bounded("the optimizer state of every stage"))
    if parts is None:
        return None
    merged = {}
    for s, _ in parts:
        merged.update(s)
    return merged, max(i for _, i in parts)


def _write(model, filepath, state, weights_only):
    """Write on this rank: the model, with a whole-model optimizer if one was gathered."""
    optimizer = getattr(model, "optimizer", None)
    swap = None
    # The writer's own optimizer may be unbuilt (its stage has no weights): the
    # gathered slots of the other stages still go into the file.
    if state is not None and optimizer is not None and (optimizer.built or state[0]):
        slots, iterations = state
        swap = full_optimizer(optimizer, model.trainable_variables, slots, iterations)
    if swap is not None:
        model.optimizer = swap
    try:
        if weights_only:
            write_atomically(lambda tmp: model.save_weights(tmp, overwrite=True), filepath)
        else:
            write_atomically(lambda tmp: model.save(tmp, overwrite=True), filepath)
    finally:
        if swap is not None:
            model.optimizer = optimizer


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
        save(model, filepath, trainer, world, weights_only=False, overwrite=overwrite)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        model, trainer, world = self._hf
        save(model, filepath, trainer, world, weights_only=True, overwrite=overwrite)

    def __getattr__(self, name):
        return getattr(self._hf[0], name)

    def __setattr__(self, name, value):
        setattr(self._hf[0], name, value)
