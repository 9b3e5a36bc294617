"""Global batches read from a tf.data.Dataset, each rank materialising only its own share."""

import numpy as np

from hyparflow.data.batches import Stream, check_class_weight, sparse_or_ragged
from hyparflow.keras import keras_private


class Checked:
    """A checked tf.data input: the dataset, and one-sample arrays shaped like its elements."""

    def __init__(self, dataset, x_probe, y_probe, batches, batch_size):
        self.dataset, self.x_probe, self.y_probe = dataset, x_probe, y_probe
        self.batches, self.batch_size = batches, batch_size


def is_dataset(x):
    """Whether `x` is a tf.data.Dataset (as Keras tells)."""
    return keras_private.is_tf_dataset(x)


def checked(dataset, io, mode, class_weight=None, steps=None, prefix="", steps_name=None,
            own=False):
    """Check a dataset's elements against the model before any message; returns a `Checked`.

    Args:
        dataset: the user's tf.data.Dataset of global batches.
        io: the model's `data.ModelIO`.
        mode: "fit", "evaluate" or "predict".
        class_weight: mapped into the dataset as Model.fit does.
        steps: steps_per_epoch (fit) or steps: required for an endless dataset.
        prefix: for messages about validation_data.
        steps_name: the argument `steps` came from, for messages.
        own: the model's own steps run (elements may hold inputs only, as for a model
            whose own loss logic needs no targets: `io.y_optional`).
    """
    import keras

    inputs, outputs, in_names, out_names = io.inputs, io.outputs, io.in_names, io.out_names
    if class_weight is not None:
        check_class_weight(class_weight)
        dataset = dataset.map(keras_private.class_weight_map_fn(class_weight))
    spec = dataset.element_spec
    x_spec, y_spec, _ = keras.utils.unpack_x_y_sample_weight(spec)
    what = f"{prefix}x (a tf.data.Dataset)"
    if inputs is None and isinstance(x_spec, dict):
        raise ValueError(f"{what} yields dicts of inputs, but a subclassed model has no input "
                         "names to match them to; yield a tensor or a tuple in the order the "
                         "model's call takes them.")
    if mode != "predict" and y_spec is None and not (own or io.y_optional):
        raise ValueError(f"{what} yields only inputs; hf.{mode} needs (inputs, targets) or "
                         "(inputs, targets, sample_weights) elements, as Model.fit does.")
    x_probe = _probes(x_spec, inputs, in_names, "input", what)
    y_probe = [] if mode == "predict" or y_spec is None else _probes(
        y_spec, outputs, out_names, "output", what)
    cardinality = int(dataset.cardinality())
    if cardinality == -1 and steps is None:  # tf.data.INFINITE_CARDINALITY
        raise ValueError(
            f"{what} repeats forever; give "
            f"{steps_name or ('steps_per_epoch' if mode == 'fit' else 'steps')} so that an "
            "epoch ends.")
    first = flat_components(x_spec, in_names or [])[0]
    return Checked(dataset, x_probe, y_probe, cardinality if cardinality >= 0 else None,
                   first.shape[0])


