"""hf.fit without MPI (partitions = replicas = 1) is model.fit; bad input fails clearly."""

import keras
import numpy as np
import pytest

import hyparflow as hf
import models
from hyparflow import agreement


def _pair(build, compile_kwargs):
    out = []
    for _ in range(2):
        keras.utils.set_random_seed(11)
        m = build()
        m.compile(**compile_kwargs())
        out.append(m)
    return out


def _assert_same(a, b, ha, hb):
    assert sorted(ha.history) == sorted(hb.history)
    for k in ha.history:
        np.testing.assert_allclose(hb.history[k], ha.history[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-6)


def _multi_output():
    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(6, activation="relu", name="h")(x)
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    return keras.Model(x, {"cls": cls, "reg": reg})


@pytest.mark.parametrize("step_graph", [False, True])
def test_single_process_matches_model_fit_including_a_smaller_last_batch(step_graph):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(70, 5)).astype("float32")
    y = rng.integers(0, 3, size=70)
    a, b = _pair(models.residual, lambda: dict(optimizer=keras.optimizers.Adam(1e-2),
                                               loss="sparse_categorical_crossentropy",
                                               metrics=["accuracy"]))
    ha = a.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                schedule=hf.Schedule(step_graph=step_graph))
    _assert_same(a, b, ha, hb)
    assert b.history is hb
    # one stage: each step one function, the update inside (the step graph or not), traced
    # once per batch size (16, and 6 for the last batch)
    executor = b._hyparflow_fit.executor
    assert executor.whole._function.experimental_get_tracing_count() == 2
    assert (executor.step_graph is None or not executor.step_graph._functions)


@pytest.mark.parametrize("partitions", [1, "auto"])
def test_the_zero_bubble_schedule_brings_its_step_graph_without_being_told(partitions):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype("float32")
    y = rng.integers(0, 3, size=40)
    a, b = _pair(models.residual, lambda: dict(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                                               loss="sparse_categorical_crossentropy"))
    ha = a.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, schedule="zb-h1",
                partitions=partitions)
    _assert_same(a, b, ha, hb)
    assert b._hyparflow_fit.executor.step_graph is not None


def test_multi_output_losses_weights_and_metrics_match():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = {"cls": rng.integers(0, 3, size=48), "reg": rng.normal(size=(48, 1))}

    def kwargs():
        return dict(optimizer="sgd", loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                    loss_weights={"cls": 1.0, "reg": 0.5},
                    metrics={"cls": ["accuracy"], "reg": ["mae"]})

    a, b = _pair(_multi_output, kwargs)
    ha = a.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    _assert_same(a, b, ha, hb)


@pytest.mark.parametrize("microbatches, step_graph", [(1, False), (3, False), (3, True)])
def test_each_outputs_loss_counts_each_step_once_as_model_fit_does(microbatches, step_graph):
    # Model.fit weights each update of an output's loss Mean by the batch's static size,
    # unknown for numpy data, so 1: a smaller last batch counts as much as a full one (in
    # training and in the validation after it); hf.fit used to weight it by its size
    rng = np.random.default_rng(2)
    x = rng.normal(size=(50, 4)).astype("float32")
    y = {"cls": rng.integers(0, 3, size=50), "reg": rng.normal(size=(50, 1))}
    xv, yv = x[:21], {k: v[:21] for k, v in y.items()}

    def kwargs():
        return dict(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                    loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                    metrics={"cls": ["accuracy"]})

    a, b = _pair(_multi_output, kwargs)
    ha = a.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0,
               validation_data=(xv, yv), validation_batch_size=8)
    hb = hf.fit(b, x, y, batch_size=12, epochs=2, shuffle=False, verbose=0,
                validation_data=(xv, yv), validation_batch_size=8, microbatches=microbatches,
                schedule=hf.Schedule(step_graph=step_graph))
    _assert_same(a, b, ha, hb)
    assert hb.history["val_reg_loss"] and hb.history["cls_loss"]


def test_regularisation_losses_count_once_per_step():
    def build():
        x = keras.Input((4,), name="x")
        h = keras.layers.Dense(6, activation="relu", kernel_regularizer="l2",
                               activity_regularizer="l1", name="h")(x)
        return keras.Model(x, keras.layers.Dense(2, name="out")(h))

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(32, 4)), rng.normal(size=(32, 2))
    a, b = _pair(build, lambda: dict(optimizer="sgd", loss="mse"))
    ha = a.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    _assert_same(a, b, ha, hb)


def test_subclassed_model_trains_with_one_partition():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.h = keras.layers.Dense(5, activation="tanh")
            self.o = keras.layers.Dense(2)

        def call(self, x):
            return self.o(self.h(x))

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(40, 3)), rng.normal(size=(40, 2))
    a, b = _pair(Net, lambda: dict(optimizer="sgd", loss="mse", metrics=["mae"]))
    a(x[:1]), b(x[:1])
    ha = a.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    _assert_same(a, b, ha, hb)


def test_progress_bar_and_stop_training(capsys):
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(40, 5)), rng.normal(size=(40, 3))
    model = models.chain()
    model.compile(optimizer="sgd", loss="mse")
    stop = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: setattr(model, "stop_training", batch == 1))
    history = hf.fit(model, x, y, batch_size=10, epochs=3, verbose=1, callbacks=[stop])
    assert len(history.history["loss"]) == 1
    assert "Epoch 1/3" in capsys.readouterr().out


