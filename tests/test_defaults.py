"""hf.fit's speed defaults: the schedule, step graph and balance a call leaves out, weighed by
the steps it plans; the measured cut kept for later calls."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
import models
from hyparflow import defaults
from hyparflow.arguments import Call
from hyparflow.partitioner import timing
from hyparflow.partitioner.graph import LayerGraph


def _call(**given):
    x = np.zeros((1000, 5), "float32")
    return Call(**{"x": x, "y": np.zeros((1000, 3), "float32"), "partitions": 2,
                   "schedule": None, "batch_size": 32, **given})


@pytest.mark.parametrize("given, steps", [
    ({}, 32),  # ceil(1000 / 32)
    ({"epochs": 3, "initial_epoch": 1}, 64),
    ({"epochs": 2, "validation_split": 0.2}, 50),  # ceil(800 / 32) a epoch
    ({"epochs": 2, "validation_split": 0.2, "validation_data": ("x", "y")}, 64),
    ({"epochs": 5, "steps_per_epoch": 7}, 35),
    ({"batch_size": None}, 32),  # Model.fit's 32
    ({"x": {"a": np.zeros((100, 2)), "b": np.zeros((100, 1))}}, 4),
])
def test_the_steps_a_call_plans_are_counted_as_model_fit_runs_them(given, steps):
    assert defaults.planned_steps(_call(**given)) == steps


def test_batches_read_as_they_come_plan_no_count():
    dataset = tf.data.Dataset.from_tensor_slices((np.zeros((64, 5)), np.zeros(64))).batch(8)
    assert defaults.planned_steps(_call(x=dataset, y=None)) is None
    a = defaults.resolve(None, _call(x=dataset, y=None, epochs=1000))
    assert (a.schedule, a.step_graph, a.balance) == ("1f1b", None, "flops")
    assert "shapes may change" in a.defaulted


def test_a_short_call_runs_1f1b_on_the_executor_cut_by_flops():
    a = defaults.resolve(None, _call())
    assert (a.schedule, a.step_graph, a.balance) == ("1f1b", None, "flops")
    assert a.defaulted == ("the defaults for 32 steps: the step graph and a measured cut "
                           "repay their longer first call after ~300")


def test_what_a_call_gives_is_kept():
    a = defaults.resolve(None, _call(schedule="gpipe"))
    assert (a.schedule, a.balance, a.defaulted) == ("gpipe", "flops", None)
    a = defaults.resolve(None, _call(schedule="zb-h1", balance="params", epochs=100))
    assert (a.schedule, a.balance, a.defaulted) == ("zb-h1", "params", None)
    # one stage, or "auto" (the planner chose: its schedule is given by then)
    a = defaults.resolve(None, _call(partitions=1, epochs=100))
    assert (a.schedule, a.balance, a.defaulted) == ("1f1b", "flops", None)


@pytest.fixture
def step_graph_runs(monkeypatch):
    """As in a job whose MPI lets TensorFlow's thread send (this test process has no MPI)."""
    monkeypatch.setattr(defaults, "_step_graph_runs", lambda: True)


def test_a_long_call_runs_interleaved_in_the_step_graph_cut_by_time(step_graph_runs):
    model = models.conv_residual()
    a = defaults.resolve(model, _call(epochs=13))  # 13 × 32 = 416 steps
    assert (a.schedule, a.step_graph, a.balance) == ("interleaved", True, "time")
    assert a.defaulted.startswith("the defaults for 416 steps")
    # the count: 10 × 32 = 320 steps repay the step graph, 9 × 32 = 288 do not
    assert defaults.resolve(model, _call(epochs=10)).step_graph is True
    assert defaults.resolve(model, _call(epochs=9)).step_graph is None
    # a balance given is kept; a split by hand fixes P stages: 1F1B, still in the step graph
    a = defaults.resolve(model, _call(epochs=13, balance="params"))
    assert (a.schedule, a.step_graph, a.balance) == ("interleaved", True, "params")
    a = defaults.resolve(model, _call(epochs=13, balance=[5, 6]))
    assert (a.schedule, a.step_graph, a.balance) == ("1f1b", True, [5, 6])
    # a tied embedding (a layer called at several places), which interleaving refuses
    a = defaults.resolve(models.tied(), _call(epochs=13))
    assert (a.schedule, a.step_graph, a.balance) == ("1f1b", True, "time")
    # a model of fewer calls than 2P stages
    small = models.chain(n=2)
    assert len(LayerGraph.of(small)) < 4
    a = defaults.resolve(small, _call(epochs=13, partitions=2))
    assert (a.schedule, a.step_graph) == ("1f1b", True)


