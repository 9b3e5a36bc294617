"""Every kind of input Model.fit accepts trains in hf.fit as in model.fit: Python generators,
keras.utils.PyDataset (with workers), and their errors."""

import keras
import numpy as np
import pytest

import custom_models as cm
import hyparflow as hf

X, Y = cm.data(cm.SAMPLES + 8)  # 72 samples: a last batch of 8
VX, VY = cm.data(24, seed=1)


def test_a_generator_trains_like_model_fit_and_runs_out_as_model_fit_does():
    # A finite generator feeds one epoch; Keras warns and the second epoch has no data.
    ref, model = cm.twins("plain")
    args = dict(epochs=2, verbose=0, validation_data=(VX, VY))
    with pytest.warns(UserWarning, match="ran out of data"):
        ha = ref.fit(cm.generator(X, Y), **args)
    with pytest.warns(UserWarning, match="ran out of data"):
        hb = hf.fit(model, cm.generator(X, Y), **args)
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)


def test_an_endless_generator_with_steps_per_epoch_and_a_generator_to_validate():
    ref, model = cm.twins("plain")
    args = dict(epochs=3, steps_per_epoch=3, verbose=0, validation_steps=2)
    ha = ref.fit(cm.generator(X, Y, repeat=True), **args,
                 validation_data=cm.generator(VX, VY, 8, repeat=True))
    hb = hf.fit(model, cm.generator(X, Y, repeat=True), **args,
                validation_data=cm.generator(VX, VY, 8, repeat=True))
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)
    want = ref.evaluate(cm.generator(VX, VY, 10), verbose=0, return_dict=True)
    got = hf.evaluate(model, cm.generator(VX, VY, 10), verbose=0, return_dict=True)
    assert got == pytest.approx(want, rel=cm.RTOL)
    np.testing.assert_allclose(hf.predict(model, cm.generator(VX, batch_size=10), verbose=0),
                               ref.predict(cm.generator(VX, batch_size=10), verbose=0),
                               rtol=cm.RTOL, atol=cm.ATOL)


@pytest.mark.parametrize("workers, multiprocessing", [(0, False), (2, False), (2, True)])
def test_a_py_dataset_trains_like_model_fit(workers, multiprocessing):
    ref, model = cm.twins("plain")
    args = dict(epochs=2, verbose=0, shuffle=False)

    def batches():
        return cm.Batches(X, Y, workers=workers, use_multiprocessing=multiprocessing)

    a, b = batches(), batches()
    ha = ref.fit(a, validation_data=cm.Batches(VX, VY, 10), **args)
    hb = hf.fit(model, b, validation_data=cm.Batches(VX, VY, 10), **args)
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)
    if not multiprocessing:  # (the hooks then run in the workers' copies)
        # Model.fit: on_epoch_begin per epoch; on_epoch_end per epoch and once as it starts
        assert (b.begun, b.ended) == (a.begun, a.ended) == (2, 3)
    want = ref.evaluate(cm.Batches(VX, VY, 10), verbose=0)
    assert hf.evaluate(model, cm.Batches(VX, VY, 10), verbose=0) == pytest.approx(want,
                                                                                 rel=cm.RTOL)
    np.testing.assert_allclose(hf.predict(model, cm.Batches(VX, None, 10), verbose=0),
                               ref.predict(cm.Batches(VX, None, 10), verbose=0),
                               rtol=cm.RTOL, atol=cm.ATOL)


def test_a_shuffled_py_dataset_reads_every_batch_once_per_epoch_in_a_new_order():
    class Seen(cm.Batches):
        def __getitem__(self, i):
            self.order.append(i)
            return super().__getitem__(i)

    def orders(seed):
        data = Seen(X, Y)
        data.order = []
        keras.utils.set_random_seed(seed)  # hf.fit shuffles from it, as Model.fit does
        hf.fit(cm.build("plain"), data, epochs=2, verbose=0)  # shuffle=True: the default
        n = len(data)
        return data.order[-2 * n:-n], data.order[-n:]

    first, second = orders(5)
    assert sorted(first) == sorted(second) == list(range(len(Seen(X, Y))))
    assert first != second
    assert orders(5) == (first, second) and orders(6) != (first, second)


def test_fit_has_no_seed_of_its_own():
    # the shuffling seed is keras.utils.set_random_seed's (else rank 0's draw): Model.fit has
    # no seed argument either
    import inspect

    assert "seed" not in inspect.signature(hf.fit).parameters


def test_dict_inputs_from_a_generator():
    inputs = {"a": keras.Input((2,), name="a"), "b": keras.Input((4,), name="b")}
    h = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    out = keras.layers.Dense(3, activation="softmax", name="probs")(h)
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(1)
        m = keras.Model(inputs, out)
        m.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy")
        models.append(m)

    def gen():
        for k in range(0, len(X), 16):
            yield {"b": X[k:k + 16, 2:], "a": X[k:k + 16, :2]}, Y[k:k + 16]

    models[0].fit(gen(), verbose=0)
    hf.fit(models[1], gen(), verbose=0)
    cm.same_weights(*models)


