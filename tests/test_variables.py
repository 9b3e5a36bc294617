"""hyparflow.keras.variables reads and sets variables as Keras' `numpy()` and `assign` do."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hyparflow.keras import variables


def test_value_is_what_numpy_gives_for_keras_and_tf_variables():
    k = keras.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    t = tf.Variable(np.arange(4, dtype=np.int64))
    for v in (k, t):
        got = variables.value(v)
        np.testing.assert_array_equal(got, v.numpy())
        assert got.dtype == v.numpy().dtype


def test_a_value_read_is_not_changed_by_later_updates():
    v = keras.Variable(np.ones(3, np.float32))
    before = variables.value(v)
    v.assign_add(np.ones(3, np.float32))  # in place, where the buffer is not shared
    variables.assign([v], [np.zeros(3, np.float32)])
    np.testing.assert_array_equal(before, np.ones(3, np.float32))


def test_assign_takes_arrays_tensors_and_variables_and_casts_as_keras():
    a = keras.Variable(np.zeros(3, np.float32))
    b = keras.Variable(np.zeros((), np.int64))
    c = tf.Variable(np.zeros(2, np.float32))
    source = keras.Variable(np.array([7.0, 8.0], np.float32))
    wide = np.array([0.1, 1.5, -2.7], np.float64)  # rounded to float32 as Variable.assign does
    variables.assign([a, b, c], [wide, tf.constant(5, tf.int64), source])
    reference = keras.Variable(np.zeros(3, np.float32))
    reference.assign(wide)
    np.testing.assert_array_equal(a.numpy(), reference.numpy())
    assert b.numpy() == 5 and b.numpy().dtype == np.int64
    np.testing.assert_array_equal(c.numpy(), [7.0, 8.0])


def test_assign_copies_an_array():
    v = keras.Variable(np.zeros(4, np.float32))
    array = np.arange(4, dtype=np.float32)
    variables.assign([v], [array])
    array[:] = -1  # the caller reuses its buffer
    np.testing.assert_array_equal(v.numpy(), np.arange(4, dtype=np.float32))


def test_assign_refuses_another_shape_and_unpaired_lists():
    v = keras.Variable(np.zeros((2, 2), np.float32), name="kernel")
    with pytest.raises(ValueError, match=r"kernel has shape \(2, 2\).*shape \(4,\)"):
        variables.assign([v], [np.zeros(4, np.float32)])
    np.testing.assert_array_equal(v.numpy(), np.zeros((2, 2)))
    with pytest.raises(ValueError):
        variables.assign([v], [])
