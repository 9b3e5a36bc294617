"""StageWorker: preparing ahead of the first micro-batch
changes nothing but the compiled functions."""

import keras
import numpy as np
import tensorflow as tf

import hyparflow as hf
from hyparflow.engine.stage import StageWorker
from hyparflow.keras.keras_private import symbolic_build


def model_and_stages():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, name="d1")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Dropout(0.5, name="drop")(h)
    h = keras.layers.Dense(8, activation="relu", name="d2")(h)
    outputs = keras.layers.Dense(3, name="out")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    part = hf.partition(model, 2, balance=["d2"])
    functional = part.graph.functional
    first = StageWorker(part.stages[0], model, False, functional)
    last = StageWorker(part.stages[1], model, True, functional)
    return model, first, last


def values(variables):
    return [v.numpy().copy() for v in variables]


def test_a_prepared_stage_runs_its_first_micro_batch_without_tracing_and_kept_its_state():
    model, first, last = model_and_stages()
    x = np.random.default_rng(0).random((4, 6)).astype(np.float32)
    y = np.array([0, 1, 2, 0], np.int32)
    symbolic_build(model, x[:1], y[:1])
    state = values(first.state)
    assert any("seed" in v.path or "moving" in v.path for v in first.state)
    first.prepare([tf.TensorSpec((4, 6), tf.float32)], None, None, "forward")
    # ran forward and backward once on zeros: BatchNormalization statistics, the dropout
    # seed and the gradient sums are as before
    for a, b in zip(state, values(first.state)):
        np.testing.assert_array_equal(a, b)
    assert all(not np.any(v) for v in values(t for t in first._sums if t is not None))
    traces = first._forward.experimental_get_tracing_count()
    assert traces == 1
    outputs, _ = first.forward(0, [x], None, None, 0.25)
    assert first._forward.experimental_get_tracing_count() == traces  # no new trace
    first.backward(0, [np.ones_like(outputs[0].numpy())])
    # the last stage runs its fused function on zeros too: its loss trackers, metrics and
    # gradient sums have not kept them
    counted = values(last._metric_variables())
    assert counted and len(counted) >= len(model._compile_metrics.variables)
    last.prepare([tf.TensorSpec((4, 8), tf.float32)], [y], None, "fused")
    assert last._fused.experimental_get_tracing_count() == 1
    for a, b in zip(counted, values(last._metric_variables())):
        np.testing.assert_array_equal(a, b)
    assert any(t is not None for t in last._sums)  # made when the fused backward traced
    assert all(not np.any(v) for v in values(t for t in last._sums if t is not None))
    last.forward_backward(0, [outputs[0].numpy()], [y], None, 0.25)
    assert last._fused.experimental_get_tracing_count() == 1


def test_a_stage_prepared_for_inference_evaluates_without_tracing_and_kept_its_metrics():
    model, first, last = model_and_stages()
    x = np.random.default_rng(0).random((4, 6)).astype(np.float32)
    y = np.array([0, 1, 2, 0], np.int32)
    symbolic_build(model, x[:1], y[:1])
    counted = values(last._metric_variables())
    first.prepare([tf.TensorSpec((4, 6), tf.float32)], None, None, "infer")
    last.prepare([tf.TensorSpec((4, 8), tf.float32)], [y], None, "infer")
    # evaluated zeros once: the loss trackers and metrics do not count them
    for a, b in zip(counted, values(last._metric_variables())):
        np.testing.assert_array_equal(a, b)
    assert first._infer.experimental_get_tracing_count() == 1
    assert last._infer.experimental_get_tracing_count() == 1
    assert first._forward.experimental_get_tracing_count() == 0  # nothing for training
    outputs, _ = first.infer([x], None, None, 0.25)
    last.infer([outputs[0].numpy()], [y], None, 0.25)
    assert first._infer.experimental_get_tracing_count() == 1
    assert last._infer.experimental_get_tracing_count() == 1


def test_a_recomputing_stage_prepares_its_inference_function_for_inference():
    _, first, _ = model_and_stages()
    first.prepare([tf.TensorSpec((4, 6), tf.float32)], None, None, "infer")
    assert first._infer.experimental_get_tracing_count() == 1
    assert first._forward.experimental_get_tracing_count() == 0
    assert first._recompute.experimental_get_tracing_count() == 0


