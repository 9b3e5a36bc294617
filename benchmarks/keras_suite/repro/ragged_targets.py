"""hf.fit with a tf.RaggedTensor as y (targets).

Keras: model.fit(x, y) accepts ragged x and ragged y. hyparflow takes x's rows with a
ragged-aware `take`, but y's with `a[i]` (hyparflow/data/batches.py ArrayBatch.parts), which a
RaggedTensor refuses: TypeError "Only integers, slices ... are valid indices, got array([1, 0])".
(Keras tests: trainer_test test_trainer_with_raggeds_model / _layer / _functional.)

Run: python repro/ragged_targets.py        (1 process, 1x1)
"""
import hyparflow as hf  # isort: skip  (before TensorFlow)

import keras
import tensorflow as tf


class Twice(keras.Model):
    def call(self, x):
        return x * 2


def loss_fn(y, y_pred, sample_weight=None):  # as in Keras' test
    return 0


x = tf.ragged.constant([[1.0], [2.0, 3.0]])
for name, fit in (("model.fit", lambda m: m.fit(x, x, verbose=0)),
                  ("hf.fit   ", lambda m: hf.fit(m, x, x, verbose=0))):
    model = Twice()
    model.compile(optimizer="adam", loss=loss_fn)
    try:
        history = fit(model)
        print(f"{name}: ok, loss {history.history['loss']}")
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
