"""compose() equals the model for every split; exact balancing; bad partition requests."""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src import tree

import hyparflow as hf
import models
from hyparflow.keras import keras_private
from hyparflow.partitioner import balance
from hyparflow.partitioner import costs as costs_
from hyparflow.partitioner.costs import Costs
from hyparflow.partitioner.graph import LayerGraph, functional_of


def _inputs(model, n=4, seed=0, length=6):
    """Random inputs in the model's own input structure (an axis of unknown size: `length`;
    integer inputs: token ids, the later ones of each row padding, 0; strings: words)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for t in model.inputs:
        shape = (n,) + tuple(length if d is None else d for d in t.shape[1:])
        if t.dtype == "string":
            arrays.append(tf.constant([" ".join(rng.choice(models.WORDS, 3)) for _ in range(n)]))
        elif "int" in str(t.dtype):
            tokens = rng.integers(1, 30, size=shape)
            tokens[np.arange(shape[-1]) >= rng.integers(1, shape[-1] + 1, (n, 1))] = 0
            arrays.append(tokens.astype(str(t.dtype)))
        else:
            arrays.append(rng.normal(size=shape).astype("float32"))
    return tree.pack_sequence_as(functional_of(model)._inputs_struct, arrays)


def _value_and_grads(model, x, variables):
    with tf.GradientTape() as tape:
        outs = tree.flatten(model(x, training=True))
        loss = sum(tf.reduce_sum(o * o * (j + 1)) for j, o in enumerate(outs))
    return [o.numpy() for o in outs], [tf.convert_to_tensor(g).numpy()
                                       for g in tape.gradient(loss, variables)]


@pytest.mark.parametrize("name", sorted(models.BUILDERS))
@pytest.mark.parametrize("method", ["params", "layers", "flops", "memory"])
def test_compose_matches_model_for_every_partition_count(name, method):
    keras.utils.set_random_seed(0)
    model = models.BUILDERS[name]()
    x = _inputs(model)
    variables = model.trainable_variables
    out, grads = _value_and_grads(model, x, variables)
    graph = LayerGraph(model)
    n = len(graph)
    assert n == len(graph.calls) and len({c.name for c in graph.calls}) == n
    for P in range(1, n + 1):
        part = hf.partition(model, partitions=P, balance=method)
        assert len(part.stages) == P
        assert all(st.calls for st in part.stages)
        assert sum(len(st.calls) for st in part.stages) == n
        composed = part.compose()
        # The composed model shares the user's layers: the same variables, no copies.
        assert {id(v) for v in composed.trainable_variables} == {id(v) for v in variables}
        c_out, c_grads = _value_and_grads(composed, x, variables)
        for o, p in zip(c_out, out):
            np.testing.assert_allclose(o, p, rtol=1e-6, atol=1e-6, err_msg=f"P={P}")
        for g, h in zip(c_grads, grads):
            np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-6, err_msg=f"P={P}")


def _run_apart(part, x):
    """The model's outputs from its stages run one after the other as hf.fit runs them: each
    stage model called on its inputs as plain tensors (nothing Keras attached to them, a
    mask included, crosses a cut unless it is a boundary tensor of its own)."""
    graph = part.graph
    env = dict(zip(graph.inputs, [tf.convert_to_tensor(a) for a in tree.flatten(x)]))
    for st in part.stages:
        inputs = [tf.identity(env[k]) for k in st.input_keys]
        env.update(zip(st.output_keys, tree.flatten(st.model(st.pack_inputs(inputs)))))
    return [env[k].numpy() for k in graph.outputs]


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_a_mask_crosses_cuts_with_the_tensor_it_belongs_to(P):
    # Embedding(mask_zero=True)'s mask rides on the tensors after it; MultiHeadAttention
    # reads its query's (no argument of the call records it) and the pooling its input's.
    # Cut between the embedding and those layers, each stage got the tensor without its
    # mask and attended to the padding: 4 × 1 trained 1e-2 away from model.fit, exit 0.
    keras.utils.set_random_seed(0)
    model = models.text()
    x = _inputs(model, n=5)
    want = [o.numpy() for o in tree.flatten(model(x))]
    part = hf.partition(model, P, balance="layers")
    for got, ref in zip(_run_apart(part, x), want):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6, err_msg=part.summary())


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("build, inside", [(models.masked_encoder, ("attn", "cat", "lstm")),
                                           (models.hub_encoder, ("block0", "block1"))])
def test_a_nested_model_called_on_a_masked_tensor_is_cut_through(build, inside, P):
    # Keras records the mask as the nested call's argument and propagates it inside at
    # run time only (the nested model's own graph has none): kept whole, the encoder was
    # one stage and the "pipeline" no pipeline. Cut through, every mask inside it must
    # cross the cuts as it goes at run time: passed on, made anew, deleted by an
    # attention for the calls after it (a first version that read the masks from the
    # layers' compute_mask was 0.48 off with keras-hub's encoders, 2e-3 with Concatenate).
    keras.utils.set_random_seed(0)
    model = build()
    x = _inputs(model, n=5)
    want = [o.numpy() for o in tree.flatten(model(x))]
    part = hf.partition(model, P, balance="layers")
    names = [c.name for c in part.graph.calls]
    assert all(f"encoder/{n}" in names for n in inside), names
    for got, ref in zip(_run_apart(part, x), want):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6, err_msg=part.summary())


@pytest.mark.parametrize("P", [2, 4, 5])
def test_calls_after_an_attention_read_its_inputs_without_their_masks_as_in_keras(P):
    # MultiHeadAttention deletes the masks its inputs carry when it runs; a second
    # attention on the same tensor, after it in Keras' order, attends to the padding in
    # model.fit. A cut between the two gave the second the mask back: 1.7e-2 off at
    # P = 2 and 4, 3.6e-2 at 5 (exit 0).
    keras.utils.set_random_seed(0)
    x = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(40, 8, mask_zero=True)(x)
    h = keras.layers.Dense(8, activation="relu")(h)
    a = keras.layers.MultiHeadAttention(2, 4)(h, h)
    b = keras.layers.MultiHeadAttention(2, 4)(h, h)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Add()([a, b]))
    model = keras.Model(x, keras.layers.Dense(3)(h))
    x = _inputs(model, n=5)
    want = [o.numpy() for o in tree.flatten(model(x))]
    part = hf.partition(model, P, balance="layers")
    for got, ref in zip(_run_apart(part, x), want):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6, err_msg=part.summary())


def _direct_stage_cost(graph, costs, s, a, b):
    """Stage [a, b)'s cost from its definition: its calls, what it receives and what it sends."""
    n = len(graph)
    inside = range(a, b)
    received = {k for c in inside for k in graph.calls[c].inputs
                if graph.producer[k] is not None and graph.producer[k] < a}
    if b == n:
        received |= {k for k in graph.outputs
                     if graph.producer[k] is not None and graph.producer[k] < a}
    sent = {k for c in inside for k in graph.calls[c].outputs
            if any(j >= b for j in graph.consumers.get(k, [])) or (k in graph.outputs and b < n)}
    boundary = sum(costs.tensors[k] for k in received | sent)
    return (sum(costs.calls[a:b])
            + costs.per_stage(s) * (sum(costs.activations[a:b]) + boundary))