def test_a_stage_prepared_to_recompute_traces_what_recomputing_runs_and_kept_its_state():
    model, first, _ = model_and_stages()
    x = np.random.default_rng(0).random((4, 6)).astype(np.float32)
    symbolic_build(model, x[:1], np.zeros(1, np.int32))
    state = values(first.state)
    first.prepare([tf.TensorSpec((4, 6), tf.float32)], None, None, "recompute")
    for a, b in zip(state, values(first.state)):
        np.testing.assert_array_equal(a, b)
    assert all(not np.any(v) for v in values(t for t in first._sums if t is not None))
    traced = (first._forward.experimental_get_tracing_count(),
              first._recompute.experimental_get_tracing_count())
    assert traced == (1, 1)
    outputs, _ = first.forward(0, [x], None, None, 0.25, recompute=True)
    first.backward(0, [np.ones_like(outputs[0].numpy())])
    assert (first._forward.experimental_get_tracing_count(),
            first._recompute.experimental_get_tracing_count()) == traced


def test_each_micro_batch_is_differentiated_as_its_forward_kept_it():
    # one micro-batch kept under its tape, the next recomputed: the gradients, the partial
    # errors and the moving statistics are those of two taped micro-batches
    rng = np.random.default_rng(1)
    xs = [rng.random((4, 6)).astype(np.float32) for _ in range(2)]
    errors = [rng.random((4, 8)).astype(np.float32) for _ in range(2)]
    results = []
    for modes in ((False, False), (False, True), (True, False)):
        model, first, _ = model_and_stages()
        symbolic_build(model, xs[0][:1], np.zeros(1, np.int32))
        for i, (x, recompute) in enumerate(zip(xs, modes)):
            first.forward(i, [x], None, None, 0.5, recompute=recompute)
        sent = [first.backward(i, [errors[i]]) for i in (1, 0)]
        assert not first._kept
        results.append((values(first.gradients()), sent, values(first.state)))
    for other in results[1:]:
        for a, b in zip(tree_leaves(results[0]), tree_leaves(other)):
            np.testing.assert_array_equal(a, b)


def tree_leaves(value):
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in tree_leaves(item)]
    return [np.asarray(value)]


def test_a_stage_knows_which_gradients_keras_sums_over_the_batch_in_float16():
    # mixed_float16: a float16 layer's kernel and bias gradients end in a cast from float16
    # (Keras sums them over the batch in float16: inf beyond 65504); BatchNormalization
    # computes in float32, and so does a layer given dtype="float32". Found ahead by a
    # stage whose backward runs eagerly (a loss-scaling optimizer asks), and as the fused
    # function traces on the last stage.
    from hyparflow.keras import optimizers

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        h = keras.layers.Dense(8, name="d1")(inputs)
        h = keras.layers.BatchNormalization(name="bn")(h)
        h = keras.layers.Dense(8, name="d2")(h)
        outputs = keras.layers.Dense(3, dtype="float32", name="out")(h)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
                      loss="sparse_categorical_crossentropy")
        part = hf.partition(model, 2, balance=["d2"])
        first = StageWorker(part.stages[0], model, False, part.graph.functional,
                            find_half=True)
        last = StageWorker(part.stages[1], model, True, part.graph.functional)
        y = np.array([0, 1, 2, 0], np.int32)
        symbolic_build(model, np.zeros((1, 6), np.float32), y[:1])
        first.prepare([tf.TensorSpec((4, 6), tf.float32)], None, None, "forward")
        last.prepare([tf.TensorSpec((4, 8), tf.float16)], [y], None, "fused")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half = {v.path: h for w in (first, last) for v, h in zip(w.variables, w.in_half)}
    assert half == {"d1/kernel": True, "d1/bias": True, "bn/gamma": False, "bn/beta": False,
                    "d2/kernel": True, "d2/bias": True, "out/kernel": False,
                    "out/bias": False}, half
    assert first.has_gradient == [True] * 4  # as the tape has them (not changed by the trace)
    grads = [np.full((2,), 7e4, np.float32), np.full((2,), 6.5e4, np.float32), None]
    assert optimizers.beyond_half(grads, [False, True, True]) is False  # 65000: float16's
    assert optimizers.beyond_half(grads, [True, False, False]) is True  # 70000 → inf
    assert optimizers.beyond_half([tf.IndexedSlices(tf.constant([[7e4]]), tf.constant([0]))],
                                  [True]) is False  # rows are never summed over the batch