def _compiled():
    m = models.chain(n=2)
    m.compile(optimizer="sgd", loss="mse")
    return m


X, Y = np.zeros((20, 5), np.float32), np.zeros((20, 3), np.float32)


@pytest.mark.parametrize("kwargs, message", [
    (dict(partitions=2), r"partitions=2 × replicas=1 needs 2 MPI ranks, but this process is not "
                         r"part of an MPI job. Launch it with `hyparflow-run -n 2 python"),
    (dict(replicas=0), r"replicas=0: must be a whole number ≥ 1"),
    (dict(batch_size=0), r"batch_size=0: must be a whole number ≥ 1"),
    (dict(verbose=3), r"verbose=3: use 'auto', 0, 1 or 2"),
    (dict(microbatches=33, batch_size=32), r"microbatches=33 is larger than each replica's share"),
    (dict(schedule="pipedream"), r"schedule='pipedream' is not a schedule; use one of"),
    (dict(schedule=hf.Schedule("zb-h1", step_graph=False)),
     r"schedule=hf.Schedule\('zb-h1', step_graph=False\): the zero-bubble schedule splits each "
     r"backward in two .* Leave step_graph out"),
    (dict(schedule=hf.Schedule("zb-h1", step_graph=False), partitions="auto"),
     r"schedule=hf.Schedule\('zb-h1', step_graph=False\)"),
    (dict(schedule="zb-h1", recompute=True), r"schedule='zb-h1' with recompute=True: the "
                                             r"zero-bubble schedule runs in the step graph, "
                                             r"which keeps every micro-batch's activations"),
    (dict(schedule=hf.Schedule(chunks=2)),
     r"schedule=hf.Schedule\('1f1b', chunks=2\): only the interleaved schedule gives a rank "
     r"several stages. Use hf.Schedule\('interleaved', chunks=2\), or leave chunks out."),
    (dict(schedule=hf.Schedule("interleaved", chunks=2)),
     r"schedule=hf.Schedule\('interleaved', chunks=2\) with partitions=1: one rank a pipeline "
     r"has no bubble to interleave"),
    (dict(recompute="yes"), r"recompute='yes': use True or False"),
    (dict(shard_optimizer=1), r"shard_optimizer=1: use True or False"),
    (dict(schedule=hf.Schedule(step_graph=True), recompute=True),
     r"schedule=hf.Schedule\('1f1b', step_graph=True\) with recompute=True: the step graph keeps "
     r"every micro-batch's activations"),
    (dict(schedule=object()), r"schedule=<object object at .*>: use a schedule's name \('1f1b', "
                              r"'gpipe', 'interleaved', 'zb-h1' or 'auto'\) or hf.Schedule"),
    (dict(callbacks=[hf.Trace("a.json"), hf.Trace("b.json")]),
     r"callbacks: 2 hf.Trace callbacks \('a.json', 'b.json'\); a run records one timeline"),
    (dict(timeout=0), r"timeout=0: use a number of seconds > 0, or None for no watchdog"),
    (dict(timeout="10"), r"timeout='10': use a number of seconds"),
])
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hf.fit(_compiled(), X, Y, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(shard_optimizer=True), r"shard_optimizer=True: model '.*' brings its own steps "
                                 r"\(train_step\), which apply the optimizer to every variable "
                                 r"themselves.*Leave shard_optimizer=False"),
    (dict(schedule=hf.Schedule(step_graph=True)),
     r"schedule=hf.Schedule\('1f1b', step_graph=True\): model '.*' brings its own train_step, "
     r"which runs as Keras compiles it"),
])
def test_what_a_model_with_its_own_train_step_cannot_take_is_refused(kwargs, message):
    class Own(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((5,))
    model = Own(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=message):
        hf.fit(model, X, Y, **kwargs)


def test_sharding_with_global_clipnorm_and_gradient_accumulation_is_refused():
    model = models.chain()
    model.compile(optimizer=keras.optimizers.SGD(global_clipnorm=1.0,
                                                 gradient_accumulation_steps=2), loss="mse")
    # checked before the launch: the same error on one process as on every rank of a job
    with pytest.raises(ValueError, match=r"shard_optimizer=True with global_clipnorm=1.0 and "
                                         r"gradient_accumulation_steps"):
        hf.fit(model, X, Y, replicas=2, shard_optimizer=True)


def test_not_compiled():
    with pytest.raises(ValueError, match=r"model 'chain' is not compiled. Call model.compile"):
        hf.fit(models.chain(), X, Y)


def test_x_and_y_lengths_differ():
    with pytest.raises(ValueError, match=r"x and y have different numbers of samples: x \[20\], "
                                         r"y \[19\]"):
        hf.fit(_compiled(), X, Y[:19])


def test_input_shape_mismatch():
    with pytest.raises(ValueError, match=r"x for input 'x' has samples of shape \(4,\), but the "
                                         r"model expects \(5,\)"):
        hf.fit(_compiled(), X[:, :4], Y)


def test_non_numeric_data_is_refused():
    with pytest.raises(ValueError, match=r"x for input 'x' holds strings \(<U3\), but the "
                                         r"model's input 'x' takes float32 numbers.*"
                                         r"TextVectorization, StringLookup or Hashing"):
        hf.fit(_compiled(), np.full((20, 5), "abc"), Y)
    with pytest.raises(ValueError, match=r"y for output .* has dtype <U3; hf.fit takes "
                                         r"numbers \(bool, int or float arrays\), and "
                                         r"strings as inputs. Turn labels that are names "
                                         r"into class indices"):
        hf.fit(_compiled(), X, np.full((20, 3), "abc"))


WORDS = "the quick brown fox jumps over a lazy dog and runs far away now".split()


def _text_model(kind):
    """Strings in, read by the model's own text layer (`kind`), classes out."""
    text = keras.Input((), dtype="string", name="text")
    if kind == "TextVectorization":
        h = keras.layers.TextVectorization(max_tokens=30, output_sequence_length=6,
                                           vocabulary=WORDS)(text)
    else:
        layer = keras.layers.StringLookup(vocabulary=WORDS) if kind == "StringLookup" \
            else keras.layers.Hashing(20)
        h = keras.ops.expand_dims(layer(text), -1)
    h = keras.layers.Embedding(40, 8)(h)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(8, activation="relu")(h))
    return keras.Model(text, keras.layers.Dense(2, activation="softmax")(h))