@pytest.mark.parametrize("data, kwargs, message", [
    (lambda: cm.generator(X, Y), dict(y=Y), "`y` should not be passed"),
    (lambda: cm.generator(X, Y), dict(class_weight={0: 1.0}), "class_weight"),
    (lambda: (x for x in [X[:4]]), {}, "must return a tuple"),
    (lambda: (x for x in []), {}, "must yield at least one batch"),
    (lambda: cm.Batches(X, Y), dict(sample_weight=np.ones(len(X))),
     "`sample_weights` should not be passed"),
    (lambda: cm.generator(X, Y), dict(validation_split=0.5), "validation_split"),
    (lambda: cm.generator(X, None), {}, "needs (inputs, targets)"),
])
def test_bad_python_inputs_are_clear_errors(data, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("`", "`")):
        hf.fit(cm.build("plain"), data(), verbose=0, **kwargs)


@pytest.mark.parametrize("kind", ["scipy", "tf.sparse", "ragged"])
def test_sparse_and_ragged_inputs_train_as_model_fit(kind):
    # hf.fit refused them: "x for input … has dtype object".
    (ref, x, y), (model, _, _) = cm.sparse_case(kind), cm.sparse_case(kind)
    args = dict(batch_size=16, epochs=2, verbose=0, shuffle=False,
                validation_split=0.25)
    ha, hb = ref.fit(x, y, **args), hf.fit(model, x, y, **args)
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)
    np.testing.assert_allclose(hf.predict(model, x, verbose=0), ref.predict(x, verbose=0),
                               rtol=cm.RTOL, atol=cm.ATOL)

    def batches():  # the same from a generator
        for k in range(0, 72, 16):
            yield data_take(x, k, k + 16), y[k:k + 16]

    np.testing.assert_allclose(hf.evaluate(model, batches(), verbose=0),
                               ref.evaluate(batches(), verbose=0), rtol=cm.RTOL)


@pytest.mark.parametrize("kind", ["tf.sparse", "ragged"])
def test_sparse_and_ragged_tensors_in_a_tf_data_dataset(kind):
    # hf.fit failed inside the dataset's map (a SparseTensor cannot be sliced or summed).
    import tensorflow as tf

    (ref, x, y), (model, _, _) = cm.sparse_case(kind), cm.sparse_case(kind)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    args = dict(epochs=2, verbose=0, validation_data=dataset.take(2))
    ha, hb = ref.fit(dataset, **args), hf.fit(model, dataset, **args)
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)
    inputs = dataset.map(lambda a, b: a)
    np.testing.assert_allclose(hf.predict(model, inputs, verbose=0),
                               ref.predict(inputs, verbose=0), rtol=cm.RTOL, atol=cm.ATOL)


def data_take(x, start, stop):
    import tensorflow as tf

    return tf.sparse.slice(x, [start, 0], [stop - start, x.shape[1]]) if isinstance(
        x, tf.SparseTensor) else x[start:stop]


def test_a_cut_through_a_ragged_tensor_is_a_clear_error():
    model, _, _ = cm.sparse_case("ragged")
    with pytest.raises(ValueError, match="cuts model .* after 'embedding.*', a ragged tensor: "
                                         "stages exchange dense tensors only"):
        hf.partition(model, 2, balance=[1, 3])


def test_ragged_targets_train_and_sparse_targets_are_one_clear_error():
    # Keras' trainer test with ragged x and y (a TypeError from indexing a RaggedTensor,
    # then a refusal: "pad the targets"): trains as model.fit, its predictions ragged
    import scipy.sparse
    import tensorflow as tf

    class Twice(keras.Model):
        def call(self, x):
            return x * 2

    model = Twice()
    model.compile("sgd", lambda y, y_pred, sample_weight=None: 0.0)
    x = tf.ragged.constant([[1.0], [2.0, 3.0]])
    assert hf.fit(model, x, x, verbose=0).history["loss"] == [0.0]
    predicted = hf.predict(model, x, verbose=0)
    assert isinstance(predicted, tf.RaggedTensor)
    np.testing.assert_array_equal(predicted.flat_values.numpy(), [2.0, 4.0, 6.0])
    dense = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])
    dense.compile("sgd", "mse")
    with pytest.raises(ValueError, match="is a sparse matrix; .* sparse.toarray"):
        hf.fit(dense, np.ones((4, 3)), scipy.sparse.csr_matrix(np.eye(4, 3)), verbose=0)


@pytest.mark.parametrize("kind", ["gan", "on_inputs"])
def test_a_tf_data_dataset_of_inputs_alone_for_a_model_s_own_loss(kind):
    # A GAN's train_step, or a compute_loss reading x, needs no targets: hf.fit refused such a
    # dataset ("yields only inputs").
    import tensorflow as tf

    ref, model = cm.twins(kind)
    dataset = tf.data.Dataset.from_tensor_slices(cm.data()[0]).batch(cm.BATCH)
    ha = ref.fit(dataset, epochs=2, verbose=0)
    hb = hf.fit(model, dataset, epochs=2, verbose=0)
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)
