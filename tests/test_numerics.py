"""hf.fit in one process trains what model.fit trains: mixed precision, EMA, optimizer state,
metrics, unused variables."""

import keras
import numpy as np
import pytest

import hyparflow as hf


@pytest.fixture
def policy():
    """Restore the global dtype policy after a test that changes it."""
    before = keras.mixed_precision.global_policy().name
    yield keras.mixed_precision.set_global_policy
    keras.mixed_precision.set_global_policy(before)


def _mlp(width=16, inputs=6, classes=3):
    x = keras.Input((inputs,), name="x")
    h = keras.layers.Dense(width, activation="relu", name="h1")(x)
    h = keras.layers.Dense(width, activation="relu", name="h2")(h)
    out = keras.layers.Dense(classes, name="logits")(h)
    out = keras.layers.Activation("softmax", dtype="float32", name="probs")(out)
    return keras.Model(x, out)


def _data(n=96, inputs=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, inputs)).astype("float32"), rng.integers(0, classes, size=n)


def _twins(build, optimizer, **compile_kwargs):
    """Two models with the same initial weights, each compiled with its own optimizer."""
    out = []
    for _ in range(2):
        keras.utils.set_random_seed(3)
        m = build()
        kwargs = {k: v() if callable(v) else v for k, v in compile_kwargs.items()}
        m.compile(optimizer=optimizer(), **kwargs)
        out.append(m)
    return out


def _close(a, b, rtol, atol):
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(v, u, rtol=rtol, atol=atol)


