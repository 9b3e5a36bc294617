"""A call's first collective: every rank shows the others what it was given (the model, the
data, the arguments), so that ranks called differently fail together, naming the difference."""

from __future__ import annotations

import os

from hyparflow import arguments
from hyparflow.engine import buckets as buckets_
from hyparflow.keras import keras_private
from hyparflow.mpi import comm as comm_
from hyparflow.mpi import guard as guard_
from hyparflow.mpi.topology import Topology
from hyparflow.training import callbacks as callbacks_


def start(mode, model, a):
    """Validate on every rank, agree, and set up the guard; returns (world, guard, plan).

    Raises the same ValueError/TypeError on every rank if any rank found bad input,
    or if the ranks were given different data or arguments.
    """
    partitions, replicas = a.partitions, a.replicas
    world = comm_.world() if (partitions != 1 or replicas != 1 or comm_.launched()) else None
    world_size = world.Get_size() if world is not None else 1
    error, plan = None, None
    try:
        plan = arguments.validate(model, mode, world_size, a)
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
            "models (layers, weights, optimizer, loss, metrics)": model_fingerprint(model),
            **source.agreed(),
            **({} if val is None else {f"validation {k}": v for k, v in val.agreed().items()}),
            "numbers of validation samples": None if val is None else val.size,
        }
    rank = world.Get_rank() if world is not None else 0
    # The first collective of the call: bounded, and a rank that left its script is seen.
    timeout = a.timeout if error is None else guard_.DEFAULT_TIMEOUT  # a.timeout was checked
    arrive = guard_.bounded(
        world, f"every rank to call hf.{mode} (it is collective: call it on every rank)",
        timeout)
    comm_.agree(error, world, fingerprint, wait=arrive, call=f"hf.{mode}")
    where = Topology(partitions=plan.P, replicas=plan.R, rank=rank, chunks=plan.chunks).where()
    guard = guard_.for_job(world, where, a.timeout)
    return world, guard, plan


def model_fingerprint(model):
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


# Arguments that must be the same on every rank, besides the data (checked in start).
_AGREED = {
    "fit": ("epochs", "initial_epoch", "steps_per_epoch", "schedule", "chunks", "recompute",
            "step_graph", "shard_optimizer", "balance", "keep_nested", "shuffle", "class_weight",
            "validation_freq", "validation_steps", "validation_batch_size"),
    "evaluate": ("balance", "keep_nested", "steps"),
    "predict": ("balance", "keep_nested", "steps"),
}
