"""Global batch → replica share → micro-batches, epoch by epoch,
from arrays or streams, as Model.fit feeds them."""

import warnings
import zlib
from typing import NamedTuple

import numpy as np


class ModelIO(NamedTuple):
    """What data must match: the model's input and output Keras tensors and names (tensors
    None for a subclassed model, whose data is taken as given), and per output whether
    the compiled loss reads its target (`loss=["mse", None]`: partial labels); whether
    targets may be left out (the model's own loss logic may not read any)."""

    inputs: object
    outputs: object
    in_names: object
    out_names: object
    labelled: object = None
    y_optional: bool = False


def is_sparse(a):
    """Whether `a` is a scipy sparse matrix."""
    return hasattr(a, "tocsr") and hasattr(a, "nnz")


def is_ragged(a):
    """Whether `a` is a tf.RaggedTensor."""
    return type(a).__name__ == "RaggedTensor"


def count(a):
    """The number of samples (rows) of an array, sparse matrix or ragged tensor."""
    return int(a.shape[0])


def take(a, rows):
    """The samples `rows` (index array or slice) of an array, sparse matrix or ragged tensor."""
    if is_ragged(a) and not isinstance(rows, slice):
        import tensorflow as tf

        return tf.gather(a, rows)
    return a[rows]


def total(a):
    """The float64 sum of every value (the checksum the ranks compare)."""
    if is_ragged(a):
        import tensorflow as tf

        return float(tf.reduce_sum(tf.cast(a.flat_values, tf.float64)))
    if is_sparse(a):
        return float(a.sum(dtype=np.float64))
    if is_text(a):  # strings: a CRC of their bytes
        return float(zlib.crc32(b"\0".join(
            v if isinstance(v, bytes) else str(v).encode() for v in a.ravel())))
    return float(np.sum(a, dtype=np.float64))


def feedable(a):
    """What a model takes for `a`: a scipy sparse matrix as a tf.SparseTensor, strings as a
    tf.string tensor, else `a`."""
    if isinstance(a, np.ndarray) and is_text(a):
        import tensorflow as tf

        return tf.constant(a.tolist() if a.dtype.kind == "O" else a)
    if not is_sparse(a):
        return a
    import tensorflow as tf

    coo = a.tocoo()
    return tf.sparse.reorder(tf.SparseTensor(
        np.stack([coo.row, coo.col], axis=1).astype(np.int64), coo.data, coo.shape))


def sparse_or_ragged(a, what, name):
    """A sparse or ragged input as hyparflow keeps it (scipy CSR, tf.RaggedTensor), floats in
    floatx; None if `a` is neither."""
    import keras

    floatx = keras.backend.floatx()
    if type(a).__name__ == "SparseTensor":  # tf.SparseTensor: rows are taken as scipy CSR
        import scipy.sparse

        if len(a.shape) != 2:
            raise ValueError(f"{what} for {name!r} is a {len(a.shape)}-D tf.SparseTensor; "
                             "hyparflow takes 2-D sparse inputs (samples × features).")
        a = scipy.sparse.csr_matrix((a.values.numpy(), (a.indices.numpy()[:, 0],
                                                         a.indices.numpy()[:, 1])),
                                    shape=tuple(a.shape))
    if is_sparse(a):
        a = a.tocsr()
        return a.astype(floatx) if np.issubdtype(a.dtype, np.floating) else a
    if is_ragged(a):
        import tensorflow as tf

        return tf.cast(a, floatx) if a.dtype.is_floating else a
    return None