def test_each_choice_left_out_is_made_on_its_own(step_graph_runs):
    model = models.conv_residual()
    # a schedule named, on a long call: the step graph and the measured cut still chosen
    a = defaults.resolve(model, _call(epochs=13, schedule="gpipe"))
    assert (a.schedule, a.step_graph, a.balance) == ("gpipe", True, "time")
    # the step graph pinned off: kept, the cut still measured
    a = defaults.resolve(model, _call(epochs=13, schedule=hf.Schedule("1f1b", step_graph=False)))
    assert (a.schedule, a.step_graph, a.balance) == ("1f1b", False, "time")
    # a short call with a schedule named: only the balance left out is chosen, quietly
    a = defaults.resolve(model, _call(schedule="gpipe"))
    assert (a.schedule, a.step_graph, a.balance, a.defaulted) == ("gpipe", None, "flops", None)
    # "auto" (the planner chose, and predicted): nothing changed
    chosen = _call(epochs=13, schedule="1f1b", balance="time", predicted_speedup=1.5)
    assert defaults.resolve(model, chosen) == chosen


def test_a_long_call_stays_on_the_executor_where_the_step_graph_would_not_fit(
        step_graph_runs):
    # the memory every rank showed the others (auto.resolve): the least a rank may use, the
    # most a rank holds now; the step graph's planner prediction is held against it
    model = models.conv_residual()
    roomy = _call(epochs=13, memory=(8 * 2**30, "the node's memory shared by 2 rank(s)",
                                     2**28))
    a = defaults.resolve(model, roomy)
    assert (a.schedule, a.step_graph, a.balance) == ("interleaved", True, "time")
    tight = roomy.replace(memory=(2**28, "$HYPARFLOW_MEMORY_PER_RANK", 2**28))
    a = defaults.resolve(model, tight)
    assert (a.schedule, a.step_graph, a.balance) == ("1f1b", None, "flops")
    assert re.fullmatch(r"the defaults for 416 steps, without the step graph: its memory, "
                        r"predicted 0\.\d\d GiB a rank, is above the 0\.25 GiB a rank may use "
                        r"\(\$HYPARFLOW_MEMORY_PER_RANK\)", a.defaulted), a.defaulted
    # not known (no /proc/meminfo, no cgroup limit): the step graph, as without a limit
    unknown = roomy.replace(memory=(None, "unknown: no /proc/meminfo nor cgroup limit", 2**28))
    assert defaults.resolve(model, unknown).step_graph is True


def test_recompute_keeps_a_long_call_off_the_step_graph(step_graph_runs):
    a = defaults.resolve(models.conv_residual(), _call(epochs=13, recompute=True))
    assert (a.schedule, a.step_graph, a.balance) == ("1f1b", None, "flops")
    assert a.defaulted == "the defaults for 416 steps, without the step graph: recompute=True"


def test_a_long_call_without_mpi_support_for_the_step_graph_stays_on_the_executor():
    a = defaults.resolve(models.conv_residual(), _call(epochs=13))  # no launcher here
    assert (a.schedule, a.step_graph) == ("1f1b", None)


def test_the_measured_cut_is_kept_for_later_calls(monkeypatch):
    # Timings measured anew differ by a few percent, enough to move a cut among nearly
    # equal ones: a later call of the process reuses the first's, and cuts alike.
    measured = []
    real = timing.profile

    def counted(*args, **kwargs):
        measured.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(timing, "profile", counted)
    model = models.chain(n=3)
    first = hf.partition(model, 2, balance="time", microbatch_size=4)
    second = hf.partition(model, 2, balance="time", microbatch_size=4)
    assert measured == [4]
    assert [len(s.calls) for s in first.stages] == [len(s.calls) for s in second.stages]
    hf.partition(model, 3, balance="time", microbatch_size=4)  # another P: the same timings
    assert measured == [4]
    hf.partition(model, 2, balance="time", microbatch_size=8)  # another size: measured
    assert measured == [4, 8]
    model.layers[-1].trainable = False  # another backward: measured again
    hf.partition(model, 2, balance="time", microbatch_size=4)
    assert measured == [4, 8, 4]
    keras.backend.clear_session()