@pytest.mark.parametrize("kind", ["TextVectorization", "StringLookup", "Hashing"])
def test_strings_feed_the_models_own_text_layers_as_in_model_fit(kind):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    texts = np.array([" ".join(rng.choice(WORDS, rng.integers(1 if kind != "TextVectorization"
                                                              else 2, 7)))
                      for _ in range(44)], dtype=object)
    if kind != "TextVectorization":
        texts = np.array([t.split()[0] for t in texts], dtype=object)
    y = rng.integers(0, 2, 44)
    compile_kwargs = lambda: dict(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),  # noqa
                                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    a, b = _pair(lambda: _text_model(kind), compile_kwargs)
    ha = a.fit(texts, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, texts, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    _assert_same(a, b, ha, hb)
    data = tf.data.Dataset.from_tensor_slices((texts.astype(str), y)).batch(8)
    a, b = _pair(lambda: _text_model(kind), compile_kwargs)
    _assert_same(a, b, a.fit(data, epochs=2, verbose=0), hf.fit(b, data, epochs=2, verbose=0))
    np.testing.assert_allclose(hf.predict(b, texts, verbose=0), a.predict(texts, verbose=0),
                               rtol=1e-6)


def test_nested_models_train_with_keep_nested_or_split_through():
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(16, 5)), rng.integers(0, 3, 16)
    results = []
    for keep in (False, True):
        keras.utils.set_random_seed(4)
        m = models.nested()
        m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        hf.fit(m, x, y, batch_size=8, verbose=0, shuffle=False,
               balance=hf.partition(m, 1, keep_nested=True) if keep else None)
        results.append(m.get_weights())
    keras.utils.set_random_seed(4)
    ref = models.nested()
    ref.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ref.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    for ws in results:
        for w, r in zip(ws, ref.get_weights()):
            np.testing.assert_allclose(w, r, rtol=1e-5, atol=1e-6)


def test_recompiling_the_model_takes_effect_on_the_next_fit():
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(32, 5)), rng.normal(size=(32, 3))
    keras.utils.set_random_seed(3)
    a = models.chain()
    keras.utils.set_random_seed(3)
    b = models.chain()
    for m in (a, b):
        m.compile(optimizer="sgd", loss="mse")
    a.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    hf.fit(b, x, y, batch_size=8, verbose=0, shuffle=False)
    for m in (a, b):
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mae", metrics=["mse"])
    ha = a.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    hb = hf.fit(b, x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    _assert_same(a, b, ha, hb)


def test_trainable_changed_without_recompiling_is_refused_until_the_model_is_recompiled():
    # Keras' model.fit keeps training what was trainable when its first fit after compile
    # traced (and warns); a new P × R would trace anew, so hf.fit refuses instead.
    import warnings

    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(32, 5)), rng.normal(size=(32, 3))
    a, b = _pair(models.chain, lambda: dict(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                                            loss="mse"))
    frozen = b.layers[1].name
    for m in (a, b):
        m.layers[1].trainable = False  # before the first fit: both train without it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: "trainable state has changed since compile"
        ha = a.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        hb = hf.fit(b, x, y, batch_size=8, verbose=0, shuffle=False)
    _assert_same(a, b, ha, hb)
    b.layers[1].trainable = True  # after it, not recompiled
    for balance in ("flops", "layers"):  # the same trainer, and a new one
        with pytest.raises(ValueError, match=(
                rf"model 'chain': the trainable weights changed since its first hf.fit after "
                rf"model.compile \(now trainable: \['{frozen}/kernel', '{frozen}/bias'\]\). "
                rf"Call model.compile\(\.\.\.\) again")):
            hf.fit(b, x, y, batch_size=8, verbose=0, shuffle=False, balance=balance)
    for m in (a, b):
        m.layers[1].trainable = True
        m.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    ha = a.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    hb = hf.fit(b, x, y, batch_size=8, verbose=0, shuffle=False)
    _assert_same(a, b, ha, hb)


def test_more_partitions_than_layers():
    with pytest.raises(ValueError, match=r"partitions=4: model 'chain' has 3 layer calls, so it "
                                         r"can be split into at most 3 stages"):
        hf.fit(_compiled(), X, Y, partitions=4)


def test_subclassed_model_with_several_partitions():
    class Net(keras.Model):
        def call(self, x):
            return x

    model = Net()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"subclassed keras.Model \(Net\).*Use partitions=1"):
        hf.fit(model, X, X, partitions=2)


