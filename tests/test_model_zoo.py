"""Model-zoo architectures and a thousand-layer ResNet partition, compose exactly and quickly."""

import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
from hyparflow.partitioner.graph import LayerGraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import models as bench_models

ZOO = {
    "ResNet50V2": (keras.applications.ResNet50V2, 32),
    "DenseNet121": (keras.applications.DenseNet121, 32),
    "InceptionV3": (keras.applications.InceptionV3, 75),
    "MobileNetV2": (keras.applications.MobileNetV2, 32),
    "EfficientNetB0": (keras.applications.EfficientNetB0, 32),
}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_model_zoo_architectures_split_and_compose(name):
    build, size = ZOO[name]
    keras.utils.set_random_seed(0)
    model = build(weights=None, input_shape=(size, size, 3), classes=5)
    n = len(LayerGraph(model))
    x = np.random.default_rng(0).normal(size=(2, size, size, 3)).astype("float32")
    variables = model.trainable_variables

    def value_and_grads(m):
        with tf.GradientTape() as tape:
            out = m(x, training=False)
            loss = tf.reduce_sum(out * tf.range(5, dtype=out.dtype))
        return out.numpy(), tape.gradient(loss, variables)

    out, grads = value_and_grads(model)
    for P, method in [(2, "params"), (5, "flops"), (16, "memory")]:
        part = hf.partition(model, partitions=P, balance=method)
        assert [len(st.calls) > 0 for st in part.stages] == [True] * P
        assert sum(len(st.calls) for st in part.stages) == n
        c_out, c_grads = value_and_grads(part.compose())
        np.testing.assert_allclose(c_out, out, rtol=1e-5, atol=1e-6, err_msg=f"P={P}")
        for g, h, v in zip(c_grads, grads, variables):
            np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-6, err_msg=f"P={P} {v.path}")


def test_thousand_layer_resnet_partitions_into_eight_balanced_stages():
    # (how long it takes is not asserted: timings belong in benchmarks/, not in tests)
    model = bench_models.resnet_v2(depth=1001)
    graph = LayerGraph(model)
    part = hf.partition(model, partitions=8, balance="memory", microbatch_size=4)
    assert len(graph) > 3000
    assert sum(len(st.calls) for st in part.stages) == len(graph)
    costs = [st.cost for st in part.stages]
    assert max(costs) / (sum(costs) / len(costs)) < 1.1
