"""hf.fit in one process keeps Model.fit's contract: the model's own steps, state in call(),
steps_per_execution, Keras' limits."""

import keras
import numpy as np
import pytest

import custom_models as cm
import hyparflow as hf


def _fit_both(kind, **kwargs):
    ref, model = cm.twins(kind)
    x, y = cm.data()
    args = dict(batch_size=cm.BATCH, epochs=2, shuffle=False, verbose=0, **kwargs)
    if kind == "gan":
        ha, hb = ref.fit(x, **args), hf.fit(model, x, **args)
    else:
        ha, hb = ref.fit(x, y, **args), hf.fit(model, x, y, **args)
    return ref, model, ha, hb


def test_a_train_step_override_runs_as_written():
    # The user's train_step trains all but the first layer: hf.fit used to run its own
    # step and move that layer too.
    ref, model, ha, hb = _fit_both("head_only")
    start = cm.twins("head_only")[0].get_layer("frozen").get_weights()
    for u, v in zip(start, model.get_layer("frozen").get_weights()):
        np.testing.assert_array_equal(v, u)
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)


def test_compute_loss_and_compute_metrics_overrides_are_honoured():
    ref, model, ha, hb = _fit_both("penalised", validation_data=cm.data(32, seed=1))
    assert "custom" in hb.history and "val_custom" in hb.history
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)


def test_a_model_without_any_loss_gets_keras_error():
    ref, model = cm.twins("no_loss")
    x, y = cm.data()
    with pytest.raises(ValueError, match="No loss to compute") as want:
        ref.fit(x, y, verbose=0)
    with pytest.raises(ValueError) as got:
        hf.fit(model, x, y, verbose=0)
    assert str(got.value) == str(want.value)


def test_a_gan_style_step_with_two_optimizers():
    ref, model, ha, hb = _fit_both("gan")
    assert sorted(hb.history) == ["c_grad_norm", "c_loss", "g_loss"]
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)
    for name in ("c_optimizer", "g_optimizer"):
        assert int(getattr(model, name).iterations) == int(getattr(ref, name).iterations) == 8


def test_test_step_and_predict_step_overrides():
    ref, model = cm.twins("steps")
    x, y = cm.data()
    want = ref.evaluate(x, y, batch_size=cm.BATCH, verbose=0, return_dict=True)
    got = hf.evaluate(model, x, y, batch_size=cm.BATCH, verbose=0, return_dict=True)
    assert sorted(got) == sorted(want) and "mean_prediction" in got
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=cm.RTOL, err_msg=k)
    want = ref.predict(x, batch_size=cm.BATCH, verbose=0)
    got = hf.predict(model, x, batch_size=cm.BATCH, verbose=0)
    assert sorted(got) == ["probs", "top"]
    np.testing.assert_allclose(got["probs"], want["probs"], rtol=cm.RTOL)
    np.testing.assert_array_equal(got["top"], want["top"])


def test_state_updated_in_call_counts_only_the_training_samples():
    # model.fit never calls the model on real samples before training: it builds it
    # symbolically. hf.fit used to call it twice (counting 2 samples more).
    ref, model, _, _ = _fit_both("counting")
    assert float(ref.seen.numpy()) == 2 * cm.SAMPLES
    assert float(model.seen.numpy()) == 2 * cm.SAMPLES
    cm.same_weights(ref, model)