@pytest.mark.parametrize("name", ["densenet", "unet", "branch_merge", "multi_io", "nested"])
@pytest.mark.parametrize("seed", range(3))
def test_split_with_communication_is_exact(name, seed):
    """The dynamic program's optimum equals a brute force over every allowed split."""
    model = models.BUILDERS[name]()
    graph = LayerGraph(model)
    n = len(graph)
    rng = np.random.default_rng(seed)
    # Random call costs, activations and cut costs; in-flight factors as 1F1B at P = 4.
    costs = Costs("memory", "bytes", rng.integers(0, 50, n).astype(float),
                  rng.integers(0, 20, n).astype(float),
                  {k: float(rng.integers(0, 40)) for k in graph.tensors}, (4, 3, 2, 1))
    allowed = balance.allowed_starts(graph)
    for parts in range(1, 5):
        costs.in_flight = tuple(range(parts, 0, -1))
        sizes, predicted = balance.split(costs, parts, graph, allowed)
        bounds = list(itertools.accumulate([0] + sizes))
        assert predicted == pytest.approx(
            [_direct_stage_cost(graph, costs, s, a, b)
             for s, (a, b) in enumerate(zip(bounds, bounds[1:]))])
        best = min(
            max(_direct_stage_cost(graph, costs, s, a, b)
                for s, (a, b) in enumerate(zip(bs, bs[1:])))
            for cuts in itertools.combinations([c for c in range(1, n) if allowed[c]], parts - 1)
            for bs in [(0,) + cuts + (n,)])
        assert max(predicted) == pytest.approx(best), (name, parts, sizes)