def test_global_clipnorm_with_keras_gradient_accumulation_across_stages_is_refused():
    # global_clipnorm alone works at any P (tests/mpi/numerics.py); Keras clips the
    # *accumulated* gradients, which hyparflow does not combine across stages.
    model = models.chain(n=2)
    model.compile(optimizer=keras.optimizers.SGD(global_clipnorm=1.0,
                                                 gradient_accumulation_steps=2), loss="mse")
    with pytest.raises(ValueError, match=r"model.optimizer has global_clipnorm=1.0 and "
                                         r"gradient_accumulation_steps: Keras clips the "
                                         r"accumulated gradients.*partitions=2 spreads over "
                                         r"stages.*or partitions=1"):
        hf.fit(model, X, Y, partitions=2)


def test_evaluate_and_predict_match_keras():
    rng = np.random.default_rng(8)
    x = {"a": rng.normal(size=(24, 5)).astype("float32"),
         "b": rng.normal(size=(24, 3)).astype("float32")}
    y = {"cls": rng.integers(0, 3, 24), "reg": rng.normal(size=(24, 2)).astype("float32")}
    keras.utils.set_random_seed(1)
    model = models.multi_io()
    model.compile(optimizer="sgd", loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                  loss_weights={"cls": 1.0, "reg": 0.5},
                  metrics={"cls": ["accuracy"], "reg": ["mae"]})
    ours = hf.evaluate(model, x, y, batch_size=8, verbose=0, return_dict=True)
    theirs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-6, err_msg=key)
    assert hf.evaluate(model, x, y, batch_size=8, verbose=0) == pytest.approx(
        model.evaluate(x, y, batch_size=8, verbose=0))
    predicted = hf.predict(model, x, batch_size=7, verbose=0)
    expected = model.predict(x, batch_size=7, verbose=0)
    assert sorted(predicted) == ["cls", "reg"]
    for key in expected:
        np.testing.assert_allclose(predicted[key], expected[key], rtol=1e-6)


def test_predict_needs_no_compile_and_evaluate_needs_a_loss():
    model = models.chain()
    np.testing.assert_allclose(hf.predict(model, X, verbose=0), model.predict(X, verbose=0),
                               rtol=1e-6)
    with pytest.raises(ValueError, match=r"model 'chain' is not compiled. .* before hf.evaluate"):
        hf.evaluate(model, X, Y)


def _multi_output_compile():
    return dict(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                loss_weights={"cls": 1.0, "reg": 0.5},
                metrics={"cls": ["accuracy"], "reg": ["mae"]},
                weighted_metrics={"cls": ["accuracy"]})


def test_sample_weights_and_validation_data_match_model_fit():
    # Equal batches: with a smaller last batch Keras' per-output losses are unweighted means.
    rng = np.random.default_rng(6)
    n, nv = 64, 24
    x = rng.normal(size=(n, 4)).astype("float32")
    y = {"cls": rng.integers(0, 3, n), "reg": rng.normal(size=(n, 1))}
    sw = rng.uniform(0.1, 2.0, n)
    xv = rng.normal(size=(nv, 4)).astype("float32")
    yv = {"cls": rng.integers(0, 3, nv), "reg": rng.normal(size=(nv, 1))}
    swv = rng.uniform(0.1, 2.0, nv)
    a, b = _pair(_multi_output, _multi_output_compile)
    kwargs = dict(batch_size=16, epochs=4, shuffle=False, verbose=0, sample_weight=sw,
                  validation_data=(xv, yv, swv), validation_freq=2, validation_batch_size=8)
    ha = a.fit(x, y, **kwargs)
    hb = hf.fit(b, x, y, **kwargs)
    assert "val_loss" in hb.history and "val_cls_weighted_accuracy" in hb.history
    _assert_same(a, b, ha, hb)


def test_validation_split_and_class_weight_match_model_fit():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(50, 5)).astype("float32")
    y = rng.integers(0, 3, size=50)
    a, b = _pair(models.residual, lambda: dict(optimizer="adam",
                                               loss="sparse_categorical_crossentropy",
                                               metrics=["accuracy"]))
    kwargs = dict(batch_size=8, epochs=3, shuffle=False, verbose=0, validation_split=0.3,
                  class_weight={0: 1.0, 1: 3.0, 2: 0.5})
    ha = a.fit(x, y, **kwargs)
    hb = hf.fit(b, x, y, **kwargs)
    assert len(hb.history["val_accuracy"]) == 3
    _assert_same(a, b, ha, hb)


@pytest.mark.parametrize("steps_per_epoch", [2, 4])
def test_steps_per_epoch_goes_on_where_the_last_epoch_stopped_like_model_fit(steps_per_epoch):
    # 5 batches per pass: with 2 steps per epoch, epoch 3 ends the pass after one
    # step; with 4, every other epoch runs out early. Keras warns in both cases.
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(70, 5)), rng.normal(size=(70, 3))
    a, b = _pair(models.chain, lambda: dict(optimizer="sgd", loss="mse", metrics=["mae"]))
    counts = {}
    for name, fit in (("keras", a.fit), ("hf", lambda *p, **k: hf.fit(b, *p, **k))):
        seen = []
        cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda i, logs: seen.append(i))
        with pytest.warns(UserWarning, match="Your input ran out of data"):
            h = fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
                    steps_per_epoch=steps_per_epoch, callbacks=[cb])
        counts[name] = (seen, h)
    assert counts["hf"][0] == counts["keras"][0]
    _assert_same(a, b, counts["keras"][1], counts["hf"][1])