def as_arrays(data, tensors, names, what, labelled=None):
    """The user's `x` or `y` as a list of numpy arrays in the order of `tensors`.

    Args:
        data: one array, a list/tuple of arrays, or a dict keyed by `names`.
        tensors: the model's input (or output) Keras tensors; None for a subclassed
            model, whose inputs are taken as given.
        names: their names, for dict keys and messages.
        what: ``"x"`` or ``"y"``, for messages.
        labelled: per output, whether its loss reads a target (None: all do). Targets
            for the labelled outputs only are taken as Model.fit takes them, in order
            (or by name); the others get zeros that no loss reads (a broadcast view).

    Floating arrays are cast to Keras' floatx, as `Model.fit` does; others keep their dtype.
    """
    import keras

    if data is None:
        raise ValueError(f"{what}=None: hf.fit needs {what} as numpy arrays (one per model "
                         f"{'input' if what == 'x' else 'output'}: {names}).")
    if tensors is None:
        names = sorted(data) if isinstance(data, dict) else None
    partial = tensors is not None and labelled is not None and not all(labelled)
    if isinstance(data, dict):
        missing = [n for j, n in enumerate(names) if n not in data and not (
            partial and not labelled[j])]
        if missing:
            raise ValueError(f"{what} is a dict with keys {sorted(data)}, but the model's "
                             f"{'inputs' if what == 'x' else 'outputs'} are named {names}; "
                             f"add {missing}.")
        arrays = [data.get(n) for n in names]
    elif isinstance(data, (list, tuple)):
        arrays = list(data)
    else:
        arrays = [data]
    if partial and len(arrays) == sum(labelled) < len(tensors):
        given = iter(arrays)
        arrays = [next(given) if has else None for has in labelled]
    if tensors is not None and len(arrays) != len(tensors):
        raise ValueError(f"{what} has {len(arrays)} arrays, but the model has {len(tensors)} "
                         f"{'inputs' if what == 'x' else 'outputs'} ({names}); pass one array "
                         "each, as a list in that order or a dict keyed by name.")
    out = []
    labels = names or [str(j) for j in range(len(arrays))]
    for a, name in zip(arrays, labels):
        if a is None:
            out.append(None)
            continue
        special = sparse_or_ragged(a, what, name)
        if special is not None and what.endswith("y") and not is_ragged(special):
            raise ValueError(
                f"{what} for output {name!r} is a sparse matrix; hf.fit takes sparse inputs, "
                "not targets. Make the targets an array with sparse.toarray(), or class indices "
                "for a sparse categorical loss.")
        if special is not None:
            out.append(special)
            continue
        if hasattr(a, "numpy") and not isinstance(a, np.ndarray):
            a = a.numpy()
        a = np.asarray(a)
        if what == "x" and is_text(a):  # strings, for the model's own text layers
            out.append(a)
            continue
        if a.dtype.kind not in "biuf":
            fix = "Turn labels that are names into class indices (e.g. np.unique(y, " \
                "return_inverse=True)[1])." if what != "x" and is_text(a) else \
                "Convert it to one of those."
            raise ValueError(
                f"{what} for {'input' if what == 'x' else 'output'} {name!r} has dtype "
                f"{a.dtype}; hf.fit takes numbers (bool, int or float arrays), and strings "
                f"as inputs. {fix}")
        if np.issubdtype(a.dtype, np.floating):
            a = a.astype(keras.backend.floatx(), copy=False)
        if a.ndim == 0:
            raise ValueError(f"{what} holds a scalar; it needs one row per sample.")
        out.append(a)
    if any(a is None for a in out):
        if all(a is None for a in out):
            raise ValueError(f"{what} holds no arrays; give the targets of the outputs "
                             f"whose loss is not None.")
        n = count(next(a for a in out if a is not None))
        for j, t in enumerate(tensors):
            if out[j] is None:  # an output without a loss: a target nothing reads
                shape = tuple(1 if d is None else d for d in t.shape[1:])
                out[j] = np.broadcast_to(np.zeros((1,) + shape, keras.backend.floatx()),
                                         (n,) + shape)
    return out


def is_text(array):
    """Whether an input array holds strings (str or bytes; object arrays of them too), which
    the model's own layers (TextVectorization, StringLookup, Hashing) read."""
    if array.dtype.kind in "US":
        return True
    return array.dtype.kind == "O" and array.size > 0 and all(
        isinstance(v, (str, bytes)) for v in array.flat[:16])


def num_samples(x_arrays, y_arrays):
    """The common number of samples, or a ValueError naming the disagreement."""
    lengths = {count(a) for a in x_arrays + y_arrays}
    if len(lengths) != 1:
        raise ValueError(
            f"x and y have different numbers of samples: x {[count(a) for a in x_arrays]}, "
            f"y {[count(a) for a in y_arrays]}. Every array needs one row per sample.")
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