def test_flops_of_dense_and_conv_layers():
    graph = LayerGraph(models.conv_residual(filters=4))
    by_name = {c.name: costs_.flops(c) for c in graph.calls}
    assert by_name["stem"] == 2 * 16 * 16 * (3 * 3 * 3 * 4)  # positions × kernel weights
    assert by_name["head"] == 2 * 4 * 3
    assert by_name["b0_add"] == 16 * 16 * 4  # one per output element
    # an embedding is a lookup: one per output element, not a product with its table
    tokens = keras.Input((128,), dtype="int32")
    e = keras.layers.Embedding(50000, 64, name="embed")(tokens)
    calls = LayerGraph(keras.Model(tokens, keras.layers.Dense(64, name="proj")(e))).calls
    by_name = {c.name: costs_.flops(c) for c in calls}
    assert by_name["embed"] == 128 * 64
    assert by_name["proj"] == 2 * 128 * 64 * 64


def test_time_balance_profiles_every_call_and_charges_cuts():
    model = models.conv_residual()
    part = hf.partition(model, partitions=2, balance="time", microbatch_size=4)
    c = part.costs
    assert c.unit == "s" and len(c.calls) == 11 and all(t > 0 for t in c.calls)
    assert c.communicates
    assert "ms" in part.summary()
    # each stage in its role: the last stage's calls at their fused times (test_timing)
    assert c.last is not None and len(c.last) == 11 and all(t > 0 for t in c.last)
    assert [st.cost for st in part.stages] == pytest.approx(
        balance.stage_costs(c, part.graph, [0, len(part.stages[0].calls), 11]))


def test_memory_balance_counts_optimizer_slots_and_in_flight_microbatches():
    model = models.chain(n=2, width=8)
    model.compile(optimizer="adam", loss="mse")
    part = hf.partition(model, partitions=3, balance="memory", microbatch_size=2,
                        microbatches=8)
    c = part.costs
    # 1F1B: min(m, P - s) micro-batches kept, each stage holding its role's share of them
    split, fused = costs_.HELD["split"], costs_.HELD["fused"]
    assert c.in_flight == pytest.approx((3 * split.kept, 2 * split.kept, fused.kept))
    # dense0: 5·8 + 8 weights × (weights + gradient sum + 2 Adam slots) × 4 bytes, and what
    # a call of a stage before the last holds; on the last stage, what a fused call holds
    assert c.calls[0] == 48 * 4 * 4 + split.per_call
    assert c.last[0] == 48 * 4 * 4 + fused.per_call
    assert c.activations[0] == 8 * 4 * 2  # 8 float32 outputs per sample × 2 samples