def test_mixed_float16_scales_the_loss_and_skips_the_steps_keras_skips(policy):
    # Keras wraps the optimizer in a LossScaleOptimizer. A sample of 1e4 at step 2 makes
    # the float16 gradients overflow: model.fit skips that step and halves the scale; a
    # growth period of 2 steps doubles it again later. Both runs must take the same path.
    policy("mixed_float16")
    x, y = _data()
    x[40] = 6e4  # in the third batch of 16
    opt = lambda: keras.optimizers.LossScaleOptimizer(  # noqa: E731
        keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0 ** 10,
        dynamic_growth_steps=2)
    a, b = _twins(_mlp, opt, loss="sparse_categorical_crossentropy")
    start = a.get_weights()[0].copy()
    a.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    hf.fit(b, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for name in ("dynamic_scale", "step_counter", "iterations"):
        assert float(getattr(b.optimizer, name).numpy()) == float(
            getattr(a.optimizer, name).numpy()), name
    assert float(a.optimizer.dynamic_scale.numpy()) != 2.0 ** 10  # the path was exercised
    assert np.abs(a.get_weights()[0] - start).max() > 1e-3  # Keras trained
    # float16 compute: both runs execute the same float16 ops on the same batches.
    _close(a, b, rtol=1e-3, atol=1e-4)


def test_mixed_float16_default_policy_trains_like_model_fit(policy):
    policy("mixed_float16")
    x, y = _data()
    a, b = _twins(_mlp, lambda: keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    start = a.get_weights()[0].copy()
    ha = a.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert np.abs(a.get_weights()[0] - start).max() > 0.01  # Keras trained
    _close(a, b, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(hb.history["loss"], ha.history["loss"], rtol=1e-3)


def test_ema_is_finalised_behind_a_loss_scale_optimizer(policy):
    policy("mixed_float16")
    x, y = _data()
    opt = lambda: keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)  # noqa: E731
    a, b = _twins(_mlp, opt, loss="sparse_categorical_crossentropy")
    a.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    hf.fit(b, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    _close(a, b, rtol=1e-3, atol=1e-4)


def test_after_hf_fit_model_optimizer_holds_every_variable_and_model_fit_continues():
    # A fresh model: hf.fit, then model.fit, must equal two model.fit calls (Adam's slots
    # and step count carried over); and the optimizer is built over the whole model.
    x, y = _data()
    a, b = _twins(_mlp, lambda: keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy")
    a.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # warm-up rounding alike
    a, b = _twins(_mlp, lambda: keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy")
    a.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    hf.fit(b, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert b.optimizer.built and len(b.optimizer._trainable_variables) == len(
        b.trainable_variables)
    assert int(b.optimizer.iterations.numpy()) == 6
    a.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    b.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    _close(a, b, rtol=1e-5, atol=1e-6)
    for u, v in zip(a.optimizer.variables, b.optimizer.variables):
        np.testing.assert_allclose(v.numpy(), u.numpy(), rtol=1e-5, atol=1e-6, err_msg=u.name)


def test_a_variable_without_gradient_is_left_alone_as_keras_leaves_it():
    # An auxiliary head compiled with loss None: its kernel gets no gradient. Keras skips
    # it (momentum and all); hf.fit must too, and train the rest alike.
    x_in = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="relu", name="h")(x_in)
    main = keras.layers.Dense(3, activation="softmax", name="main")(h)
    aux = keras.layers.Dense(2, name="aux")(h)

    def build():
        return keras.Model(x_in, {"main": main, "aux": aux})

    x, y = _data()
    out = []
    for _ in range(2):
        keras.utils.set_random_seed(3)
        m = keras.models.clone_model(build())
        m.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss={"main": "sparse_categorical_crossentropy", "aux": None})
        out.append(m)
    a, b = out
    ya = {"main": y, "aux": np.zeros((len(y), 2), "float32")}
    ha = a.fit(x, ya, batch_size=16, epochs=1, shuffle=False, verbose=0)
    hb = hf.fit(b, x, ya, batch_size=16, epochs=1, shuffle=False, verbose=0)
    _close(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hb.history["loss"], ha.history["loss"], rtol=1e-5)


def test_lazily_built_metrics_report_as_in_keras():
    x, y = _data()
    yy = keras.utils.to_categorical(y, 3)
    kw = dict(loss="categorical_crossentropy",
              metrics=lambda: [keras.metrics.F1Score(),  # one value per class; each model its own
                               keras.metrics.FBetaScore(beta=2.0, average="micro")])
    a, b = _twins(_mlp, lambda: keras.optimizers.SGD(0.1), **kw)
    ha = a.fit(x, yy, batch_size=16, epochs=2, shuffle=False, verbose=0)
    hb = hf.fit(b, x, yy, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert sorted(ha.history) == sorted(hb.history)
    for k in ha.history:
        np.testing.assert_allclose(hb.history[k], ha.history[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert np.shape(hb.history["f1_score"][0]) == (3,)
    ea = a.evaluate(x, yy, batch_size=16, verbose=0, return_dict=True)
    eb = hf.evaluate(b, x, yy, batch_size=16, verbose=0, return_dict=True)
    for k in ea:
        np.testing.assert_allclose(eb[k], ea[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _embedding_model(rows=50, width=8, length=6):
    x = keras.Input((length,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(rows, width, name="table")(x)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    out = keras.layers.Dense(3, activation="softmax", name="probs")(h)
    return keras.Model(x, out)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_an_embedding_trained_with_adam_gets_keras_sparse_update(microbatches):
    # Keras applies an Embedding's gradient as IndexedSlices: Adam's moments move only
    # on the rows looked up (each look-up, duplicates included). A densified gradient
    # moves every row's moments (measured: 0.3 off after a few steps).
    rng = np.random.default_rng(0)
    x = rng.integers(0, 12, size=(64, 6)).astype("int32")  # rows 12..49 never looked up
    y = rng.integers(0, 3, size=64)
    a, b = _twins(_embedding_model, lambda: keras.optimizers.Adam(0.05),
                  loss="sparse_categorical_crossentropy")
    a.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    hf.fit(b, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, microbatches=microbatches)
    # Adam turns summation-order rounding into ~1e-6 relative differences (see
    # tests/mpi/numerics.py); a densified update is off by ~0.1.
    _close(a, b, rtol=1e-4, atol=1e-5)


def test_a_mixed_precision_model_saves_and_loads_with_its_loss_scale(policy, tmp_path):
    # A LossScaleOptimizer has an 'iteration' of its own and its inner optimizer's: the
    # saved file must hold both, the scale and every slot, as Model.save writes them.
    policy("mixed_float16")
    x, y = _data()
    opt = lambda: keras.optimizers.LossScaleOptimizer(  # noqa: E731
        keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0 ** 10, dynamic_growth_steps=2)
    a, b = _twins(_mlp, opt, loss="sparse_categorical_crossentropy")
    a.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    hf.fit(b, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    a.save(tmp_path / "keras.keras")
    hf.save(b, tmp_path / "hf.keras")
    ka = keras.models.load_model(tmp_path / "keras.keras")
    kb = keras.models.load_model(tmp_path / "hf.keras")
    assert [v.name for v in kb.optimizer.variables] == [v.name for v in ka.optimizer.variables]
    for u, v in zip(ka.optimizer.variables, kb.optimizer.variables):
        np.testing.assert_allclose(v.numpy(), u.numpy(), rtol=1e-3, atol=1e-4, err_msg=u.name)
    assert float(kb.optimizer.dynamic_scale.numpy()) == float(a.optimizer.dynamic_scale.numpy())