def test_validation_steps_start_at_the_first_batch_every_time_like_model_fit():
    rng = np.random.default_rng(12)
    x, y = rng.normal(size=(32, 5)), rng.normal(size=(32, 3))
    xv, yv = rng.normal(size=(20, 5)), rng.normal(size=(20, 3))
    a, b = _pair(models.chain, lambda: dict(optimizer="sgd", loss="mse", metrics=["mae"]))
    kwargs = dict(batch_size=8, epochs=4, shuffle=False, verbose=0, validation_data=(xv, yv),
                  validation_batch_size=4, validation_steps=2)
    _assert_same(a, b, a.fit(x, y, **kwargs), hf.fit(b, x, y, **kwargs))


def test_initial_epoch_matches_model_fit():
    rng = np.random.default_rng(9)
    x, y = rng.normal(size=(40, 5)), rng.normal(size=(40, 3))
    a, b = _pair(models.chain, lambda: dict(optimizer="adam", loss="mse"))
    epochs = []
    cb = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs.append(e))
    ha = a.fit(x, y, batch_size=8, epochs=5, initial_epoch=3, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=8, epochs=5, initial_epoch=3, shuffle=False, verbose=0,
                callbacks=[cb])
    assert epochs == [3, 4]
    _assert_same(a, b, ha, hb)


def test_keras_callbacks_behave_as_under_model_fit(tmp_path):
    rng = np.random.default_rng(10)
    x, y = rng.normal(size=(48, 5)), rng.normal(size=(48, 3))
    xv, yv = rng.normal(size=(16, 5)), rng.normal(size=(16, 3))
    a, b = _pair(models.chain, lambda: dict(optimizer=keras.optimizers.SGD(0.1), loss="mse"))

    def callbacks(tag):
        return [keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.5 if e == 2 else lr),
                keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.3),
                keras.callbacks.EarlyStopping(monitor="val_loss", patience=2,
                                              restore_best_weights=True),
                keras.callbacks.CSVLogger(str(tmp_path / f"{tag}.csv")),
                keras.callbacks.ModelCheckpoint(str(tmp_path / f"{tag}.keras"),
                                                monitor="val_loss", save_best_only=True)]

    kwargs = dict(batch_size=8, epochs=12, shuffle=False, verbose=0, validation_data=(xv, yv))
    ha = a.fit(x, y, callbacks=callbacks("keras"), **kwargs)
    hb = hf.fit(b, x, y, callbacks=callbacks("hf"), **kwargs)
    _assert_same(a, b, ha, hb)
    ours, theirs = (np.genfromtxt(tmp_path / f"{t}.csv", delimiter=",", names=True)
                    for t in ("hf", "keras"))
    assert ours.dtype.names == theirs.dtype.names and len(ours) == len(theirs) < 12
    for name in theirs.dtype.names:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, err_msg=name)
    saved = [keras.models.load_model(tmp_path / f"{t}.keras") for t in ("keras", "hf")]
    for u, v in zip(*(m.get_weights() for m in saved)):
        np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-6)
    for u, v in zip(*(m.optimizer.variables for m in saved)):
        np.testing.assert_allclose(v.numpy(), u.numpy(), rtol=1e-5, atol=1e-6, err_msg=u.path)
    assert float(b.optimizer.learning_rate) == pytest.approx(float(a.optimizer.learning_rate))


def test_evaluate_with_sample_weight_and_steps_matches_keras():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = {"cls": rng.integers(0, 3, 32), "reg": rng.normal(size=(32, 1))}
    sw = rng.uniform(0.1, 2.0, 32)
    keras.utils.set_random_seed(2)
    model = _multi_output()
    model.compile(**_multi_output_compile())
    for kwargs in (dict(sample_weight=sw), dict(steps=2)):
        ours = hf.evaluate(model, x, y, batch_size=8, verbose=0, return_dict=True, **kwargs)
        theirs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True, **kwargs)
        assert sorted(ours) == sorted(theirs)
        for k in theirs:
            np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(hf.predict(model, x, batch_size=8, steps=2, verbose=0)["cls"],
                               model.predict(x, batch_size=8, steps=2, verbose=0)["cls"],
                               rtol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(validation_split=1.5), r"validation_split=1.5: use a fraction in \[0, 1\)"),
    (dict(validation_freq=0), r"validation_freq=0: use a whole number ≥ 1 \(validate every "
                              r"that many epochs\) or a list of epoch numbers"),
    (dict(steps_per_epoch=0), r"steps_per_epoch=0: must be a whole number ≥ 1"),
    (dict(initial_epoch=-1), r"initial_epoch=-1: must be a whole number ≥ 0"),
    (dict(sample_weight=np.ones(19)), r"sample_weight for output 'head' has 19 rows, but y "
                                      r"has 20 samples"),
    (dict(sample_weight=np.ones(20), class_weight={0: 1.0}),
     r"You cannot `class_weight` and `sample_weight` at the same time"),
    (dict(class_weight=[1.0, 2.0]), r"class_weight=\[1.0, 2.0\]: use a dict"),
    (dict(validation_data=(X[:, :4], Y)), r"validation_data: x for input 'x' has samples of "
                                          r"shape \(4,\), but the model expects \(5,\)"),
    (dict(validation_batch_size=0), r"validation_batch_size=0: must be a whole number ≥ 1"),
])
def test_bad_fit_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hf.fit(_compiled(), X, Y, **kwargs)