def fed(before, size, replicas):
    """How many replicas have had samples — the first ones, as `even_sizes` deals them —
    after a batch of `size` samples, `before` of them having had some already."""
    return max(before, min(size, replicas))


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
    benchmarks/results/log.md), which argues for few. So: at least P (every stage
    busy at once), at most 4P, and micro-batches of at least 16 samples in
    between; never more than the share. ResNet-110, share 64, P = 2 gives m = 4,
    the fastest of m ∈ {1, 2, 4, 8} measured.
    """
    if partitions == 1:
        return 1
    m = min(4 * partitions, max(partitions, replica_batch // MIN_MICROBATCH))
    return max(1, min(m, replica_batch))


def sample_weights(sample_weight, class_weight, y_arrays, out_names):
    """`sample_weight`/`class_weight` as one float array (or None) per output, as Model.fit
    reads them.

    Args:
        sample_weight: None, one array (every output), or a list/dict with one per output.
        class_weight: None, or a dict class index → weight (single-output models).
        y_arrays: the targets, one array per output.
        out_names: the outputs' names, for dict keys and messages.

    Returns:
        None when unweighted, else a list with one array (or None) per output.
    """
    import keras

    from hyparflow.keras import keras_private

    if sample_weight is not None and class_weight is not None:
        raise ValueError("You cannot `class_weight` and `sample_weight` at the same time.")
    if class_weight is not None:
        check_class_weight(class_weight)
        if len(y_arrays) != 1:
            raise ValueError("`class_weight` is only supported for Models with a single output.")
        return [keras_private.class_weight_to_sample_weights(y_arrays[0], class_weight)]
    if sample_weight is None:
        return None
    names = out_names or [str(j) for j in range(len(y_arrays))]
    if isinstance(sample_weight, dict):
        unknown = sorted(set(sample_weight) - set(names))
        if unknown:
            raise ValueError(f"sample_weight is a dict with keys {unknown} that name no model "
                             f"output; the outputs are {names}.")
        weights = [sample_weight.get(n) for n in names]
    elif isinstance(sample_weight, (list, tuple)):
        if len(sample_weight) != len(y_arrays):
            raise ValueError(
                f"sample_weight has {len(sample_weight)} arrays, but the model has "
                f"{len(y_arrays)} outputs ({names}); pass one per output, or one array for all.")
        weights = list(sample_weight)
    else:
        w = np.asarray(sample_weight)
        if len(y_arrays) > 1 and not (w.ndim == 1 or (w.ndim == 2 and w.shape[1] == 1)):
            raise ValueError(
                "For a model with multiple outputs, when providing a single `sample_weight` "
                "array, it should only have one scalar score per sample (i.e. shape "
                "`(num_samples,)`). If you want to use non-scalar sample weights, pass a "
                "`sample_weight` argument with one array per model output.")
        weights = [w] * len(y_arrays)
    out = []
    for w, y, name in zip(weights, y_arrays, names):
        if w is None:
            out.append(None)
            continue
        w = np.asarray(w.numpy() if hasattr(w, "numpy") else w)
        if w.dtype.kind not in "biuf":
            raise ValueError(f"sample_weight for output {name!r} has dtype {w.dtype}; it must "
                             "hold numbers.")
        if len(w) != len(y):
            raise ValueError(f"sample_weight for output {name!r} has {len(w)} rows, but y has "
                             f"{len(y)} samples. Give one weight per sample.")
        out.append(w.astype(keras.backend.floatx(), copy=False))
    return out


def check_class_weight(class_weight):
    """`class_weight` must map class indices to weights, as in Model.fit."""
    if not isinstance(class_weight, dict):
        raise ValueError(f"class_weight={class_weight!r}: use a dict mapping class indices "
                         "to weights, e.g. {0: 1.0, 1: 5.0}, as in Model.fit.")


class Share:
    """What one rank takes from every global batch: its replica's micro-batches of what it reads.

    Args:
        replicas, microbatches, replica: R, m and this rank's replica r; m None:
            the default for each batch's size (batches read from a dataset).
        positions: indices of the model inputs this rank reads (its stage's, and on the
            last stage possibly all: `Executor.reads`), in the order it gets them.
        targets: whether this rank reads the targets and sample weights (last stage).
        partitions: P, for the default m.
        check: None, or check(size), run for every batch (on every rank alike), which raises
            for a batch these replicas cannot take; then every replica with samples gets
            the same number of micro-batches (a synchronized BatchNormalization sums its
            moments micro-batch by micro-batch).
    """

    def __init__(self, replicas, microbatches, replica, positions, targets, partitions=1,
                 check=None):
        self.R, self.m, self.replica = replicas, microbatches, replica
        self.positions, self.targets, self.P = list(positions), targets, partitions
        self.check = check

    def microbatches(self, size):
        """m for a global batch of `size` samples."""
        m = self.m or default_microbatches(self.P, max(1, size // self.R))
        if self.check is not None:
            self.check(size)
            m = min(m, max(1, size // self.R))
        return m


class ArrayData:
    """Numpy inputs, targets and sample weights, cut into global batches by index.

    Pass `p` of the data is one sweep over all samples, in the order
    `epoch_order(n, shuffle, seed, p)`: the same on every rank.
    """

    def __init__(self, x, y, sw, batch_size, share, shuffle=False, seed=0):
        self.x, self.y, self.sw = x, y, sw
        self.n = count(x[0])
        self.batch_size, self.share, self.shuffle, self.seed = batch_size, share, shuffle, seed
        self.num_batches = -(-self.n // batch_size)
        self.rewindable = True

    def batches(self, p):
        """The global batches of pass `p`."""
        for idx in batches(epoch_order(self.n, self.shuffle, self.seed, p), self.batch_size):
            yield ArrayBatch(self, idx)


class ArrayBatch:
    """One global batch of an ArrayData, taken apart into this rank's micro-batches."""

    def __init__(self, data, idx):
        self.data, self.idx, self.size = data, idx, len(idx)

    def parts(self):
        """(sizes, xs, ys, sws) of this rank's micro-batches; ys/sws None where not read."""
        d, s = self.data, self.data.share
        micro = shard(self.idx, s.R, s.microbatches(self.size), s.replica)
        xs = [[feedable(take(d.x[p], i)) for p in s.positions] for i in micro]
        ys = [[take(a, i) for a in d.y] for i in micro] if s.targets and d.y else None
        sws = None
        if ys is not None and d.sw is not None:
            sws = [[None if w is None else w[i] for w in d.sw] for i in micro]
        return [len(i) for i in micro], xs, ys, sws

    def positions(self):
        """Per micro-batch of this rank, the samples' positions in the data (for predict)."""
        s = self.data.share
        return shard(self.idx, s.R, s.microbatches(self.size), s.replica)


