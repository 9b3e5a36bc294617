"""compose() equals the model for every split; exact balancing; bad partition requests."""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
import models
from hyparflow.partitioner import balance
from hyparflow.partitioner.graph import LayerGraph


def _inputs(model, n=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n,) + tuple(model.inputs[0].shape[1:])).astype("float32")


def _value_and_grads(model, x, variables):
    with tf.GradientTape() as tape:
        out = model(x, training=True)
        loss = tf.reduce_sum(out * out)
    return out.numpy(), [g.numpy() for g in tape.gradient(loss, variables)]


@pytest.mark.parametrize("name", sorted(models.BUILDERS))
@pytest.mark.parametrize("method", ["params", "layers"])
def test_compose_matches_model_for_every_partition_count(name, method):
    keras.utils.set_random_seed(0)
    model = models.BUILDERS[name]()
    x = _inputs(model)
    variables = model.trainable_variables
    out, grads = _value_and_grads(model, x, variables)
    n = len(LayerGraph(model))
    for P in range(1, n + 1):
        part = hf.partition(model, partitions=P, balance=method)
        assert len(part.stages) == P
        assert all(st.calls for st in part.stages)
        assert sum(len(st.calls) for st in part.stages) == n
        composed = part.compose()
        # The composed model shares the user's layers: the same variables, no copies.
        assert {id(v) for v in composed.trainable_variables} == {id(v) for v in variables}
        c_out, c_grads = _value_and_grads(composed, x, variables)
        np.testing.assert_allclose(c_out, out, rtol=1e-6, atol=1e-6, err_msg=f"P={P}")
        for g, h in zip(c_grads, grads):
            np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-6, err_msg=f"P={P}")


def test_skip_connection_goes_direct_to_every_consumer():
    model = models.branch_merge()
    # stem | a1 a2 b1 | c1 merge mix | skip head: stem feeds stages 1, 2 and 3.
    part = hf.partition(model, partitions=4, balance=[1, 3, 3, 2])
    s0 = part.stages[0]
    assert s0.output_names == ["stem"]
    assert s0.destinations == [[1, 2, 3]]
    last = part.stages[3]
    assert last.input_names == ["stem", "mix"]
    assert last.sources == [0, 2]


def test_stage_names_and_order():
    model = models.residual(blocks=2)
    part = hf.partition(model, partitions=2, balance=["b1_a"])
    first, second = part.stages
    assert first.input_names == ["x"] and first.sources == [None]
    assert first.calls[-1] == "b0_relu" and second.calls[0] == "b1_a"
    assert first.output_names == ["b0_relu"]
    assert second.input_names == ["b0_relu"]
    assert second.output_names == ["head"]
    assert second.model.count_params() + first.model.count_params() == model.count_params()


def test_summary_lists_every_stage_and_boundary_bytes():
    model = models.residual(blocks=2, width=8)
    text = hf.partition(model, partitions=3).summary()
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["stage", "layers"]
    assert len([l for l in lines if l[:1].isdigit()]) == 3
    assert "(32)" in text  # 8 float32 per sample cross each cut
    assert lines[-1].startswith("imbalance (max/mean cost):")


def test_sequential_models_partition():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(4), keras.layers.Dense(2)])
    x = _inputs(model)
    part = hf.partition(model, partitions=3)
    np.testing.assert_allclose(part.compose()(x), model(x), rtol=1e-6)


@pytest.mark.parametrize("seed", range(40))
def test_min_max_split_is_exact(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    costs = [int(c) for c in rng.integers(0, 20, size=n)]
    for parts in range(1, n + 1):
        sizes = balance.min_max_split(costs, parts)
        assert len(sizes) == parts and all(s >= 1 for s in sizes) and sum(sizes) == n
        bounds = list(itertools.accumulate([0] + sizes))
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert worst == balance.brute_force_split(costs, parts), (costs, parts, sizes)


def test_min_max_split_example():
    assert balance.min_max_split([1, 2, 3, 4, 5], 2) == [3, 2]
    assert balance.min_max_split([5, 0, 0, 0], 4) == [1, 1, 1, 1]


def test_too_many_partitions_is_a_clear_error():
    model = models.chain(n=2)  # 3 layer calls
    with pytest.raises(ValueError, match=r"partitions=4: .* 3 layer calls.*at most 3"):
        hf.partition(model, partitions=4)


@pytest.mark.parametrize("bad, message", [
    ("flops!", r"balance='flops!' is not a balance method"),
    ([1, 1], r"needs 3 entries"),
    ([2, 2, 2], r"summing to the model's 7 layer calls"),
    (["nope", "dense3"], r"\['nope'\] name no layer call"),
    (["dense3", "dense1"], r"distinct names .* in the model's order"),
])
def test_bad_balance_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        hf.partition(models.chain(n=6), partitions=3, balance=bad)


def test_subclassed_model_cannot_be_split():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(ValueError, match=r"subclassed keras.Model .*partitions=1"):
        hf.partition(Net(), partitions=2)


def test_shared_layer_split_across_stages_is_a_clear_error():
    x = keras.Input((4,), name="x")
    shared = keras.layers.Dense(4, name="shared")
    h = shared(x)
    h = keras.layers.Dense(4, name="middle")(h)
    h = shared(h)
    model = keras.Model(x, h)
    with pytest.raises(ValueError, match=r"layer 'shared' is called at several places"):
        hf.partition(model, partitions=3, balance="layers")
    # Kept on one stage, it is fine.
    part = hf.partition(model, partitions=1)
    assert part.stages[0].calls == ["shared", "middle", "shared.1"]