def test_predict_on_a_compiled_model_never_trained_then_fit():
    # hf.predict built the compiled loss without targets ("None values not supported"), where
    # Model.predict builds the model alone
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(20, 5)).astype("float32"), rng.integers(0, 3, size=20)
    a, b = _pair(models.residual, lambda: dict(optimizer="sgd", metrics=["accuracy"],
                                               loss="sparse_categorical_crossentropy"))
    np.testing.assert_allclose(hf.predict(b, x, batch_size=8),
                               a.predict(x, batch_size=8, verbose=0), rtol=1e-6, atol=1e-7)
    ha = a.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    _assert_same(a, b, ha, hb)


def test_models_that_differ_only_in_automatic_names_are_told_so():
    # rank 0 built one more model first: the same model, its layers numbered on
    from hyparflow.mpi import comm

    def build():
        inputs = keras.Input((4,))
        return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(3)(inputs)))

    first, second = build(), build()
    prints = [agreement.model_fingerprint(second), agreement.model_fingerprint(first)]
    key = "models (layers, weights, optimizer, loss, metrics)"
    message = comm._first_difference("hf.fit", key, prints)
    assert "on ranks [0]" in message and "on ranks [1]" in message, message
    assert "They differ only in the names Keras numbers automatically" in message, message
    # a real difference is not put down to names
    keras.utils.set_random_seed(0)
    other = keras.Model(first.inputs, keras.layers.Dense(5)(first.outputs[0]))
    message = comm._first_difference("hf.fit", key, [agreement.model_fingerprint(other), prints[1]])
    assert "automatically" not in message, message
    # other lists than names (shapes, checksums) get their message, no hint
    for key, lists in (("data checksums", [[1.5], [2.5]]),
                       ("input/target shapes and dtypes", [[((4,), "float32")],
                                                           [((5,), "float32")]])):
        message = comm._first_difference("hf.fit", key, lists)
        assert message.startswith(f"hf.fit got different {key} on different ranks"), message
        assert "automatically" not in message, message


def test_the_callbacks_that_need_every_stages_weights_at_each_batch_are_the_users(tmp_path):
    from hyparflow.training.callbacks import batch_readers

    class Logs(keras.callbacks.Callback):  # epoch hooks only
        def on_epoch_end(self, epoch, logs=None):
            pass

    class Batches(keras.callbacks.Callback):  # the old name of the hook counts too
        def on_batch_end(self, batch, logs=None):
            pass

    class Checkpoint(keras.callbacks.ModelCheckpoint):  # Keras' saver, with code of its own
        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)

    keras_own = [keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"), save_freq=2),
                 keras.callbacks.BackupAndRestore(str(tmp_path / "b")),
                 keras.callbacks.TensorBoard(str(tmp_path / "tb")),
                 keras.callbacks.TerminateOnNaN(), keras.callbacks.EarlyStopping(),
                 keras.callbacks.ProgbarLogger(), keras.callbacks.History(), Logs(),
                 keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: None)]
    assert batch_readers(keras_own) == []
    users = [keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None),
             keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: None),
             Batches(), Checkpoint(str(tmp_path / "c.keras"))]
    assert batch_readers(keras_own + users) == users

    class Timer(keras.callbacks.Callback):  # says its batch hooks read no weights
        batch_hooks_read_weights = False

        def on_train_batch_end(self, batch, logs=None):
            pass

    quiet = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)
    quiet.batch_hooks_read_weights = False
    assert batch_readers(users + [Timer(), quiet]) == users