class Stream:
    """Global batches read one after another (a dataset, a generator, a PyDataset), not by index.

    Every rank reads the same stream; `_elements(p)` yields, per global batch,
    (size, checksum, xs, ys, sws): the batch's size, a checksum of all of it, and
    this rank's replica's share of the inputs its stage reads (and of the targets
    and weights on the last stage). `check(size, checksum, k)`, run for every
    batch, compares them across ranks: a source that gives different ranks
    different batches is an error, not a silent mistake.
    """

    rewindable = False
    num_batches = None

    def __init__(self, share, check=None):
        self.share, self.check = share, check

    def batches(self, p):
        """The global batches of pass `p`."""
        return self._read(self._elements(p))

    def _elements(self, p):
        raise NotImplementedError

    def _read(self, elements):
        offset, k = 0, 0
        for k, (size, checksum, xs, ys, sws) in enumerate(elements):
            if self.check is not None:
                self.check(int(size), float(checksum), k)
            yield StreamBatch(self.share, int(size), offset, list(xs), list(ys) or None,
                              list(sws) or None)
            offset += int(size)
        if self.check is not None:  # the end of the data, too, must come on every rank at once
            self.check(0, 0.0, k + 1)

    def on_epoch_begin(self):
        """Called as each epoch begins, as Keras' data adapters are."""

    def on_epoch_end(self):
        """Called as each epoch ends, as Keras' data adapters are."""


def share_bounds(size, share):
    """(start, stop) of this rank's replica's share of a global batch of `size` samples."""
    sizes = even_sizes(size, share.R)
    start = sum(sizes[:share.replica])
    return start, start + sizes[share.replica]


class StreamBatch:
    """One global batch read from a stream: this rank's replica share, cut into micro-batches."""

    def __init__(self, share, size, offset, xs, ys, sws):
        self.share, self.size, self.offset = share, size, offset
        self.xs, self.ys, self.sws = xs, ys, sws

    def _pieces(self):
        s = self.share
        mine = even_sizes(self.size, s.R)[s.replica]
        out, start = [], 0
        for n in even_sizes(mine, s.microbatches(self.size)):
            if n:
                out.append(slice(start, start + n))
            start += n
        return out

    def parts(self):
        """(sizes, xs, ys, sws) of this rank's micro-batches; ys/sws None where not read."""
        pieces = self._pieces()
        xs = [[feedable(take(a, p)) for a in self.xs] for p in pieces]
        ys = [[a[p] for a in self.ys] for p in pieces] if self.ys else None
        sws = [[a[p] for a in self.sws] for p in pieces] if self.ys and self.sws else None
        return [p.stop - p.start for p in pieces], xs, ys, sws

    def positions(self):
        """Per micro-batch of this rank, the samples' positions in the data (for predict)."""
        first = self.offset + share_bounds(self.size, self.share)[0]
        return [np.arange(first + p.start, first + p.stop) for p in self._pieces()]


_RAN_OUT = ("Your input ran out of data; interrupting training. Make sure that your dataset "
            "or generator can generate at least `steps_per_epoch * epochs` batches. You may "
            "need to use the `.repeat()` function when building your dataset.")


