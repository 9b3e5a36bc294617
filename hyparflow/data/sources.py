"""The data a call reads: one small class per kind of input Model.fit accepts,
chosen by the input's type as Keras' data adapters are."""

import math
import types
import warnings

import numpy as np

from hyparflow.data import batches as data_
from hyparflow.data import pydata, tfdata
from hyparflow.data.batches import Structure


class Source:
    """What a call needs of its input, whatever its kind; checked on every rank before any message.

    Attributes:
        kind: what the input is, for messages.
        sample: (xs, ys, sws): the first sample of each array in the model's
            order (sws None when unweighted), to build the model and to agree.
        structures: (x, y, sample_weight) `data.Structure`s, as the user gave
            them (the model's own steps take them so).
        size: what the ranks must agree on before reading: the number of
            samples of arrays, of batches of a stream (None when unknown).
        batch_size: the global batch the input fixes (a dataset's first), or None.
        streamed: read batch by batch, each batch's micro-batches by default
            for its size, every batch compared across ranks as it is read.
        advice: how to make every rank read the same batches (streams).
    """

    streamed = True
    batch_size = None
    size = None
    advice = ""

    def agreed(self):
        """What every rank's input must share, by name (a part of the call's fingerprint)."""
        xs, ys, sws = self.sample
        return {
            "input shapes and dtypes": [(a.shape[1:], str(a.dtype)) for a in xs],
            "target shapes and dtypes": [(a.shape[1:], str(a.dtype)) for a in ys],
            "sample weights": None if sws is None else [
                None if w is None else w.shape[1:] for w in sws],
        }

    def data(self, share, batch_size, shuffle, seed, check):
        """This rank's `Stream` (or `ArrayData`) for a `data.Feed`.

        Args:
            share: what this rank takes (`data.Share`).
            batch_size, shuffle, seed: the call's (arrays).
            check: the every-rank-read-the-same-batch check (streams), or None.
        """
        raise NotImplementedError


def structures(x, y, sample_weight, class_weight, in_names, out_names):
    """The (x, y, sample_weight) `Structure`s of an input as the user gave it; class weights
    reach the model's steps as one array of sample weights, as Keras passes them."""
    weights = Structure("single") if class_weight is not None else Structure.of(
        sample_weight, out_names)
    return Structure.of(x, in_names), Structure.of(y, out_names), weights


def _first(arrays):
    return None if arrays is None else [None if a is None else a[:1] for a in arrays]


def check_shapes(xs, io, prefix=""):
    """Each input array's samples against the model's input shape (None dimensions free)."""
    for a, t, name in zip(xs, io.inputs or [], io.in_names or []):
        if isinstance(a, np.ndarray) and data_.is_text(a) and str(t.dtype) != "string":
            raise ValueError(
                f"{prefix}x for input {name!r} holds strings ({a.dtype}), but the model's "
                f"input {name!r} takes {t.dtype} numbers. Give it numbers, or give the "
                "model a string input (keras.Input(shape=(), dtype='string')) and a layer "
                "that reads text: TextVectorization, StringLookup or Hashing.")
        want = tuple(t.shape[1:])
        if len(a.shape) != len(t.shape) or any(
                w is not None and w != g for w, g in zip(want, a.shape[1:])):
            raise ValueError(f"{prefix}x for input {name!r} has samples of shape "
                             f"{a.shape[1:]}, but the model expects {want}.")


