"""Global batches from Python generators and keras.utils.PyDataset,
read alike on every rank, each keeping its share."""

import collections
import itertools
import multiprocessing
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hyparflow.data.batches import (
    Stream,
    as_arrays,
    count,
    num_samples,
    sample_weights,
    share_bounds,
    total,
)

# Keras' GeneratorDataAdapter reads this many batches ahead to learn their shapes,
# and hands them out again at the start of every pass over the generator.
PEEKED = 2


def peek(generator):
    """The first batches of `generator` and a function giving a pass over it, as Keras' adapter.

    Raises Keras' errors for a generator that yields nothing or not tuples.
    """
    first = list(itertools.islice(generator, PEEKED))
    if not first:
        raise ValueError("When passing a Python generator to a Keras model, the generator "
                         "must yield at least one batch. Received an empty generator.")
    if not isinstance(first[0], tuple):
        raise ValueError(
            "When passing a Python generator to a Keras model, the generator must return a "
            "tuple, either (input,) or (inputs, targets) or (inputs, targets, "
            f"sample_weights). Received: {first[0]}")
    return first, lambda: itertools.chain(first, generator)


def standardized(batch):
    """A PyDataset item as Keras' PyDatasetAdapter reads it: a tuple (x[, y[, w]]) or a dict."""
    if isinstance(batch, dict):
        return batch
    if isinstance(batch, np.ndarray):
        batch = (batch,)
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple) or len(batch) not in {1, 2, 3}:
        raise ValueError(
            "PyDataset.__getitem__() must return a tuple or a dict. If a tuple, it must be "
            "ordered either (input,) or (inputs, targets) or (inputs, targets, "
            f"sample_weights). Received: {str(batch)[:100]}... of type {type(batch)}")
    return batch


def arrays_of(batch, io, class_weight=None, targets=True, prefix=""):
    """One global batch as (xs, ys, sws): arrays in the model's order, checked as hf.fit checks x.

    Args:
        batch: `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`.
        io: the model's `data.ModelIO`.
        class_weight: turned into sample weights, as Model.fit does.
        targets: False to ignore y and the weights (predict).
        prefix: for messages about validation data.
    """
    import keras

    x, y, sw = keras.utils.unpack_x_y_sample_weight(batch)
    xs = as_arrays(x, io.inputs, io.in_names, prefix + "x")
    ys = [] if y is None or not targets else as_arrays(y, io.outputs, io.out_names,
                                                       prefix + "y", io.labelled)
    sws = sample_weights(sw, class_weight, ys, io.out_names) if ys else None
    num_samples(xs, ys)
    return xs, ys, sws


class PythonData(Stream):
    """Batches made by Python code on every rank; each turns them into arrays, keeps its share.

    Args:
        share: what this rank takes (`data.Share`).
        io: the model's `data.ModelIO`.
        class_weight: mapped into sample weights (PyDataset), or None.
        targets: whether y is read (not to predict).
        check: the every-rank-read-the-same-batch check (`Stream`), or None.
    """

    def __init__(self, share, io, class_weight=None, targets=True, check=None):
        super().__init__(share, check)
        self.io, self.class_weight, self.targets = io, class_weight, targets

    def _select(self, batch):
        import keras

        xs, ys, sws = arrays_of(batch, self.io, self.class_weight, self.targets)
        size = count(xs[0])
        sws = [np.ones(size, keras.backend.floatx()) if w is None else w
               for w in sws] if sws else []
        checksum = sum(total(a) for a in xs + ys + sws)
        s = self.share
        start, stop = share_bounds(size, s)
        take = [xs[p][start:stop] for p in s.positions]
        mine = s.targets and bool(ys)
        return (size, checksum, take, [t[start:stop] for t in ys] if mine else [],
                [w[start:stop] for w in sws] if mine else [])


class GeneratorData(PythonData):
    """A Python generator of global batches, read as Model.fit reads it.

    Every pass starts with the batches read ahead to check them (`peek`), then
    goes on where the generator is: a finite generator feeds one epoch, and the
    next ones get the read-ahead batches and run out, as in `Model.fit`.
    """

    def __init__(self, passes, share, io, targets=True, check=None):
        super().__init__(share, io, None, targets, check)
        self._passes = passes

    def _elements(self, p):
        return (self._select(batch) for batch in self._passes())


class PyDatasetData(PythonData):
    """A keras.utils.PyDataset of global batches, read with its workers as Model.fit reads it.

    The batch order of a pass is 0, 1, … or, with `shuffle`, a permutation drawn
    from the call's seed and the pass (the same on every rank: Model.fit
    shuffles with Python's global `random`, which ranks do not share). Items
    are fetched ahead by `workers` threads, or processes with
    `use_multiprocessing`, at most `max_queue_size` ahead, in order. The
    dataset's `on_epoch_begin`/`on_epoch_end` run at Keras' moments.
    """

    def __init__(self, dataset, share, io, class_weight=None, shuffle=False, seed=0,
                 targets=True, check=None):
        super().__init__(share, io, class_weight, targets, check)
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.num_batches = dataset.num_batches

    def _elements(self, p):
        n = self.num_batches
        if n is None:
            order = itertools.count()
        elif self.shuffle:
            order = np.random.default_rng([self.seed, p]).permutation(n).tolist()
        else:
            order = range(n)
        return (self._select(standardized(item)) for item in fetched(self.dataset, order))

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()


_WORKER_DATASET = None  # a worker process's copy of the PyDataset it reads


def _install(dataset):
    global _WORKER_DATASET
    _WORKER_DATASET = dataset


def _item(i):
    return _WORKER_DATASET[i]


def fetched(dataset, order):
    """dataset[i] for i in `order`, in order, fetched ahead by the dataset's workers."""
    workers, processes = dataset.workers, dataset.use_multiprocessing
    if not (workers > 1 or (workers > 0 and processes)):
        yield from (dataset[i] for i in order)
        return
    if processes:
        pool = multiprocessing.Pool(workers, initializer=_install, initargs=(dataset,))

        def submit(i):
            return pool.apply_async(_item, (i,))

        def close():
            pool.terminate()
            pool.join()
    else:
        pool = ThreadPoolExecutor(workers, thread_name_prefix="hyparflow-pydataset")

        def submit(i):
            return pool.submit(dataset.__getitem__, i)

        def close():
            pool.shutdown(cancel_futures=True)
    indices = iter(order)
    pending = collections.deque(submit(i) for i in itertools.islice(
        indices, max(1, dataset.max_queue_size)))
    try:
        while pending:
            future = pending.popleft()
            nxt = next(indices, None)
            if nxt is not None:
                pending.append(submit(nxt))
            yield future.get() if processes else future.result()
    finally:
        close()
