"""A Mean or Sum the model's own code updates once per call counts by its piece's share
(batch_values)."""

import keras
import numpy as np
import tensorflow as tf

from hyparflow.keras.batch_values import by_share


class _Tracking(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mean = keras.metrics.Mean(name="mean")
        self.sum = keras.metrics.Sum(name="sum")


def _model():
    x = keras.Input((3,))
    model = _Tracking(x, keras.layers.Dense(1)(x))
    model.compile("sgd", "mse")
    return model


def test_pieces_of_a_batch_count_it_once():
    # A batch of 4 samples cut 3 + 1, each piece's loss a mean over its samples: model.fit's
    # one update with the batch's mean loss is what the two weighted updates give.
    model = _model()
    share = tf.Variable(0.0)
    per_sample = np.array([1.0, 2.0, 3.0, 10.0], np.float32)

    @tf.function
    def piece(values):
        with by_share(model, share):
            loss = tf.reduce_mean(values)
            model.mean.update_state(loss)
            model.sum.update_state(loss)

    for part in (per_sample[:3], per_sample[3:]):
        share.assign(len(part) / 4)
        piece(tf.constant(part))
    np.testing.assert_allclose(model.mean.result(), per_sample.mean(), rtol=1e-6)
    np.testing.assert_allclose(model.mean.count, 1.0, rtol=1e-6)
    np.testing.assert_allclose(model.sum.result(), per_sample.mean(), rtol=1e-6)
    assert "update_state" not in vars(model.mean)  # the instance is as it was


def test_values_per_sample_or_weighted_are_left_alone():
    model = _model()
    with by_share(model, tf.constant(0.25)):
        model.mean.update_state(tf.constant([1.0, 3.0]))  # per sample: counts 2
        model.mean.update_state(4.0, sample_weight=2.0)  # weighted by the code itself
    np.testing.assert_allclose(model.mean.count, 4.0)
    np.testing.assert_allclose(model.mean.total, 12.0)


def test_metrics_built_on_a_mean_that_take_targets_and_predictions_are_left_alone():
    # MeanAbsoluteError (Keras' guide updates it in train_step) is a Mean underneath, but it
    # takes (y_true, y_pred) and counts per sample: its update_state must reach it as written.
    model = _model()
    mae = keras.metrics.MeanAbsoluteError(name="mae")
    model.mae = mae
    assert mae in model.metrics

    @tf.function
    def step(y, p):
        with by_share(model, tf.constant(0.5)):
            mae.update_state(y, p)

    step(tf.constant([[1.0], [2.0]]), tf.constant([[0.0], [0.0]]))
    np.testing.assert_allclose(mae.result(), 1.5)
    assert "update_state" not in vars(mae)