def _first_stage_models():
    """(name, model, x, where the first stage ends): the layers a split backward meets."""
    reg = keras.regularizers.L2(1e-2)
    rng = np.random.default_rng(3)
    keras.utils.set_random_seed(0)
    i = keras.Input((8, 8, 3))  # convolutions with L2 (two reads of a kernel), BN, bias
    h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, kernel_regularizer=reg,
                            name="c1")(i)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Activation("relu", name="r")(h)
    h = keras.layers.Conv2D(4, 3, padding="same", bias_regularizer=reg, name="c2")(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(h)
    h = keras.layers.Flatten(name="flat")(h)
    o = keras.layers.Dense(3, name="out")(h)
    yield "conv", keras.Model(i, o), rng.random((4, 8, 8, 3)).astype(np.float32), "flat"
    i = keras.Input((6,))  # one Dense called twice: its kernel read twice, in series
    shared = keras.layers.Dense(6, activation="tanh", name="shared")
    h = shared(shared(i))
    h = keras.layers.Dense(5, name="d")(h)
    o = keras.layers.Dense(3, name="out")(h)
    yield "shared", keras.Model(i, o), rng.random((4, 6)).astype(np.float32), "out"
    i = keras.Input((5,), dtype="int32")  # an Embedding (sparse rows), a masked LSTM
    h = keras.layers.Embedding(11, 4, mask_zero=True, name="emb")(i)
    h = keras.layers.LSTM(6, return_sequences=True, name="lstm")(h)
    h = keras.layers.MultiHeadAttention(2, 3, name="mha")(h, h)  # EinsumDense
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    o = keras.layers.Dense(3, name="out")(h)
    yield "sequence", keras.Model(i, o), rng.integers(0, 11, (4, 5)).astype(np.int32), "out"


def test_a_backward_split_in_b_and_w_gives_the_whole_backwards_gradients():
    # ZB-H1's B (partial errors, and the gradients of what only separable ops use are kept
    # at those ops' outputs) then W (those weight gradients): in one graph, the same partial
    # errors and weight gradients as one tape.gradient, and the same record of which have
    # gradients and which are float16 sums; what neither handles stays whole in B
    for policy in ("float32", "mixed_float16"):
        keras.mixed_precision.set_global_policy(policy)
        try:
            for name, model, x, cut in _first_stage_models():
                model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
                part = hf.partition(model, 2, balance=[cut])
                symbolic_build(model, x[:1], np.zeros(1, np.int32))
                results = []
                for split in (False, True):
                    first = StageWorker(part.stages[0], model, False, part.graph.functional)
                    seed = tf.random.stateless_normal(
                        (4,) + tuple(part.stages[0].model.outputs[0].shape[1:]), (1, 2),
                        dtype=part.stages[0].model.outputs[0].dtype)

                    @tf.function
                    def step(x, seed, first=first, split=split):
                        kept = first.taped(first._forward_fn, [x], None, None,
                                           tf.constant(0.25), split)
                        if not split:
                            grads, rows, added = kept.backward(first, [seed])
                        else:
                            grads, rows, added, later = kept.split_backward(first, [seed])
                            with tf.control_dependencies(added):
                                _, added = later.backward(first)
                        with tf.control_dependencies(added):
                            return [tf.identity(g) for g in grads], rows
                    grads, rows = step(tf.constant(x), seed)
                    first._keep_rows(0, rows)
                    results.append((grads, first.gradients(), list(first.has_gradient),
                                    list(first.in_half)))
                (g0, w0, has0, half0), (g1, w1, has1, half1) = results
                assert has0 == has1 and half0 == half1, (name, policy)
                assert any(half0) == (policy == "mixed_float16"), (name, policy)
                for a, b in zip(g0 + w0, g1 + w1):
                    if isinstance(a, tf.IndexedSlices):
                        a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
                    assert (a is None) == (b is None)
                    if a is not None:
                        np.testing.assert_allclose(np.asarray(a, np.float64),
                                                   np.asarray(b, np.float64),
                                                   rtol=1e-6, atol=1e-7, err_msg=name)
        finally:
            keras.mixed_precision.set_global_policy("float32")


def test_the_weight_pass_builds_only_the_ops_between_each_weight_and_its_use():
    # W differentiates each op alone: a few ops a variable, however deep the stage (a tape
    # would build every deferred op's upstream gradient too: for ResNet-110's stages, a
    # step graph of gigabytes that took minutes to compile)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = inputs
    for k in range(30):
        h = keras.layers.Dense(8, activation="tanh", name=f"d{k}")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, name="out")(h))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    part = hf.partition(model, 2, balance=["out"])
    first = StageWorker(part.stages[0], model, False, part.graph.functional)
    built = {}

    @tf.function
    def step(x, seed):
        graph = tf.compat.v1.get_default_graph()
        kept = first.taped(first._forward_fn, [x], None, None, tf.constant(0.25), True)
        grads, _, added, later = kept.split_backward(first, [seed])
        before = len(graph.get_operations())
        with tf.control_dependencies(added):
            _, added = later.backward(first)
        built["ops"] = len(graph.get_operations()) - before
        with tf.control_dependencies(added):
            return [tf.identity(g) for g in grads] + [tf.constant(0.0)]

    step.get_concrete_function(tf.TensorSpec((4, 8)), tf.TensorSpec((4, 8)))
    assert len(first.variables) == 60 and 0 < built["ops"] <= 8 * 60, built