def _probes(specs, tensors, names, kind, what):
    """Check one side (inputs or targets) of a dataset's elements; one-sample zero arrays."""
    import keras

    probes = []
    flat = flat_components(specs, names or [])
    if isinstance(specs, dict) and any(s is None for s in flat):
        missing = [n for n, s in zip(names, flat) if s is None]
        raise ValueError(f"{what} yields dicts with keys {sorted(specs)}, but the model's "
                         f"{kind}s are named {names}; add {missing}.")
    if tensors is not None and len(flat) != len(tensors):
        raise ValueError(f"{what} yields {len(flat)} {kind} tensors, but the model has "
                         f"{len(tensors)} {kind}s ({names}).")
    for j, s in enumerate(flat):
        name = names[j] if names else str(j)
        if kind == "output" and type(s).__name__ in ("SparseTensorSpec", "RaggedTensorSpec"):
            raise ValueError(f"{what} yields {type(s).__name__[:-4]}s for {kind} {name!r}; "
                             "hyparflow takes dense targets (tf.sparse.to_dense(y), "
                             "y.to_tensor()).")
        if type(s).__name__ == "SparseTensorSpec" and len(s.shape) != 2:
            raise ValueError(f"{what} yields {len(s.shape)}-D tf.SparseTensors for {kind} "
                             f"{name!r}; hyparflow takes 2-D sparse inputs (samples × "
                             "features).")
        text = s.dtype.name == "string" and kind == "input"  # for the model's text layers
        if not s.dtype.is_floating and not s.dtype.is_integer and not s.dtype.is_bool and \
                not text:
            fix = " Map labels that are names to class indices in the dataset (e.g. " \
                "with a keras.layers.StringLookup)." if s.dtype.name == "string" else ""
            raise ValueError(f"{what} yields {s.dtype.name} tensors for {kind} {name!r}; "
                             f"hf takes numbers, and strings as inputs.{fix}")
        if tensors is not None:
            want = tuple(tensors[j].shape)
            got = tuple(s.shape)
            if len(got) == len(want) - 1 and kind == "input":
                raise ValueError(
                    f"{what} yields single samples of shape {got} for {kind} {name!r}; "
                    f"the model takes batches of {want[1:]}. Batch it: "
                    "dataset.batch(batch_size), as for Model.fit.")
            if kind == "input" and (len(got) != len(want) or any(
                    w is not None and g is not None and w != g
                    for w, g in zip(want[1:], got[1:]))):
                raise ValueError(f"{what} yields batches of shape {got} for {kind} "
                                 f"{name!r}, but the model expects {want}.")
        shape = [1] + [d if d is not None else 1 for d in s.shape[1:]]
        if text:
            probes.append(np.full(shape, "", object))
            continue
        dtype = keras.backend.floatx() if s.dtype.is_floating else s.dtype.as_numpy_dtype
        probes.append(np.zeros(shape, dtype))
    return probes


class DatasetData(Stream):
    """A tf.data.Dataset of global batches; each rank materialises only what it reads.

    Every element is one global batch, as `Model.fit` takes a dataset: `(x, y)`,
    `(x, y, sample_weight)` or, to predict, `x`. Every rank iterates the same
    dataset; a map inside the dataset keeps only this rank's replica's share of
    the inputs its stage reads (and of the targets and weights on the last
    stage), so the other replicas' shares never become numpy arrays; it also
    sums the whole batch for the check that every rank read the same (`Stream`).

    Args:
        dataset: the user's dataset (class weights already mapped in).
        share: what this rank takes (`Share`).
        in_names, out_names: the model's input and output names (dict elements).
        check: a callable (size, checksum, k) run for every batch, or None.
    """

    def __init__(self, dataset, share, in_names, out_names, check=None):
        import tensorflow as tf

        super().__init__(share, check)
        cardinality = int(dataset.cardinality())
        self.num_batches = cardinality if cardinality >= 0 else None
        self._in_names, self._out_names = in_names, out_names
        mapped = dataset.map(self._select, num_parallel_calls=tf.data.AUTOTUNE,
                             deterministic=True)
        # Iterated as Model.fit iterates a dataset (through the default strategy), so
        # that a seeded shuffle reshuffles each epoch into the orders Model.fit sees.
        self._mapped = tf.distribute.get_strategy().experimental_distribute_dataset(mapped)

    def _select(self, *element):
        import keras
        import tensorflow as tf

        data = element if len(element) > 1 else element[0]
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        xs = flat_components(x, self._in_names)
        ys = [] if y is None else flat_components(y, self._out_names)
        sws = [] if sw is None or not ys else flat_components(sw, self._out_names, len(ys))

        xs, ys = [_floatx(t) for t in xs], [_floatx(t) for t in ys]
        sws = [tf.ones(_rows(ys[j])[None], keras.backend.floatx()) if w is None
               else tf.cast(w, keras.backend.floatx()) for j, w in enumerate(sws)]
        size = _rows(xs[0])
        checksum = tf.add_n([tf.reduce_sum(_numbers(_values(t))) for t in xs + ys + sws])
        s = self.share
        base, extra = size // s.R, size % s.R
        start = s.replica * base + tf.minimum(s.replica, extra)
        stop = start + base + tf.cast(s.replica < extra, tf.int32)
        take = tuple(_rows_of(xs[p], start, stop) for p in s.positions)
        targets = tuple(_rows_of(t, start, stop) for t in ys) if s.targets else ()
        weights = tuple(t[start:stop] for t in sws) if s.targets else ()
        return size, checksum, take, targets, weights

    def _elements(self, p):
        """The global batches of one pass (the dataset's own order; `p` is not used).

        The dataset's iterator is made at once, as Keras makes it: a seeded
        shuffle draws its next order then, whether or not the pass is read.
        """
        iterator = iter(self._mapped)
        return ((size.numpy(), checksum.numpy(), [_host(t) for t in xs],
                 [_host(t) for t in ys], [_host(t) for t in sws])
                for size, checksum, xs, ys, sws in iterator)