def test_predictions_of_batches_of_different_lengths_join_as_model_predict_joins_them():
    # A per-token output over batches each padded to its own length: Model.predict returns
    # a tf.RaggedTensor (its batches cannot be concatenated); hf.predict crashed putting
    # them into one array
    import tensorflow as tf

    x = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(20, 4)(x)
    model = keras.Model(x, keras.layers.Dense(3)(h))
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 20, size=(4, length)).astype("int32"),)
               for length in (3, 7, 5)]
    ours = hf.predict(model, (b for b in batches), verbose=0)
    theirs = model.predict((b for b in batches), verbose=0)
    assert isinstance(ours, tf.RaggedTensor) and ours.shape.as_list() == \
        theirs.shape.as_list() == [12, None, 3]
    np.testing.assert_allclose(ours.flat_values.numpy(), theirs.flat_values.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(ours.row_lengths(), theirs.row_lengths())
    same = [(b[0][:, :3],) for b in batches]  # one length: one array, as Model.predict's
    np.testing.assert_allclose(hf.predict(model, (b for b in same), verbose=0),
                               model.predict((b for b in same), verbose=0), rtol=1e-6)


def _under_strategy(kind):
    import tensorflow as tf

    strategy = getattr(tf.distribute, kind)(*(["/cpu:0"] if "One" in kind else [["/cpu:0"]]))
    with strategy.scope():
        model = models.chain()
        model.compile(optimizer="sgd", loss="mse")
    return strategy, model


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("kind", ["OneDeviceStrategy", "MirroredStrategy"])
def test_a_model_of_a_tf_distribute_strategy_is_refused_naming_the_scope(kind, inside):
    # it failed deep inside a traced function ("TypeError: in user code: ...")
    strategy, model = _under_strategy(kind)
    x, y = np.zeros((8, 5), "float32"), np.zeros((8, 3), "float32")
    with pytest.raises(ValueError, match=rf"{kind}.*scope.*without"):
        if inside:
            with strategy.scope():
                hf.fit(model, x, y, verbose=0)
        else:
            hf.fit(model, x, y, verbose=0)


@pytest.mark.parametrize("mode", ["fit", "evaluate", "predict"])
def test_no_samples_are_named_not_blamed_on_the_targets(mode):
    # 0 samples: a ValueError blamed the labels ("y ... does not fit its loss ...,
    # target.shape=(0,)"). model.fit warns that the data ran out and returns an empty
    # History; evaluate returns []; predict fails (UnboundLocalError): hf names the input
    model = models.chain()
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((0, 5), "float32"), np.zeros((0, 3), "float32")
    with pytest.raises(ValueError, match=rf"x has 0 samples: hf\.{mode} has nothing to"):
        getattr(hf, mode)(model, x, *([] if mode == "predict" else [y]), verbose=0)


def test_ranks_that_compiled_another_loss_or_metrics_are_told_the_first_difference():
    # the model check compared layers, weights and the optimizer: a rank with another loss
    # trained rank 0's, silently
    from hyparflow.mpi import comm

    def compiled(**kwargs):
        keras.utils.set_random_seed(0)
        model = models.chain()
        model.compile(**{"optimizer": "sgd", "loss": "mse", **kwargs})
        return agreement.model_fingerprint(model)

    same = compiled()
    assert compiled() == same
    for change, words in (({"loss": keras.losses.Huber(delta=2.0)}, "Huber("),
                          ({"loss": "mae"}, "compiled loss 'mae'"),
                          ({"metrics": ["mae"]}, "compiled metrics ['mae']"),
                          ({"loss_weights": [2.0]}, "compiled loss_weights [2.0]")):
        message = comm._first_difference("hf.fit", "models", [same, compiled(**change)])
        assert words in message and "on ranks [1]" in message, (change, message)


def _normed(renorm=False):
    x = keras.Input((6,))
    h = keras.layers.BatchNormalization(name="bn_in", renorm=renorm)(x)
    h = keras.layers.Dense(8, activation="tanh")(h)
    h = keras.layers.BatchNormalization(name="bn_h")(h)
    return keras.Model(x, keras.layers.Dense(3, activation="softmax")(h))


def test_moving_statistics_are_updated_once_a_step_from_the_pooled_micro_batches():
    # updated at every micro-batch, they moved m times a step: 4 micro-batches of 4
    # samples drifted ~4x as fast as model.fit's (the demo's first validation: 0.59 against
    # Keras' 0.25). The layer on the inputs sees what model.fit's sees, whatever the
    # micro-batching: its moving statistics must be model.fit's; the pooled moments make
    # the batch's (Chan's combination, in float64: float32 rounding)
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(64, 6)) * 3 + 5).astype("float32")
    y = rng.integers(0, 3, size=64)
    a, b = _pair(_normed, lambda: dict(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                                       loss="sparse_categorical_crossentropy"))
    a.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    hf.fit(b, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, microbatches=4)
    for v, u in zip(b.get_layer("bn_in").non_trainable_weights,
                    a.get_layer("bn_in").non_trainable_weights):
        np.testing.assert_allclose(v.numpy(), u.numpy(), rtol=1e-5, atol=1e-6, err_msg=v.path)
    # the user's layers are theirs again after hf.fit
    assert "call" not in b.get_layer("bn_in").__dict__


def test_renorm_at_several_micro_batches_is_refused_naming_the_layer():
    model = _normed(renorm=True)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, y = np.zeros((16, 6), "float32"), np.zeros(16, "int64")
    with pytest.raises(ValueError, match=r"microbatches=4: .*bn_in.*renorm=True"):
        hf.fit(model, x, y, batch_size=16, microbatches=4, verbose=0)


def test_ragged_targets_train_as_model_fit():
    # y a tf.RaggedTensor (a variable number of targets a sample) was refused at every
    # P x R ("pad the targets"); Keras hands it to the loss as it is
    x, y = models.ragged_targets()
    a, b = _pair(models.regressor, lambda: dict(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=models.padded_mse))
    ha = a.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_same(a, b, ha, hb)
    assert abs(hf.evaluate(b, x, y, batch_size=16, verbose=0) -
               a.evaluate(x, y, batch_size=16, verbose=0)) < 1e-5


def test_a_batch_norm_called_twice_at_several_micro_batches_is_refused_naming_it():
    # model.fit updates its moving statistics at each call; a step's pool holds one
    # layer's moments, not one call's: refused rather than pooled into one update
    x = keras.Input((4,))
    norm = keras.layers.BatchNormalization(name="shared_bn")
    h = norm(keras.layers.Dense(4)(norm(x)))
    model = keras.Model(x, keras.layers.Dense(2)(h))
    model.compile(optimizer="sgd", loss="mse")
    data = np.zeros((16, 4), "float32"), np.zeros((16, 2), "float32")
    with pytest.raises(ValueError, match=r"shared_bn are called more than once.*"
                                         r"microbatches=1"):
        hf.fit(model, *data, batch_size=16, microbatches=2, verbose=0)
    hf.fit(model, *data, batch_size=16, microbatches=1, verbose=0)  # as model.fit