def test_keep_nested_keeps_models_used_as_layers_whole():
    model = models.nested()
    split_through = LayerGraph(model)
    whole = LayerGraph(model, keep_nested=True)
    assert [c.name for c in whole.calls] == ["stem", "outer", "mid", "tail", "head"]
    assert "outer/block/inner_a" in [c.name for c in split_through.calls]
    part = hf.partition(model, partitions=3, keep_nested=True, balance="layers")
    assert sum(len(st.calls) for st in part.stages) == 5


def test_early_output_is_sent_to_the_last_stage_and_late_input_read_where_needed():
    model = models.multi_io()
    part = hf.partition(model, partitions=3, balance=[3, 3, 2])
    first, middle, last = part.stages
    assert first.calls == ["a1", "a2", "reg"]  # the head right after its input
    assert "reg" in first.output_names
    assert first.destinations[first.output_names.index("reg")] == [2]
    assert middle.input_names[:1] == ["b"] and middle.sources[0] is None
    assert middle.data_positions == [1]  # the model's second input
    assert last.output_names == ["cls", "reg"] and "reg" in last.input_names


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
    assert len([line for line in lines if line[:1].isdigit()]) == 3
    assert "(32)" in text  # 8 float32 per sample cross each cut
    assert lines[-1].startswith("imbalance (max/mean cost):")


def test_sequential_models_partition():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(4), keras.layers.Dense(2)])
    x = _inputs(model)
    part = hf.partition(model, partitions=3)
    np.testing.assert_allclose(part.compose()(x), model(x), rtol=1e-6)


def _plain(costs):
    return Costs("layers", "calls", np.array(costs, float), np.zeros(len(costs)), {})


