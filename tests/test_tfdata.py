"""hf.fit, evaluate and predict read tf.data datasets
as Model.fit does; bad datasets fail clearly."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
import models
from test_fit import _assert_same, _multi_output, _multi_output_compile, _pair


def _data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = {"cls": rng.integers(0, 3, n), "reg": rng.normal(size=(n, 1)).astype("float32")}
    return x, y, rng.uniform(0.2, 2.0, n).astype("float32")


def test_a_dataset_of_weighted_batches_trains_like_model_fit_with_validation():
    x, y, sw = _data(64)
    xv, yv, _ = _data(24, seed=1)
    train = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(16)
    val = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(8)
    a, b = _pair(_multi_output, _multi_output_compile)
    ha = a.fit(train, epochs=3, verbose=0, validation_data=val)
    hb = hf.fit(b, train, epochs=3, verbose=0, validation_data=val)
    assert "val_cls_accuracy" in hb.history
    _assert_same(a, b, ha, hb)
    for kwargs in ({}, dict(steps=2)):
        ours = hf.evaluate(b, val, verbose=0, return_dict=True, **kwargs)
        theirs = a.evaluate(val, verbose=0, return_dict=True, **kwargs)
        for k in theirs:
            np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, err_msg=k)
    inputs_only = tf.data.Dataset.from_tensor_slices(xv).batch(5)  # last batch smaller
    ours, theirs = hf.predict(b, inputs_only, verbose=0), a.predict(inputs_only, verbose=0)
    for k in theirs:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5)


def test_batch_size_none_takes_a_datasets_own_batches_and_arrays_in_32s_as_model_fit():
    # hf.fit(dataset, batch_size=None), as Keras' guides write it, was refused
    x, y, sw = _data(70)
    train = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(16)
    a, b = _pair(_multi_output, _multi_output_compile)
    ha = a.fit(train, batch_size=None, epochs=2, verbose=0)
    hb = hf.fit(b, train, batch_size=None, epochs=2, verbose=0)
    _assert_same(a, b, ha, hb)
    ours = hf.evaluate(b, train, batch_size=None, verbose=0, return_dict=True)
    theirs = a.evaluate(train, batch_size=None, verbose=0, return_dict=True)
    for k in theirs:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, err_msg=k)
    a, b = _pair(_multi_output, _multi_output_compile)  # arrays: Keras' 32 a batch
    ha = a.fit(x, y, batch_size=None, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=None, epochs=2, shuffle=False, verbose=0)
    _assert_same(a, b, ha, hb)
    np.testing.assert_allclose(hf.predict(b, x, batch_size=None, verbose=0)["cls"],
                               a.predict(x, batch_size=None, verbose=0)["cls"], rtol=1e-5)


def test_class_weight_and_steps_per_epoch_on_a_repeated_dataset_match_model_fit():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(48, 5)).astype("float32"), rng.integers(0, 3, 48)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(12).repeat()
    a, b = _pair(models.residual, lambda: dict(optimizer="adam",
                                               loss="sparse_categorical_crossentropy",
                                               metrics=["accuracy"]))
    kwargs = dict(epochs=3, steps_per_epoch=5, verbose=0, class_weight={0: 2.0, 2: 0.5})
    _assert_same(a, b, a.fit(data, **kwargs), hf.fit(b, data, **kwargs))


def test_dict_inputs_in_a_dataset():
    rng = np.random.default_rng(4)
    x = {"a": rng.normal(size=(24, 5)).astype("float32"),
         "b": rng.normal(size=(24, 3)).astype("float32")}
    y = {"cls": rng.integers(0, 3, 24), "reg": rng.normal(size=(24, 2)).astype("float32")}
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

    def compile_kwargs():
        return dict(optimizer="sgd", loss={"cls": "sparse_categorical_crossentropy",
                                           "reg": "mse"})

    a, b = _pair(models.multi_io, compile_kwargs)
    _assert_same(a, b, a.fit(data, epochs=2, verbose=0), hf.fit(b, data, epochs=2, verbose=0))


X = np.zeros((20, 5), np.float32)
Y = np.zeros((20, 3), np.float32)


def _compiled():
    m = models.chain(n=2)
    m.compile(optimizer="sgd", loss="mse")
    return m


@pytest.mark.parametrize("data, kwargs, message", [
    (tf.data.Dataset.from_tensor_slices((X, Y)).batch(4), dict(y=Y),
     r"When providing `x` as a tf.data.Dataset, `y` should not be passed"),
    (tf.data.Dataset.from_tensor_slices((X, Y)).batch(4), dict(validation_split=0.2),
     r"`validation_split` is only supported for tensors or NumPy arrays"),
    (tf.data.Dataset.from_tensor_slices((X, Y)), {},
     r"yields single samples of shape \(5,\) for input 'x'; .* Batch it: dataset.batch"),
    (tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat(), {},
     r"repeats forever; give steps_per_epoch"),
    (tf.data.Dataset.from_tensor_slices(X).batch(4), {},
     r"yields only inputs; hf.fit needs \(inputs, targets\)"),
    (tf.data.Dataset.from_tensor_slices((X[:, :4], Y)).batch(4), {},
     r"yields batches of shape \(None, 4\) for input 'x', but the model expects \(None, 5\)"),
])
def test_bad_datasets_are_clear_errors(data, kwargs, message):
    with pytest.raises(ValueError, match=message):
        hf.fit(_compiled(), data, verbose=0, **kwargs)


def test_a_seeded_reshuffling_dataset_gives_the_batches_model_fit_reads_every_epoch():
    # Keras starts a new pass over a dataset at set moments (also an extra one after
    # each epoch), and a seeded shuffle draws a new order at every pass: with a zero
    # model and no learning, each step's loss names the batch it read.
    x, y = np.zeros((32, 1), "float32"), np.arange(32, dtype="float32")[:, None]
    losses = {}
    for name in ("keras", "hf"):
        model = keras.Sequential([keras.Input((1,)),
                                  keras.layers.Dense(1, kernel_initializer="zeros")])
        model.compile(keras.optimizers.SGD(0.0), "mse")
        seen = losses.setdefault(name, [])
        cb = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs, seen=seen: seen.append(logs["loss"]))
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(32, seed=11).batch(8)
        fit = model.fit if name == "keras" else (lambda *a, **k: hf.fit(model, *a, **k))
        fit(data, epochs=3, verbose=0, callbacks=[cb])
    assert losses["hf"] == pytest.approx(losses["keras"], rel=1e-6)
    assert len(set(np.round(losses["hf"][::4], 3))) == 3  # three different first batches
