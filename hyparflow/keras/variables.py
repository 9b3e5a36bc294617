"""Read and set variables with one TensorFlow op each, without Keras' per-call bookkeeping:
every hf.fit moves a model's weights and optimizer state between ranks, hundreds of variables."""

import keras
import numpy as np
import tensorflow as tf


def _handle(variable):
    """The resource of a Keras variable (its tf.Variable's) or of a tf.Variable; None for one
    Keras has not created yet (its value is computed on first use)."""
    try:
        return variable.handle
    except AttributeError:
        return None


def _read(variable):
    """The variable's value as a tensor (through Keras for one it has not created)."""
    handle = _handle(variable)
    if handle is None:
        return tf.convert_to_tensor(variable.numpy())
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.as_dtype(variable.dtype))


def value(variable):
    """The variable's value as a numpy array, a copy as `variable.numpy()` gives it."""
    return _read(variable).numpy()


def assign(variables, values):
    """Set each variable to its value (a tensor, a variable, or a numpy array, copied as
    `Variable.assign` copies it), cast to the variable's dtype as `Variable.assign` casts;
    a value of another shape is refused as `Variable.assign` refuses it."""
    for variable, new in zip(variables, values, strict=True):
        handle = _handle(variable)
        if handle is None:
            variable.assign(new)
            continue
        if isinstance(new, (tf.Variable, keras.Variable)):
            new = _read(new)
        tensor = new if isinstance(new, tf.Tensor) else tf.convert_to_tensor(np.asarray(new))
        if tuple(tensor.shape) != tuple(variable.shape):
            raise ValueError(f"{variable.name} has shape {tuple(variable.shape)}: a value of "
                             f"shape {tuple(tensor.shape)} cannot be assigned to it.")
        dtype = tf.as_dtype(variable.dtype)
        if tensor.dtype != dtype:
            tensor = tf.cast(tensor, dtype)
        tf.raw_ops.AssignVariableOp(resource=handle, value=tensor)