@pytest.mark.parametrize("seed", range(40))
def test_split_is_exact_without_communication(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    costs = [int(c) for c in rng.integers(0, 20, size=n)]
    for parts in range(1, n + 1):
        sizes, predicted = balance.split(_plain(costs), parts)
        assert len(sizes) == parts and all(s >= 1 for s in sizes) and sum(sizes) == n
        bounds = list(itertools.accumulate([0] + sizes))
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert predicted == [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        best = min(max(sum(costs[a:b]) for a, b in zip(bs, bs[1:]))
                   for cuts in itertools.combinations(range(1, n), parts - 1)
                   for bs in [(0,) + cuts + (n,)])
        assert worst == best, (costs, parts, sizes)


def test_split_example_and_evenness():
    assert balance.split(_plain([1, 2, 3, 4, 5]), 2)[0] == [3, 2]
    assert balance.split(_plain([5, 0, 0, 0]), 4)[0] == [1, 1, 1, 1]
    # Among the splits of 7 equal calls whose largest stage has 3, the most even one.
    assert sorted(balance.split(_plain([1] * 7), 3)[0]) == [2, 2, 3]


def test_too_many_partitions_is_a_clear_error():
    model = models.chain(n=2)  # 3 layer calls
    with pytest.raises(ValueError, match=r"partitions=4: .* 3 layer calls.*at most 3"):
        hf.partition(model, partitions=4)


@pytest.mark.parametrize("bad, message", [
    ("flops!", r"balance='flops!' is not a balance method"),
    (5, r"balance=5: use a method name"),
    ([1, 1], r"needs 3 entries"),
    ([2, 2, 2], r"summing to the model's 7 layer calls \(dense0, dense1, .*, head\)"),
    (["nope", "dense3"], r"\['nope'\] name no layer call"),
    (["dense3", "dense1"], r"distinct names .* in the model's order"),
])
def test_bad_balance_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        hf.partition(models.chain(n=6), partitions=3, balance=bad)


def test_a_count_of_calls_names_the_calls_keras_adds():
    # an Embedding with mask_zero adds a call (the mask's not_equal, numbered as Keras names
    # ops: not_equal_3 after others) that a user does not see
    x = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(10, 3, mask_zero=True, name="embed")(x)
    h = keras.layers.LSTM(4, name="lstm")(h)
    model = keras.Model(x, keras.layers.Dense(1, name="out")(h))
    with pytest.raises(ValueError, match=r"summing to the model's 4 layer calls "
                                         r"\(embed, not_equal(_\d+)?, lstm, out\)"):
        hf.partition(model, partitions=2, balance=[1, 2])


def test_subclassed_model_cannot_be_split():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(ValueError, match=r"subclassed keras.Model .*partitions=1"):
        hf.partition(Net(), partitions=2)


def test_shared_layer_calls_stay_on_one_stage_unless_more_stages_tie_their_weights():
    x = keras.Input((4,), name="x")
    shared = keras.layers.Dense(4, name="shared")
    h = keras.layers.Dense(4, name="first")(x)
    h = shared(h)
    h = keras.layers.Dense(4, name="middle")(h)
    h = shared(h)
    h = keras.layers.Dense(4, name="last")(h)
    model = keras.Model(x, h)
    # "layers" alone would cut between the two calls; the split keeps them together.
    part = hf.partition(model, partitions=3, balance="layers")
    assert [st.calls for st in part.stages] == [["first"], ["shared", "middle", "shared.1"],
                                                ["last"]]
    assert part.tied == {}
    # More stages than the cuts outside the shared calls allow: the calls go to two
    # stages, each holding the layer's weights (tied: `hyparflow.engine.tied`), and what the
    # stages compute together is the model.
    for split in (4, ["shared", "middle"]):
        part = hf.partition(model, partitions=4 if split == 4 else 3,
                            balance="layers" if split == 4 else split)
        holders = [st.index for st in part.stages if {"shared", "shared.1"} & set(st.calls)]
        assert len(holders) == 2
        assert part.tied == {"shared/kernel": holders, "shared/bias": holders}
        x_ = _inputs(model)
        np.testing.assert_allclose(_run_apart(part, x_)[0], model(x_).numpy(), rtol=1e-6)
    # A layer with state of its own (statistics, a seed) moves it in each call: it is not
    # tied; the error names the layer, its state and the largest P.
    x = keras.Input((4,), name="x")
    norm = keras.layers.BatchNormalization(name="norm")
    h = norm(keras.layers.Dense(4, name="first")(x))
    h = norm(keras.layers.Dense(4, name="middle")(h))
    model = keras.Model(x, keras.layers.Dense(4, name="last")(h))
    with pytest.raises(ValueError, match=r"partitions=4: .* cut at only 2 places.*update state "
                                         r"of their own \('norm'\).*partitions ≤ 3"):
        hf.partition(model, partitions=4)
    with pytest.raises(ValueError, match=r"layer 'norm' is called at several places "
                                         r"\(\['norm', 'norm.1'\]\) .* stages \[1, 2\]; its "
                                         r"state \(norm/moving_mean"):
        hf.partition(model, partitions=3, balance=["norm", "middle"])


def test_a_layer_that_cannot_be_called_again_is_named():
    class OnlyOnce(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.calls = 0

        def call(self, x):
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("called twice")
            return x * 2.0

        def compute_output_spec(self, x):
            return self.call(x)

    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(4, name="d")(x)
    model = keras.Model(x, keras.layers.Dense(2, name="out")(OnlyOnce(name="once")(h)))
    with pytest.raises(ValueError, match=r"layer call 'once' \(OnlyOnce\) of model .* cannot be "
                                         r"called again (?s:.*)called twice"):
        hf.partition(model, partitions=2, balance=["once"])


def test_the_default_balance_spreads_a_convolutional_resnet_evenly():
    """The default cut follows compute: a ResNet's parameters sit in its last group, so
    cutting by parameters would leave stage 0 most of the layer calls (and of the time)."""
    from benchmarks.models import resnet_v1

    model = resnet_v1(20)
    calls = [len(st.calls) for st in hf.partition(model, partitions=2).stages]
    assert 0.4 <= calls[0] / sum(calls) <= 0.6, calls
    by_params = [len(st.calls) for st in hf.partition(model, 2, balance="params").stages]
    assert by_params[0] / sum(by_params) > 0.65, by_params


def test_a_mask_the_loss_reads_reaches_the_last_stage_wherever_the_cut():
    # Embedding(mask_zero=True) → Dense → per-timestep softmax: model.fit's loss and
    # metrics skip the padded steps (the output carries the mask). The mask crosses each
    # cut as a tensor of its own (received beside the tensor it belongs to, and put back
    # on it), so the last stage's output carries it as the model's does: once refused
    # (a user's trial before that refusal: weights 0.142 apart, exit 0), now trained.
    def build(recurrent):
        x = keras.Input((8,), dtype="int32")
        h = keras.layers.Embedding(30, 8, mask_zero=True)(x)
        if recurrent:
            h = keras.layers.LSTM(4, return_sequences=True)(h)
        h = keras.layers.Dense(8, activation="relu")(h)
        return keras.Model(x, keras.layers.Dense(3, activation="softmax", name="probs")(h))

    keras.utils.set_random_seed(0)
    for recurrent, splits in ((False, ([1, 3], [3, 1], [1, 1, 2])),
                              (True, ([2, 3], [1, 4], [2, 1, 2]))):
        model = build(recurrent)
        x = _inputs(model, n=5, length=8)
        want = model(x)
        for split in splits:
            part = hf.partition(model, len(split), balance=split)
            (last,) = part.stages[-1].model.outputs
            assert keras_private.mask_of(last) is not None, part.summary()
            (got,) = _run_apart(part, x)
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)


def test_a_nested_model_that_cannot_be_cut_through_is_kept_whole_and_its_masks_kept_on_stage():
    """A layer inside a nested model called on a masked tensor gives its output a mask of
    its own at run time that its compute_mask does not make: that mask cannot follow the
    output to another stage, so the nested model stays one call (as keep_nested=True would
    keep it), and the rest of the model is still cut through its calls."""
    from hyparflow.keras import keras_private

    class OwnMask(keras.layers.Layer):
        def call(self, x):
            out = x * 2.0
            keras_private.set_mask(out, keras.ops.greater(keras.ops.sum(x, -1), 0.0))
            return out

    i = keras.Input((None, 4))
    h = keras.layers.Dense(4, name="d1")(OwnMask(name="own")(i))
    inner = keras.Model(i, keras.layers.Dense(4, name="d2")(h), name="inner")
    x = keras.Input((6,), dtype="int32")
    e = keras.layers.Embedding(10, 4, mask_zero=True, name="emb")(x)
    o = keras.layers.GlobalAveragePooling1D(name="pool")(inner(e))
    model = keras.Model(x, keras.layers.Dense(1, name="out")(o))
    names = [c.name for c in LayerGraph(model).calls]
    assert "inner" in names and not [n for n in names if n.startswith("inner/")], names
    # kept whole, the nested model's output still carries the mask OwnMask gives it at run
    # time, which the model's graph does not record: no cut between it and the pooling
    # (a 3-stage cut there averaged over the padding, 0.04 away, exit 0; so did
    # keep_nested=True)
    tokens = np.array([[1, 2, 0, 0, 0, 0], [3, 4, 5, 6, 0, 0]])
    for P, keep in itertools.product((2, 3), (False, True)):
        part = hf.partition(model, partitions=P, balance="layers", keep_nested=keep)
        np.testing.assert_allclose(_run_apart(part, tokens)[0], model(tokens), rtol=1e-6,
                                   err_msg=part.summary())
    with pytest.raises(ValueError, match=r"balance=\['pool'\] cuts model .* after 'inner', "
                                         r"which 'inner' gives a Keras mask at run time"):
        hf.partition(model, partitions=2, balance=["pool"])
