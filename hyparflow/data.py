"""Global batch → replica share → micro-batches, for numpy arrays."""

import numpy as np


def as_arrays(data, tensors, names, what):
    """The user's `x` or `y` as a list of numpy arrays in the order of `tensors`.

    Args:
        data: one array, a list/tuple of arrays, or a dict keyed by `names`.
        tensors: the model's input (or output) Keras tensors; None for a subclassed
            model, whose inputs are taken as given.
        names: their names, for dict keys and messages.
        what: ``"x"`` or ``"y"``, for messages.

    Floating arrays are cast to Keras' floatx, as `Model.fit` does; others keep their dtype.
    """
    import keras

    if data is None:
        raise ValueError(f"{what}=None: hf.fit needs {what} as numpy arrays (one per model "
                         f"{'input' if what == 'x' else 'output'}: {names}).")
    if tensors is None:
        names = sorted(data) if isinstance(data, dict) else None
    if isinstance(data, dict):
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"{what} is a dict with keys {sorted(data)}, but the model's "
                             f"{'inputs' if what == 'x' else 'outputs'} are named {names}; "
                             f"add {missing}.")
        arrays = [data[n] for n in names]
    elif isinstance(data, (list, tuple)):
        arrays = list(data)
    else:
        arrays = [data]
    if tensors is not None and len(arrays) != len(tensors):
        raise ValueError(f"{what} has {len(arrays)} arrays, but the model has {len(tensors)} "
                         f"{'inputs' if what == 'x' else 'outputs'} ({names}); pass one array "
                         "each, as a list in that order or a dict keyed by name.")
    out = []
    labels = names or [str(j) for j in range(len(arrays))]
    for a, name in zip(arrays, labels):
        if hasattr(a, "numpy") and not isinstance(a, np.ndarray):
            a = a.numpy()
        a = np.asarray(a)
        if a.dtype.kind not in "biuf":
            raise ValueError(
                f"{what} for {'input' if what == 'x' else 'output'} {name!r} has dtype "
                f"{a.dtype}; hf.fit needs numbers (bool, int or float arrays). Convert it, "
                "e.g. with np.asarray(..., dtype='float32').")
        if np.issubdtype(a.dtype, np.floating):
            a = a.astype(keras.backend.floatx(), copy=False)
        if a.ndim == 0:
            raise ValueError(f"{what} holds a scalar; it needs one row per sample.")
        out.append(a)
    return out


def num_samples(x_arrays, y_arrays):
    """The common number of samples, or a ValueError naming the disagreement."""
    lengths = {len(a) for a in x_arrays + y_arrays}
    if len(lengths) != 1:
        raise ValueError(
            f"x and y have different numbers of samples: x {[len(a) for a in x_arrays]}, "
            f"y {[len(a) for a in y_arrays]}. Every array needs one row per sample.")
    return lengths.pop()


def epoch_order(n, shuffle, seed, epoch):
    """The sample order of one epoch: identical on every rank given the same seed."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def batches(order, batch_size):
    """Index arrays of the global batches of an epoch (the last may be smaller)."""
    return [order[k:k + batch_size] for k in range(0, len(order), batch_size)]


def even_sizes(total, parts):
    """Sizes of `parts` pieces of `total`, as equal as possible, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]


def shard(batch, replicas, microbatches, replica):
    """This replica's micro-batches of one global batch.

    A full batch splits exactly (the configuration was validated); a smaller last
    batch splits as evenly as possible and empty micro-batches are dropped, so
    that every sample is used exactly once, as in `Model.fit`.

    Returns:
        A list of index arrays, one per non-empty micro-batch.
    """
    sizes = even_sizes(len(batch), replicas)
    start = sum(sizes[:replica])
    mine = batch[start:start + sizes[replica]]
    out, offset = [], 0
    for size in even_sizes(len(mine), microbatches):
        if size:
            out.append(mine[offset:offset + size])
        offset += size
    return out


MIN_MICROBATCH = 16


def default_microbatches(partitions, replica_batch):
    """The default micro-batch count m for P stages and a replica's share of the batch.

    With one stage there is no bubble to fill, so m = 1. With P > 1, a GPipe step
    idles (P − 1)/(m + P − 1) of the time, which argues for many micro-batches
    (m = 4P: under 20%); but every micro-batch also has a fixed cost on each
    stage (about 10–25 ms for a ResNet stage on one CPU core, measured in
    benchmarks/README.md), which argues for few. So: at least P (every stage
    busy at once), at most 4P, and micro-batches of at least 16 samples in
    between; never more than the share. ResNet-110, share 64, P = 2 gives m = 4,
    the fastest of m ∈ {1, 2, 4, 8} measured.
    """
    if partitions == 1:
        return 1
    m = min(4 * partitions, max(partitions, replica_batch // MIN_MICROBATCH))
    return max(1, min(m, replica_batch))