class Feed:
    """Global batches epoch by epoch, exactly as `Model.fit`'s epoch iterator hands them out.

    Without `steps_per_epoch`, an epoch is one pass over the data. With it, an
    epoch takes the next `steps_per_epoch` batches, going on where the previous
    epoch stopped; a pass that runs out ends the epoch early (with Keras'
    warning) and the next epoch starts a new pass. A new pass starts at the
    same moments as in Keras' `EpochIterator` (also the extra one it starts
    after an epoch that ends a pass), because a seeded `tf.data` shuffle draws
    a new order at every pass: so the batches are the ones `Model.fit` reads.

    Batches come in groups of `per_execution` (the model's `steps_per_execution`),
    counted as Keras counts them: callbacks see a group's first and last step, a
    group is cut short where the data ends, and an epoch of `steps_per_epoch`
    steps reads whole groups.
    """

    def __init__(self, data, steps_per_epoch=None, per_execution=1):
        self.data, self.steps, self.per_execution = data, steps_per_epoch, per_execution
        self.num_batches = getattr(data, "num_batches", None)
        self._passes, self._iter, self._seen = 0, None, 0
        self.quiet = False

    def reset(self):
        """Start again from a new pass, as Keras' evaluate resets its epoch iterator."""
        self._iter, self._seen = None, 0
        self.num_batches = getattr(self.data, "num_batches", None)
        self._hook("on_epoch_end")

    def _new_pass(self):
        p, self._passes = self._passes, self._passes + 1
        return iter(self.data.batches(p))

    def epoch(self):
        """Yields the next epoch's groups of global batches: (first step, last step, batches)."""
        k = self.per_execution
        steps = self.steps or self.num_batches
        self._hook("on_epoch_begin")
        if not steps:  # length unknown and no steps: until the data runs out
            self._iter, self._seen = self._new_pass(), 0
            step = -k
            while group := self._group(k):
                step += k
                yield step, step + k - 1, group
            return
        if self._iter is None or self.steps is None:
            self._iter, self._seen = self._new_pass(), 0
        for step in range(0, steps, k):
            if self.num_batches and self._seen >= self.num_batches:
                if self.steps:
                    self._warn()
                break
            group = self._group(k)
            if not group:
                return
            yield step, step + k - 1, group
        if self.num_batches and self._seen >= self.num_batches:
            self._iter, self._seen = self._new_pass(), 0
        self._hook("on_epoch_end")

    def _hook(self, name):
        """The data's epoch hook (a PyDataset's on_epoch_begin/end), as Keras' iterator calls it."""
        hook = getattr(self.data, name, None)
        if hook is not None:
            hook()

    def _group(self, k):
        """The next (up to) k batches of this pass; none when it ran out (then Keras' warning)."""
        self._seen += k
        group = []
        for _ in range(k):
            b = next(self._iter, None)
            if b is None:
                break
            group.append(b)
        if not group:
            self._ran_out()
        return group

    def _ran_out(self):
        if self.num_batches is None:
            self.num_batches = self._seen  # as Keras counts it: a group more than it read
        self._iter = None
        self._warn()
        self._hook("on_epoch_end")

    def _warn(self):
        if not self.quiet:
            warnings.warn(_RAN_OUT, stacklevel=3)

    @property
    def rewindable(self):
        """Whether the data can be read again as it was (arrays): a resume replays it."""
        return getattr(self.data, "rewindable", False)

    def skip(self, epochs):
        """Move past `epochs` epochs without training (resuming at `initial_epoch`)."""
        if not self.rewindable:
            return
        quiet, self.quiet = self.quiet, True
        for _ in range(epochs):
            for _ in self.epoch():
                pass
        self.quiet = quiet


class Structure:
    """How the model's step takes x, y or sample_weight: as the user gave them to hf.fit.

    Args:
        kind: "none", "single", "tuple" (a list or tuple: Keras hands lists on as
            tuples) or "dict".
        names: the dict's keys, in the order of the flat arrays.
    """

    def __init__(self, kind, names=()):
        self.kind, self.names = kind, list(names)

    @classmethod
    def of(cls, data, names=None):
        if data is None:
            return cls("none")
        if isinstance(data, dict):
            return cls("dict", names if names else sorted(data))
        if isinstance(data, (list, tuple)):
            return cls("tuple")
        return cls("single")

    def pack(self, arrays):
        """The flat arrays (in hyparflow's order) in this structure."""
        if self.kind == "none" or arrays is None:
            return None
        if self.kind == "dict":
            return dict(zip(self.names, arrays))
        if self.kind == "tuple":
            return tuple(arrays)
        return arrays[0]