def _floatx(t):
    """A batch's tensor (dense, sparse or ragged) with floats in floatx."""
    import keras
    import tensorflow as tf

    floatx = keras.backend.floatx()
    if isinstance(t, tf.SparseTensor):
        return tf.SparseTensor(t.indices, tf.cast(t.values, floatx), t.dense_shape) \
            if t.dtype.is_floating else t
    if isinstance(t, tf.RaggedTensor):
        return t.with_flat_values(tf.cast(t.flat_values, floatx)) if t.dtype.is_floating else t
    t = tf.convert_to_tensor(t)
    return tf.cast(t, floatx) if t.dtype.is_floating else t


def _rows(t):
    """The number of samples of a dense, sparse or ragged tensor (int32, in the graph)."""
    import tensorflow as tf

    if isinstance(t, tf.SparseTensor):
        return tf.cast(t.dense_shape[0], tf.int32)
    if isinstance(t, tf.RaggedTensor):
        return tf.cast(t.nrows(), tf.int32)
    return tf.shape(t)[0]


def _numbers(t):
    """A tensor's values as float64 for the batch's checksum (strings by a hash of each)."""
    import tensorflow as tf

    if t.dtype == tf.string:
        return tf.cast(tf.strings.to_hash_bucket_fast(t, 2 ** 31 - 1), tf.float64)
    return tf.cast(t, tf.float64)


def _values(t):
    """Every value a tensor holds (a sparse one's stored values, a ragged one's flat values)."""
    import tensorflow as tf

    if isinstance(t, tf.SparseTensor):
        return t.values
    if isinstance(t, tf.RaggedTensor):
        return t.flat_values
    return t


def _rows_of(t, start, stop):
    """Samples start..stop of a dense, sparse or ragged tensor."""
    import tensorflow as tf

    if isinstance(t, tf.SparseTensor):
        begin = tf.concat([[tf.cast(start, tf.int64)], tf.zeros_like(t.dense_shape[1:])], 0)
        return tf.sparse.slice(t, begin, tf.concat([[tf.cast(stop - start, tf.int64)],
                                                    t.dense_shape[1:]], 0))
    return t[start:stop]


def _host(t):
    """A share's tensor as the Stream keeps it: numpy; scipy CSR for a sparse one (sliced
    into micro-batches as for arrays); a ragged one as it is."""
    import tensorflow as tf

    if isinstance(t, tf.SparseTensor):
        return sparse_or_ragged(t, "x", "input")
    if isinstance(t, tf.RaggedTensor):
        return t
    return t.numpy()


def flat_components(data, names, count=None):
    """A batch's x, y or sample weights as a list in model order (dict keyed by name)."""
    if isinstance(data, dict):
        return [data.get(n) for n in names]
    if isinstance(data, (list, tuple)):
        return list(data)
    return [data] * (count or 1)