class Arrays(Source):
    """Numpy arrays (or lists and dicts of them, or tensors), cut into batches by index."""

    streamed = False
    kind = "numpy arrays"

    def __init__(self, x, y, sw, structures):
        self.x, self.y, self.sw, self.structures = x, y, sw, structures
        self.size = data_.count(x[0])
        self.sample = (_first(x), _first(y), _first(sw))

    @classmethod
    def checked(cls, io, x, y, sample_weight, class_weight, mode, own=False, prefix=""):
        """The user's arrays, checked against the model. With `own` (the model's own steps
        run) or a model whose own loss logic may not read targets, y may be None, as
        Model.fit allows."""
        xs = data_.as_arrays(x, io.inputs, io.in_names, prefix + "x")
        # The model's own steps take y as given; the stages, one target per output.
        y_io = data_.ModelIO(None, None, None, None) if own else io
        no_y = mode == "predict" or ((own or io.y_optional) and y is None)
        if no_y and mode != "predict" and (sample_weight is not None or class_weight):
            raise ValueError(
                f"{prefix}{'sample_weight' if sample_weight is not None else 'class_weight'} "
                f"without y: hyparflow passes weights with targets only. Give y too, or "
                "weigh the samples inside the model's compute_loss.")
        ys = [] if no_y else data_.as_arrays(y, y_io.outputs, y_io.out_names, prefix + "y",
                                             y_io.labelled)
        sw = None
        if mode != "predict":
            sw = data_.sample_weights(sample_weight, class_weight, ys, io.out_names)
        data_.num_samples(xs, ys)
        check_shapes(xs, io, prefix)
        return cls(xs, ys, sw, structures(x, y, sample_weight, class_weight, io.in_names,
                                          y_io.out_names))

    def agreed(self):
        # Contents too: ranks that shuffled or loaded their arrays differently would
        # feed stage 0's inputs and the last stage's targets from different samples.
        return {**super().agreed(), "data checksums": [
            None if a is None else data_.total(a)
            for part in (self.x, self.y, self.sw) if part is not None for a in part]}

    def data(self, share, batch_size, shuffle, seed, check):
        return data_.ArrayData(self.x, self.y, self.sw, batch_size, share, shuffle, seed)

    def split(self, fraction, class_weight):
        """Model.fit's split: the last `fraction` of the samples, before any shuffling; class
        weights weigh the training part only."""
        n = self.size
        at = int(math.floor(n * (1.0 - fraction)))
        if at in (0, n):
            raise ValueError(
                f"Training data contains {n} samples, which is not sufficient to split it "
                "into a validation and training set as specified by "
                f"`validation_split={fraction}`. Either provide more data, or a different "
                "value for the `validation_split` argument.")

        def cut(arrays, part):
            return None if arrays is None else [None if a is None else data_.take(a, part)
                                                for a in arrays]

        head, tail = slice(None, at), slice(at, None)
        train_sw = cut(self.sw, head)
        if class_weight is not None:
            train_sw = data_.sample_weights(None, class_weight, cut(self.y, head), None)
        x_s, y_s, w_s = self.structures
        return (Arrays(cut(self.x, head), cut(self.y, head), train_sw, (
            x_s, y_s, Structure("single") if class_weight is not None else w_s)),
                Arrays(cut(self.x, tail), cut(self.y, tail), cut(self.sw, tail),
                       self.structures))


class TFDataset(Source):
    """A tf.data.Dataset of global batches (`tfdata`)."""

    kind = "tf.data.Dataset"
    advice = ("seed its shuffle (dataset.shuffle(n, seed=...)) and do not shard it per rank "
              "— hyparflow gives each replica its share of every batch.")

    def __init__(self, io, dataset, mode, class_weight, steps, prefix, steps_name, own):
        import keras

        self.io = io
        self.checked = tfdata.checked(dataset, io, mode, class_weight, steps, prefix,
                                      steps_name, own)
        self.sample = (self.checked.x_probe, self.checked.y_probe, None)
        self.size, self.batch_size = self.checked.batches, self.checked.batch_size
        x, y, sw = keras.utils.unpack_x_y_sample_weight(dataset.element_spec)
        self.structures = structures(x, y, sw, class_weight, io.in_names, io.out_names)

    def data(self, share, batch_size, shuffle, seed, check):
        return tfdata.DatasetData(self.checked.dataset, share, self.io.in_names or [],
                                  self.io.out_names or [], check)


class _Python(Source):
    """A source of batches that Python code makes: checked on its first batch."""

    def _first_batch(self, batch, io, mode, own, prefix, class_weight=None):
        import keras

        self.io, self.targets = io, mode != "predict"
        xs, ys, sws = pydata.arrays_of(batch, io, class_weight, self.targets, prefix)
        if self.targets and not ys and not (own or io.y_optional):
            raise ValueError(f"{prefix}x (a {self.kind}) yields only inputs; hf.{mode} "
                             "needs (inputs, targets) or (inputs, targets, sample_weights) "
                             "batches, as Model.fit does.")
        check_shapes(xs, io, prefix)
        self.batch_size = data_.count(xs[0])
        self.sample = (_first(xs), _first(ys), _first(sws))
        x, y, sw = keras.utils.unpack_x_y_sample_weight(batch)
        self.structures = structures(x, y, sw, class_weight, io.in_names, io.out_names)


