"""timing: a model's calls timed compiled, piece by piece, in both stage roles; the split
charging each stage its role's times; the model left as it was."""

import dataclasses
import json

import keras
import numpy as np

import models
from hyparflow import planner
from hyparflow.partitioner import balance, timing
from hyparflow.partitioner.costs import Costs
from hyparflow.partitioner.graph import LayerGraph
from hyparflow.partitioner.split import stage_models


def normalised(seed=0):
    """Convolutions with BatchNormalization and dropout: state that training mode moves."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    x = inputs
    for k in range(3):
        x = keras.layers.Conv2D(4, 3, padding="same", name=f"conv{k}")(x)
        x = keras.layers.BatchNormalization(name=f"bn{k}")(x)
        x = keras.layers.Activation("relu", name=f"relu{k}")(x)
    x = keras.layers.Dropout(0.5, name="drop")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x))


def test_profile_times_every_call_in_pieces_that_start_where_a_stage_may():
    graph = LayerGraph(models.densenet())  # concatenations: not every call may start a stage
    timings = timing.profile(graph, 4, stage_models, repeats=1, pieces=5, seconds=0.0)
    n = len(graph)
    assert sum(timings.pieces) == n and len(timings.pieces) == 5
    assert len(timings.fused) == len(timings.split) == n
    assert all(t > 0 for t in timings.fused) and all(t > 0 for t in timings.split)
    allowed = balance.allowed_starts(graph)
    assert all(allowed[start] for start in np.cumsum(timings.pieces)[:-1])


def test_profile_and_measure_leave_the_weights_and_the_state_as_they_were():
    # The eager per-call profile ran the model's own layers in training mode: every
    # BatchNormalization statistic of the user's model moved on the rank that measured.
    model = normalised()
    before = [w.copy() for w in model.get_weights()]
    timing.profile(LayerGraph(model), 4, stage_models, repeats=1, pieces=3, seconds=0.0)
    planner.measure(model, [2], repeats=1)
    for w, was in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, was)


def test_the_last_stage_is_charged_its_fused_times_the_others_their_split_times():
    # Every call costs 1 on a non-last stage and 0.5 on the last: the even cut (2 | 2)
    # costs 2; the cut that leaves the last stage more calls (1 | 3) costs 1.5.
    costs = Costs("time", "s", np.ones(4), np.zeros(4), {}, last=np.full(4, 0.5))
    sizes, predicted = balance.split(costs, 2)
    assert sizes == [1, 3] and predicted == [1.0, 1.5]
    assert balance.split(Costs("time", "s", np.ones(4), np.zeros(4), {}), 2)[0] == [2, 2]
    assert balance.stage_costs(costs, None, [0, 2, 4]) == [2.0, 1.0]


def test_with_the_step_graph_every_stage_is_charged_its_fused_times(monkeypatch):
    # A step graph compiles a non-last stage's forward with its backward: traced on
    # ResNet-110 (two ranks, 8 samples) such a stage took ~1.04× its calls' fused times, not
    # the 1.26× of their split ones. The first call costs 3 split, 1 fused, the rest 1 either
    # way: split-costed the first stage holds two calls (4 | 4), fused-costed half (3 | 3).
    from hyparflow.partitioner import costs as costs_
    from hyparflow.partitioner import split as split_
    from hyparflow.partitioner.split import partition

    model = models.chain(n=5)  # 6 calls
    graph = LayerGraph(model)
    n = len(graph)
    timings = timing.Timings(fused=[1.0] * n, split=[3.0] + [1.0] * (n - 1), pieces=[n])
    monkeypatch.setattr(split_, "shared_profile", lambda graph, b, comm: timings)
    assert list(costs_.costs(graph, "time", timings=timings).calls) == timings.split
    assert list(costs_.costs(graph, "time", timings=timings, step_graph=True).calls) == \
        timings.fused
    assert [len(s.calls) for s in partition(model, 2, balance="time").stages] == [2, 4]
    assert [len(s.calls) for s in partition(model, 2, balance="time",
                                            step_graph=True).stages] == [3, 3]


def test_the_planner_splits_by_each_stage_role():
    graph = LayerGraph(models.chain(n=5))  # 6 calls
    n = len(graph)
    fused = [1.0] * n
    alike = planner.Profile(call_seconds=fused, call_batch=8, step_seconds={8: 1e-3})
    roles = planner.Profile(call_seconds=fused, call_batch=8, step_seconds={8: 1e-3},
                            call_split_seconds=[2.0] * n)
    assert planner.time_split(graph, alike, 2) == [3, 3]
    # a call costs 2 on the non-last stage, 1 on the last: 2 · 2 = 4 · 1
    assert planner.time_split(graph, roles, 2) == [2, 4]


def test_the_planner_splits_by_the_times_at_the_micro_batch_size():
    # At 8 samples every call costs 1; at 2 samples the first four cost 0.25, the last two 1
    # and 1.5 (a convolution on large maps gains most from a small micro-batch). hf.fit's
    # "time" times the calls at the micro-batch size, and so must the planner.
    graph = LayerGraph(models.chain(n=5))  # 6 calls
    small = [0.25] * 4 + [1.0, 1.5]
    measured = planner.Profile(call_seconds=[1.0] * 6, call_batch=8,
                               step_seconds={2: 1e-3, 8: 4e-3}, calls_by_size={2: [small, []]})
    fused, split = measured.calls_at(2)
    np.testing.assert_allclose(fused, small)
    np.testing.assert_allclose(split, small)  # none measured split: the fused stand in
    # each call on its own line between the sizes: at 4, a third of the way from 2 to 8
    np.testing.assert_allclose(measured.calls_at(4)[0], [0.5] * 4 + [1.0, 1.5 - 0.5 / 3])
    np.testing.assert_allclose(measured.calls_at(8)[0], [1.0] * 6)
    assert planner.time_split(graph, measured, 2) == [3, 3]  # at call_batch
    assert planner.time_split(graph, measured, 2, 2) == [5, 1]  # 4 · 0.25 + 1 | 1.5
    # the prediction at m micro-batches of 2 costs the stages by the split it makes there
    free = planner.Network(latency=0.0, bandwidth=float("inf"))
    p = planner.predict(graph, measured, 2, 1, 4, 8, network=free)
    assert p.microbatch_size == 2 and p.sizes == [5, 1]
    assert planner.predict(graph, measured, 2, 1, 1, 8, network=free).sizes == [3, 3]
    # and the profile's JSON form (keys as text) reads back the same
    again = planner.Profile(**json.loads(json.dumps(dataclasses.asdict(measured))))
    assert again.calls_by_size == {2: [small, []]}


def test_a_mixed_precision_model_is_timed():
    # bfloat16 activations, float32 weights: their gradients differ in dtype (the timed
    # function once summed them as one, and balance="time" failed on every such model)
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = normalised()
    finally:
        keras.config.set_dtype_policy("float32")
    graph = LayerGraph.of(model)
    assert {layer.compute_dtype for layer in model.layers[1:]} == {"bfloat16"}
    got = timing.profile(graph, 4, stage_models, repeats=1, pieces=3)
    assert len(got.fused) == len(got.split) == len(graph)
    assert all(t > 0 for t in got.fused + got.split)



def test_a_keras_hub_task_model_taking_a_dict_of_inputs_is_timed_and_planned():
    # keras-hub's task models take a dict ({"token_ids": ..., "padding_mask": ...}) and
    # refuse its values as a list: the whole model was called with a list of its inputs,
    # and hf.plan / hf.fit("auto") failed in measuring ("The structure of `inputs` doesn't
    # match the expected structure")
    model = models.bert()
    roles = timing.Roles(model)
    assert np.isfinite(roles.fused(roles.inputs(3)))
    profile = planner.measure(model, [1, 2], repeats=1)
    assert sorted(profile.step_seconds) == sorted(profile.split_seconds) == [1, 2]
    assert all(t > 0 for t in profile.step_seconds.values())
