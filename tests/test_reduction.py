"""A compiled loss cut into micro-batches trains as
Model.fit's on the whole batch, or is refused."""

import keras
import numpy as np
import pytest

import custom_models as cm
import hyparflow as hf
from hyparflow.keras import reduction


def _fit_both(kind, microbatches, **kwargs):
    runs = []
    for fit in (keras.Model.fit, lambda m, *a, **k: hf.fit(m, *a, microbatches=microbatches,
                                                            **k)):
        model, x, y, sw = cm.reduced(kind)
        history = fit(model, x, y, sample_weight=sw, batch_size=cm.BATCH, epochs=2,
                      shuffle=False, verbose=0, **kwargs)
        runs.append((model, history))
    (ref, ha), (model, hb) = runs
    return ref, model, ha, hb


def test_a_loss_summed_over_the_batch_counts_each_micro_batch_whole():
    # Each micro-batch's loss used to be scaled by its share, as for a mean: the
    # gradient was a quarter of Model.fit's at microbatches=4.
    ref, model, ha, hb = _fit_both("sum", 4)
    cm.same_weights(ref, model)
    cm.same_history(ha, hb)


@pytest.mark.parametrize("kind, why", [
    ("masked", "averages output 'tags' over the entries of the whole batch its mask keeps"),
    ("weighted_mean", "divides output 'y''s weighted losses"),
    ("mixed", "sums output losses over the batch where other outputs average theirs"),
    ("sum_heads", "sums over the batch, and Keras logs each output's sum per batch"),
    ("masked_subclassed", "averages output 'output' over the entries of the whole batch"),
])
def test_a_loss_of_the_whole_batch_is_refused_when_the_batch_is_cut(kind, why):
    model, x, y, sw = cm.reduced(kind)
    with pytest.raises(ValueError) as err:
        hf.fit(model, x, y, sample_weight=sw, batch_size=cm.BATCH, microbatches=4, verbose=0)
    message = str(err.value)
    assert message.startswith(f"model {model.name!r}'s compiled loss "), message
    assert why in message, message
    assert "with replicas=1 and microbatches=4 each batch is cut into 4 pieces" in message
    assert "or replicas=1 and microbatches=1." in message
    # a masked mean is already the default reduction: only a sum splits it
    assert ("Use a per-sample mean" in message) == (not kind.startswith("masked")), message


@pytest.mark.parametrize("kind", ["masked", "weighted_mean", "mixed", "sum_heads",
                                  "masked_subclassed"])
def test_a_loss_of_the_whole_batch_trains_as_model_fit_when_the_batch_is_whole(kind):
    ref, model, ha, hb = _fit_both(kind, 1)
    cm.same_weights(ref, model, kind)
    cm.same_history(ha, hb, kind)


def test_validation_data_is_checked_with_its_own_weights():
    model, x, y, sw = cm.reduced("weighted_mean")
    with pytest.raises(ValueError, match=r"^validation_data: model .* divides output"):
        hf.fit(model, x, y, batch_size=cm.BATCH, microbatches=4, verbose=0,
               validation_data=(x, y, sw))


def test_reductions_as_keras_reads_them():
    x = keras.Input((3,))
    model = keras.Model(x, [keras.layers.Dense(1, name="a")(x), keras.layers.Dense(1, name="b")(x)])
    model.compile(loss={"b": keras.losses.MeanSquaredError(reduction="sum"), "a": "mse"})
    assert reduction.reductions(model, ["a", "b"]) == ["sum_over_batch_size", "sum"]
    assert not reduction.summed(model)
    model.compile(loss=[None, keras.losses.MeanAbsoluteError(reduction="sum")])
    assert reduction.reductions(model, ["a", "b"]) == [None, "sum"]
    assert reduction.summed(model)
    single = keras.Model(x, keras.layers.Dense(1)(x))
    single.compile(loss=keras.losses.MeanAbsoluteError(reduction="sum"))
    reduction.check(single, ["a"], None, False, False, P=2, R=2, m=4)  # splits exactly
    with pytest.raises(ValueError, match="the model's own train_step or compute_loss"):
        reduction.check(single, ["a"], None, False, True, P=1, R=2, m=1)
    reduction.check(single, ["a"], [True], True, True, P=4, R=1, m=1)  # never cut


