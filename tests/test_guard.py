"""The one-line cause other ranks print when a rank fails: the line that names the problem."""

import pytest
import tensorflow as tf

from hyparflow.mpi import guard


def test_a_tensorflow_graph_error_is_told_by_its_cause_not_by_its_first_line():
    @tf.function
    def loss(y, p):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(y, p)

    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        loss(tf.constant([0, 3]), tf.zeros((2, 3)))
    assert str(caught.value).startswith("Graph execution error:")
    assert guard.cause(caught.value).startswith(
        "Received a label value of 3 which is outside the valid range of [0, 3).")


def test_an_error_raised_in_traced_user_code_is_told_by_its_last_line():
    @tf.function
    def step(x):
        if x.shape[-1] == 3:
            raise ValueError("Arguments `target` and `output` must have the same rank (ndim).")
        return x

    with pytest.raises(ValueError) as caught:
        step(tf.zeros((2, 3)))
    assert str(caught.value).startswith("in user code:")
    assert guard.cause(caught.value) == (
        "ValueError: Arguments `target` and `output` must have the same rank (ndim).")


def test_a_plain_error_is_its_first_line_and_a_long_one_is_cut():
    assert guard.cause(RuntimeError("injected failure\nmore")) == "injected failure"
    # raised in a function another calls (the step graph): the function's node is dropped
    assert guard.cause(RuntimeError(
        "{{function_node __inference_<lambda>_649}} Received a label value of 3\n\t [[{{node "
        "x}}]]")) == "Received a label value of 3"
    assert guard.cause(RuntimeError("")) == ""
    assert len(guard.cause(RuntimeError("x" * 1000))) == 400