class Generator(_Python):
    """A Python generator of global batches (`pydata.GeneratorData`)."""

    kind = "Python generator"
    advice = ("make it yield the same batches on every rank (seed any randomness alike) and "
              "do not shard it per rank — hyparflow gives each replica its share of every "
              "batch.")

    def __init__(self, io, generator, mode, own, prefix):
        first, self._passes = pydata.peek(generator)
        self._first_batch(first[0], io, mode, own, prefix)

    def data(self, share, batch_size, shuffle, seed, check):
        return pydata.GeneratorData(self._passes, share, self.io, self.targets, check)


class PyDataset(_Python):
    """A keras.utils.PyDataset of global batches (`pydata.PyDatasetData`)."""

    kind = "keras.utils.PyDataset"
    advice = ("make __getitem__ return the same batch for an index on every rank (seed any "
              "randomness alike, in on_epoch_end too) and do not shard it per rank — "
              "hyparflow gives each replica its share of every batch.")

    def __init__(self, io, dataset, mode, class_weight, own, prefix):
        self.dataset, self.class_weight = dataset, class_weight
        self.size = dataset.num_batches
        if self.size == 0:
            raise ValueError(f"{prefix}x: the PyDataset has length 0.")
        self._first_batch(pydata.standardized(dataset[0]), io, mode, own, prefix, class_weight)

    def data(self, share, batch_size, shuffle, seed, check):
        return pydata.PyDatasetData(self.dataset, share, self.io, self.class_weight, shuffle,
                                    seed, self.targets, check)


def unsplittable(x):
    """Keras' error for `validation_split` with an input that cannot be sliced."""
    return ValueError("Argument `validation_split` is only supported for tensors or NumPy "
                      f"arrays. Found incompatible type in the input: {type(x).__name__}. Pass "
                      "validation_data instead.")


def _unsupported(arg, description, kind):
    """Keras' error for an argument that an input of `kind` carries itself."""
    return ValueError(f"When providing `x` as a {kind}, `{arg}` should not be passed. Instead, "
                      f"{description} should be included as part of the {kind}.")


def streamed(x):
    """Whether `x` is read batch by batch (a dataset, a generator or a PyDataset)."""
    import keras

    return tfdata.is_dataset(x) or isinstance(x, (keras.utils.PyDataset, types.GeneratorType))


def source_of(io, x, y=None, sample_weight=None, class_weight=None, mode="fit", *,
              shuffle=False, steps=None, own=False, prefix="", steps_name=None):
    """The Source for the user's `x` (and `y`, `sample_weight`), by its type, as Keras chooses
    its data adapter; Keras' errors for arguments the input carries itself.

    Args:
        io: the model's `data.ModelIO`.
        mode: "fit", "evaluate" or "predict".
        shuffle: fit's, for Keras' warning that a stream ignores it.
        steps: steps_per_epoch or steps (an endless dataset needs them).
        own: the model's own steps run (y may be missing).
        prefix, steps_name: for messages about validation data.
    """
    import keras

    kinds = ((tfdata.is_dataset, "tf.data.Dataset"),
             (lambda v: isinstance(v, keras.utils.PyDataset), "PyDataset"),
             (lambda v: isinstance(v, types.GeneratorType), "generator"))
    for test, kind in kinds:
        if not test(x):
            continue
        if y is not None:
            raise _unsupported("y", "the targets", kind)
        if sample_weight is not None:
            raise _unsupported("sample_weights", "the sample weights", kind)
        if kind == "generator" and class_weight is not None:
            raise ValueError("Argument `class_weight` is not supported for Python generator "
                             f"inputs. Received: class_weight={class_weight}")
        endless = kind == "PyDataset" and x.num_batches is None
        if shuffle and mode == "fit" and (kind != "PyDataset" or endless):
            warnings.warn(
                f"`shuffle=True` was passed, but will be ignored since the data `x` was "
                f"provided as a{'n infinite' if endless else ''} {kind}. It is expected to "
                "yield already-shuffled data.", stacklevel=5)
        if kind == "tf.data.Dataset":
            return TFDataset(io, x, mode, class_weight, steps, prefix, steps_name, own)
        if kind == "PyDataset":
            return PyDataset(io, x, mode, class_weight, own, prefix)
        return Generator(io, x, mode, own, prefix)
    return Arrays.checked(io, x, y, sample_weight, class_weight, mode, own, prefix)