def _batch_level(loss):
    keras.utils.set_random_seed(2)
    x = keras.Input((4,), name="x")
    model = keras.Model(x, keras.layers.Dense(3, activation="sigmoid", name="y")(x))
    model.compile(optimizer="sgd", loss=loss)
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(32, 4)).astype("float32"), \
        (rng.random((32, 3)) > 0.5).astype("float32")


def _root_mean_squared(y_true, y_pred):  # one value per batch: a square root of a mean
    return keras.ops.sqrt(keras.ops.mean(keras.ops.square(y_true - y_pred)))


@pytest.mark.parametrize("loss", [keras.losses.Dice(), keras.losses.Tversky(), "dice",
                                  _root_mean_squared])
def test_a_loss_computed_over_the_whole_batch_is_refused_when_the_batch_is_cut(loss):
    # Dice (axis=None) on a batch is not the weighted mean of Dice on its pieces: at 1 x 2 it
    # moved the weights 7e-3 from Model.fit's, exiting 0.
    model, x, y = _batch_level(loss)
    with pytest.raises(ValueError) as err:
        hf.fit(model, x, y, batch_size=16, microbatches=2, verbose=0)
    assert ("compiled loss for output 'y' is not a mean over samples: its value on a batch is "
            "not what its values on the batch's pieces add up to") in str(err.value)
    assert model.optimizer.iterations.numpy() == 0
    hf.fit(model, x, y, batch_size=16, verbose=0)  # whole batches: as Model.fit


@pytest.mark.parametrize("loss", ["mse", "binary_crossentropy", keras.losses.Dice(axis=1),
                                  keras.losses.Huber(reduction="sum")])
def test_a_loss_per_sample_splits(loss):
    # cut into micro-batches, it trains as on whole batches (Model.fit's weights and loss)
    model, x, y = _batch_level(loss)
    ref, _, _ = _batch_level(loss)
    theirs = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    ours = hf.fit(model, x, y, batch_size=16, microbatches=2, epochs=2, shuffle=False,
                  verbose=0)
    for u, v in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.history["loss"], theirs.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("loss, y, why", [
    ("sparse_categorical_crossentropy", np.eye(3)[np.arange(32) % 3],
     "Argument `output` must have rank (ndim) `target.ndim - 1`."),
    ("categorical_crossentropy", (np.arange(32) % 3)[:, None].astype("float32"),
     "Arguments `target` and `output` must have the same shape."),
])
def test_targets_that_do_not_fit_the_loss_are_one_error_before_training(loss, y, why):
    # Model.fit fails at its first step; hf.fit failed after the ranks' first messages, which
    # ended the job even inside try/except
    model, x, _ = _batch_level(loss)
    with pytest.raises(ValueError) as err:
        hf.fit(model, x, y, batch_size=16, verbose=0)
    message = str(err.value)
    assert message.startswith(f"y for output 'y' (samples of shape {y.shape[1:]}, dtype "), message
    assert f"does not fit its loss {loss!r} with the output's shape (3,): " in message, message
    assert why in message, message
    assert model.optimizer.iterations.numpy() == 0


@pytest.mark.parametrize("loss", ["binary_crossentropy", "binary_focal_crossentropy",
                                  "crossentropy", keras.losses.binary_crossentropy])
def test_targets_keras_brings_to_the_output_s_rank_are_not_refused(loss):
    # the usual binary classifier: labels of shape (n,), one sigmoid unit; Model.fit wraps a
    # loss function so that (n,) meets (n, 1), and hf.fit refused the string forms
    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer="sgd", loss=loss)
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    ref, model = build(), build()
    ha = ref.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    hb = hf.fit(model, x, y, batch_size=8, shuffle=False, verbose=0)
    np.testing.assert_allclose(hb.history["loss"], ha.history["loss"], rtol=1e-5, atol=1e-6)
    for w, r in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(w, r, rtol=1e-5, atol=1e-6)
