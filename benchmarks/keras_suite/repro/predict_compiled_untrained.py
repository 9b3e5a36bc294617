"""hf.predict / hf.evaluate on a compiled model that was never trained.

Keras: model.predict works on a compiled model before any fit (it builds nothing for the
loss). hyparflow: hf.predict first builds the compiled loss on symbolic tensors with y=None
and fails inside Keras' loss with "ValueError: None values not supported."
(Keras tests: trainer_test test_predict_preserve_order_*, test_predict_generator_*,
test_rng_updated_during_predict, lambda_callback_test test_lambda_callback_during_prediction.)

Status: fixed by commit 942a7ba (made during this measurement): hf.predict now prints the
same values as model.predict. Before it (c5e8c0d, 0b9ab29): "hf.predict: ValueError: None
values not supported." at 1x1, and at 1x2 the same error ended the whole job (MPI_Abort).
hf.evaluate was not affected.

Run: python repro/predict_compiled_untrained.py        (1 process, 1x1)
"""
import hyparflow as hf  # isort: skip  (before TensorFlow)

import keras
import numpy as np

x = np.arange(12, dtype="float32").reshape(6, 2)
inputs = keras.Input((2,))
model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs))
model.compile(loss="mse", optimizer="sgd")

print("model.predict:", model.predict(x, verbose=0).ravel())

model2 = keras.Model(inputs, model.layers[-1](inputs))  # same layer, fresh compile
model2.compile(loss="mse", optimizer="sgd")
try:
    print("hf.predict:   ", hf.predict(model2, x, verbose=0).ravel())
except Exception as exc:
    print(f"hf.predict:    {type(exc).__name__}: {exc}")

model3 = keras.Model(inputs, model.layers[-1](inputs))
model3.compile(loss="mse", optimizer="sgd")
print("model.evaluate:", model3.evaluate(x, x[:, :1], verbose=0))
model4 = keras.Model(inputs, model.layers[-1](inputs))
model4.compile(loss="mse", optimizer="sgd")
try:
    print("hf.evaluate:  ", hf.evaluate(model4, x, x[:, :1], verbose=0))
except Exception as exc:
    print(f"hf.evaluate:   {type(exc).__name__}: {exc}")