class _Steps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(("begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(("end", batch, round(float(logs["loss"]), 5)))

    def on_test_batch_end(self, batch, logs=None):
        self.seen.append(("test", batch))


@pytest.mark.parametrize("steps_per_epoch", [None, 3])
def test_steps_per_execution_calls_back_as_model_fit(steps_per_epoch):
    # 64 samples in batches of 10: 7 batches; in groups of 3 Keras calls back at
    # steps 2, 5 and 8 (the last group has one batch), and with steps_per_epoch=3 reads
    # a group of 3 per epoch.
    runs = []
    for fit in (keras.Model.fit, hf.fit):
        keras.utils.set_random_seed(3)
        model = cm._functional(keras.Model)
        model.compile(optimizer=cm._sgd(), loss="sparse_categorical_crossentropy",
                      steps_per_execution=3)
        cb = _Steps()
        x, y = cm.data()
        history = fit(model, x, y, batch_size=10, epochs=2, shuffle=False, verbose=0,
                      callbacks=[cb], steps_per_epoch=steps_per_epoch,
                      validation_data=(x[:20], y[:20]))
        runs.append((model, cb.seen, history))
    (ref, want, ha), (model, got, hb) = runs
    assert got == want
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)


def test_keras_limits_on_epochs_and_steps():
    ref, model = cm.twins("penalised")
    x, y = cm.data()
    try:
        keras.config.set_max_epochs(1)
        keras.config.set_max_steps_per_epoch(2)
        ha = ref.fit(x, y, batch_size=cm.BATCH, epochs=3, shuffle=False, verbose=0)
        with pytest.warns(UserWarning, match="Limiting"):
            hb = hf.fit(model, x, y, batch_size=cm.BATCH, epochs=3, shuffle=False, verbose=0)
    finally:
        keras.config.set_max_epochs(None)
        keras.config.set_max_steps_per_epoch(None)
    assert len(hb.history["loss"]) == 1
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations) == 2
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)


class EveryMetric(keras.Model):
    """A train_step as Keras' guides write it: logs of every metric, the compiled metrics'
    result nested in a dict (Keras' callbacks see it flattened)."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        for m in self.metrics:
            if m.name == "loss":
                m.update_state(loss)
            else:
                m.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def test_a_train_step_returning_nested_logs_on_a_masked_lstm():
    runs = []
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(64, 7))
    x[:, 5:] = 0  # padding, masked
    y = rng.integers(0, 2, size=64)
    for fit in (keras.Model.fit, hf.fit):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((7,), dtype="int32")
        h = keras.layers.Embedding(20, 6, mask_zero=True)(inputs)
        h = keras.layers.LSTM(5)(h)
        model = EveryMetric(inputs, keras.layers.Dense(2, activation="softmax")(h))
        model.compile(optimizer=cm._sgd(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        runs.append((model, fit(model, x, y, batch_size=16, epochs=2, shuffle=False,
                                verbose=0)))
    (ref, ha), (model, hb) = runs
    assert sorted(hb.history) == ["accuracy", "loss"]
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)


@pytest.mark.parametrize("loss, targets", [
    (["mse", None, None], lambda y: y["a"]),
    (["mse", None, "mae"], lambda y: [y["a"], y["c"]]),
    (["mse", None, "mae"], lambda y: {"a": y["a"], "c": y["c"]}),
])
def test_partial_labels_train_as_model_fit(loss, targets):
    # Targets for the outputs with a loss only: hf.fit refused them ("y has 1 arrays").
    x, _ = cm.data()
    rng = np.random.default_rng(2)
    y = targets({"a": rng.normal(size=(len(x), 2)).astype("float32"),
                 "c": rng.normal(size=(len(x), 1)).astype("float32")})
    ref, model = cm.heads(loss), cm.heads(loss)
    args = dict(batch_size=cm.BATCH, epochs=2, shuffle=False, verbose=0)
    ha, hb = ref.fit(x, y, **args), hf.fit(model, x, y, **args)
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)
    assert hf.evaluate(model, x, y, verbose=0) == pytest.approx(
        ref.evaluate(x, y, verbose=0), rel=cm.RTOL)


def test_dict_inputs_to_a_subclassed_model():
    # hf.fit passed the inputs as a list: "list indices must be integers or slices, not str".
    x, y = cm.data()
    x = {"a": x[:, :2], "b": x[:, 2:]}
    ref, model = cm.dict_inputs_model(), cm.dict_inputs_model()
    args = dict(batch_size=cm.BATCH, epochs=2, shuffle=False, verbose=0)
    ha, hb = ref.fit(x, y, **args), hf.fit(model, x, y, **args)
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)
    np.testing.assert_allclose(hf.predict(model, x, verbose=0), ref.predict(x, verbose=0),
                               rtol=cm.RTOL, atol=cm.ATOL)