def test_renorm_synchronized_over_replicas_is_refused_naming_the_layer():
    from hyparflow.keras import batch_norm

    layer = keras.layers.BatchNormalization(renorm=True, synchronized=True, name="bn_sync")
    assert "replicas=2: synchronized BatchNormalization layer(s) bn_sync" in str(
        batch_norm.refusal([layer], 1, 2))
    assert batch_norm.refusal([layer], 1, 1) is None


@pytest.mark.parametrize("balance", ["time", [3]])
def test_evaluate_and_predict_reuse_fits_stages_without_being_told_its_balance(balance):
    model = _compiled()
    hf.fit(model, X, Y, batch_size=10, verbose=0, balance=balance)
    (trainer,) = model._hyparflow_trainers.values()
    expected = model.evaluate(X, Y, batch_size=10, verbose=0)
    assert hf.evaluate(model, X, Y, batch_size=10, verbose=0) == pytest.approx(expected)
    hf.predict(model, X, batch_size=10, verbose=0)
    assert list(model._hyparflow_trainers.values()) == [trainer]  # no second split
    hf.evaluate(model, X, Y, batch_size=10, verbose=0, balance="params")  # asked: its own
    assert len(model._hyparflow_trainers) == 2


def test_fit_takes_at_most_22_keywords_the_pipelines_details_in_hf_schedule():
    import inspect

    keywords = [p.name for p in inspect.signature(hf.fit).parameters.values()
                if p.kind is p.KEYWORD_ONLY]
    assert len(keywords) <= 22, keywords
    for gone in ("seed", "trace", "keep_nested", "step_graph", "chunks",
                 "batch_hooks_read_weights"):
        assert gone not in keywords
    assert repr(hf.Schedule("interleaved", chunks=4)) == "hf.Schedule('interleaved', chunks=4)"
    assert repr(hf.Schedule()) == "hf.Schedule('1f1b')"


@pytest.mark.parametrize("make, message", [
    (lambda: hf.Schedule("pipedream"), r"hf.Schedule\('pipedream'\): not a schedule; use one of "
                                       r"'1f1b', 'gpipe', 'interleaved', 'zb-h1'"),
    (lambda: hf.Schedule("interleaved", chunks=0),
     r"hf.Schedule\('interleaved', chunks=0\): chunks must be a whole number ≥ 1"),
    (lambda: hf.Schedule(step_graph="yes"),
     r"hf.Schedule\('1f1b', step_graph='yes'\): step_graph must be True or False"),
])
def test_a_bad_schedule_is_refused_where_it_is_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_trace_callback_records_every_training_step(tmp_path):
    import json

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 5)).astype("float32"), rng.integers(0, 3, size=32)
    a, b = _pair(models.residual, lambda: dict(optimizer="sgd",
                                               loss="sparse_categorical_crossentropy"))
    path = tmp_path / "run.json"
    ha = a.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                callbacks=[hf.Trace(path)])
    _assert_same(a, b, ha, hb)
    events = json.loads(path.read_text())["traceEvents"]
    steps = {e["args"]["step"] for e in events if e.get("ph") == "X" and "step" in e["args"]}
    assert len(steps) == 8, sorted(steps)  # 2 epochs × 4 batches
    # under model.fit it would record nothing: it says so instead
    with pytest.raises(ValueError, match=r"hf.Trace records hf.fit's steps; under model.fit "
                                         r"use keras.callbacks.TensorBoard\(profile_batch="):
        a.fit(x, y, batch_size=8, verbose=0, callbacks=[hf.Trace(path)])


def test_one_stage_steps_in_one_compiled_function_with_the_update_inside(tmp_path):
    # P = 1, one micro-batch: forward, backward and the optimizer's update are one function,
    # as in Model.fit's train function (the timeline has no update of its own); with two
    # micro-batches a step accumulates them and updates apart. Both train as model.fit.
    import json

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 5)).astype("float32"), rng.integers(0, 3, size=40)
    for m in (1, 2):
        a, b = _pair(models.residual, lambda: dict(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss="sparse_categorical_crossentropy"))
        path = tmp_path / f"m{m}.json"
        ha = a.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        hb = hf.fit(b, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                    microbatches=m, callbacks=[hf.Trace(path)])
        _assert_same(a, b, ha, hb)
        kinds = {e["cat"] for e in json.loads(path.read_text())["traceEvents"]
                 if e.get("ph") == "X"}
        assert "forward+backward" in kinds and ("optimizer" in kinds) == (m == 2), kinds


def test_a_partition_given_as_balance_is_the_cut_fit_makes():
    from hyparflow import arguments

    m = models.nested()
    part = hf.partition(m, 2, balance="layers", keep_nested=True)
    a = arguments.Call(model=m, partitions=2, balance=part)
    assert a.balance == [len(st.calls) for st in part.stages] and a.keep_nested is True
    with pytest.raises(ValueError, match=r"balance=<a Partition into 2 stages>: hf.fit\("
                                         r"partitions=3\) cuts the model into 3 stages"):
        model = _compiled()
        hf.fit(model, X, Y, partitions=3, balance=hf.partition(model, 2))
    with pytest.raises(ValueError, match=r"balance=<a Partition into 2 stages>: it cuts model "
                                         r"'.*', not model '.*'"):
        hf.fit(_compiled(), X, Y, partitions=2, balance=hf.partition(_compiled(), 2))
