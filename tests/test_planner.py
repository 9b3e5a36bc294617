"""hf.plan: the step-time model term by term,
the ranking, bad arguments, and measuring a real model."""

import re

import keras
import numpy as np
import pytest

import hyparflow as hf
from hyparflow import planner
from hyparflow.partitioner.graph import LayerGraph

FREE = planner.Network(latency=0.0, bandwidth=float("inf"))


def mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = inputs
    for width in (16, 16, 16):
        x = keras.layers.Dense(width, activation="relu")(x)
    outputs = keras.layers.Dense(2)(x)
    return keras.Model(inputs, outputs)


def profile(calls):
    """Per-call times, and a compiled whole model taking 1 ms + 0.1 ms per sample."""
    return planner.Profile(call_seconds=list(calls), call_batch=8,
                           step_seconds={b: 1e-3 + 1e-4 * b for b in (4, 8, 16, 32)})


def test_one_stage_one_replica_is_the_measured_step_and_update():
    graph = LayerGraph(mlp())
    measured = profile([1.0] * len(graph))
    p = planner.predict(graph, measured, 1, 1, 1, 32, network=FREE)
    assert p.step_s == pytest.approx(1e-3 + 1e-4 * 32)
    measured.update_seconds = 5e-4
    p = planner.predict(graph, measured, 1, 1, 1, 32, network=FREE)
    assert p.step_s == pytest.approx(1e-3 + 1e-4 * 32 + 5e-4)
    assert p.images_per_s == pytest.approx(32 / p.step_s)


def test_pipeline_is_fill_and_drain_plus_the_slowest_stage():
    graph = LayerGraph(mlp())
    n = len(graph)
    calls = [1.0] * n
    p = planner.predict(graph, profile(calls), 2, 1, 4, 32, network=FREE, handoff=0.0)
    assert p.microbatch_size == 8 and sum(p.sizes) == n
    compute = 1e-3 + 1e-4 * 8
    shares = [size / n for size in p.sizes]
    stage = [s * compute for s in shares]
    assert p.stage_s == pytest.approx(stage)
    assert p.step_s == pytest.approx(sum(stage) + 3 * max(stage))
    # the hand-off cost falls on every stage but the last, per call
    q = planner.predict(graph, profile(calls), 2, 1, 4, 32, network=FREE, handoff=1e-4)
    assert q.stage_s[0] == pytest.approx(stage[0] + 1e-4 * p.sizes[0])
    assert q.stage_s[1] == pytest.approx(stage[1])


def test_interleaved_runs_its_schedule_on_the_clock_over_twice_the_stages():
    from hyparflow.partitioner import balance, costs

    model = compiled_mlp()
    graph = LayerGraph(model)
    n = len(graph)
    measured = profile([1.0] * n)
    measured.base_bytes = 1e6
    one = planner.predict(graph, measured, 2, 1, 4, 32, network=FREE, handoff=0.0)
    p = planner.predict(graph, measured, 2, 1, 4, 32, "interleaved", network=FREE, handoff=0.0)
    assert p.sizes == [1, 1, 1, 1] and one.sizes == [2, 2]  # P × 2 stages of equal calls
    T = 1e-3 + 1e-4 * 8  # a micro-batch's compute, T/4 a stage
    assert p.stage_s == pytest.approx([T / 4] * 4)
    # 1F1B: fill and drain of two stages of T/2, then three more; interleaved: each rank's
    # T per micro-batch, and half of 1F1B's bubble (the schedule run with forward ⅓,
    # backward ⅔ of each stage's time)
    assert one.step_s == pytest.approx(5 * T / 2)
    assert p.step_s == pytest.approx((4 + 1 / 2) * T / 2)
    # a rank's memory: both its stages', each keeping what the schedule keeps there
    kept = costs.costs(graph, "memory", partitions=4, microbatch_size=8, microbatches=4,
                       optimizer=model.optimizer, schedule="interleaved", chunks=2)
    split, fused = costs.HELD["split"].kept, costs.HELD["fused"].kept
    assert kept.in_flight == pytest.approx((4 * split, 3 * split, 2 * split, fused))
    each = balance.stage_costs(kept, graph, np.arange(5))
    assert p.memory_bytes == pytest.approx(1e6 + max(each[0] + each[2], each[1] + each[3]))
    # asked for, it is ranked with the others: not at P = 1, nor where there are too few
    # places to cut (4 ranks would need 8 stages of 4 calls)
    result = hf.plan(model, ranks=4, batch_size=32, microbatches=(4,), network=FREE,
                     profile=measured, schedules=("1f1b", "interleaved"), verbose=0)
    found = {(q.partitions, q.schedule) for q in result.predictions}
    assert (2, "interleaved") in found and (2, "1f1b") in found
    assert not {(1, "interleaved"), (4, "interleaved")} & found
    assert "interleaved" in result.table()
    # asked alone (hf.fit(schedule="interleaved", partitions="auto")), one stage a rank is
    # still a candidate: it runs data parallel, and may be the fastest
    alone = hf.plan(model, ranks=4, batch_size=32, microbatches=(4,), network=FREE,
                    profile=measured, schedules=("interleaved",), verbose=0)
    assert {(q.partitions, q.replicas) for q in alone.predictions} == {(1, 4), (2, 2)}
    assert alone.find(1, 4, 4, "interleaved").step_s == pytest.approx(
        result.find(1, 4, 4).step_s)
    with pytest.raises(ValueError, match="chunks=0"):
        hf.plan(model, ranks=2, batch_size=8, profile=measured, chunks=0, verbose=0)


def test_the_hand_off_is_the_split_models_extra_time_per_call():
    graph = LayerGraph(mlp())
    n = len(graph)
    measured = profile([1.0] * n)
    # run as a non-last stage runs, the whole model took 2 ms more than fused at 8 samples
    measured.split_seconds = {b: t + 2e-3 for b, t in measured.step_seconds.items()}
    assert measured.handoff(8) == pytest.approx(2e-3 / n)
    without = planner.predict(graph, measured, 2, 1, 4, 32, network=FREE, handoff=0.0)
    p = planner.predict(graph, measured, 2, 1, 4, 32, network=FREE)
    assert p.stage_s[0] - without.stage_s[0] == pytest.approx(2e-3 / n * p.sizes[0])
    assert p.stage_s[1] == pytest.approx(without.stage_s[1])
    # never negative, and the constant when nothing was measured
    measured.split_seconds = {b: t / 2 for b, t in measured.step_seconds.items()}
    assert measured.handoff(8) == 0.0
    assert profile([1.0] * n).handoff(8) == planner.HANDOFF


def test_with_the_step_graph_every_stage_is_priced_and_split_as_the_last():
    graph = LayerGraph(mlp())
    n = len(graph)
    # the first two calls cheap fused but dear split: the executor's split moves its cut
    # earlier; the step graph (each stage's step one compiled graph) costs them fused
    measured = profile([1.0] * n)
    measured.call_split_seconds = [4.0, 4.0] + [1.0] * (n - 2)
    measured.split_seconds = {b: t + 2e-3 for b, t in measured.step_seconds.items()}
    fused = planner.time_split(graph, measured, 2, step_graph=True)
    assert fused == [n // 2, n - n // 2]
    assert planner.time_split(graph, measured, 2)[0] < fused[0]
    p = planner.predict(graph, measured, 2, 1, 4, 32, network=FREE, step_graph=True)
    q = planner.predict(graph, measured, 2, 1, 4, 32, network=FREE, handoff=0.0,
                        split=fused)
    assert p.sizes == fused and p.stage_s == pytest.approx(q.stage_s)  # no hand-off
    assert p.step_s < planner.predict(graph, measured, 2, 1, 4, 32, network=FREE).step_s
    result = hf.plan(mlp(), ranks=2, batch_size=32, microbatches=(4,), network=FREE,
                     profile=measured, step_graph=True, verbose=0)
    assert result.find(2, 1, 4).step_s == pytest.approx(p.step_s)
    # by default the interleaved schedule is ranked too with the step graph (its
    # predictions measured within ±15 %), not with the executor's per-action costs
    assert {q.schedule for q in result.predictions} == {"1f1b", "gpipe", "interleaved"}
    executor = hf.plan(mlp(), ranks=2, batch_size=32, microbatches=(4,), network=FREE,
                       profile=measured, verbose=0)
    assert {q.schedule for q in executor.predictions} == {"1f1b", "gpipe"}
    with pytest.raises(ValueError, match="step_graph=1"):
        hf.plan(mlp(), ranks=2, batch_size=8, profile=measured, step_graph=1, verbose=0)
    # ZB-H1 when listed, with the step graph only: its split backward's W fills part of
    # 1F1B's bubble (the clock of schedule.zero_bubble, W `W_SHARE` of a backward)
    zb = hf.plan(mlp(), ranks=2, batch_size=32, microbatches=(4,), network=FREE,
                 profile=measured, step_graph=True, schedules=("1f1b", "zb-h1"), verbose=0)
    one_f = zb.find(2, 1, 4, "1f1b").step_s
    assert zb.find(2, 1, 4, "zb-h1").step_s < one_f
    with pytest.raises(ValueError, match=r"schedules=\('zb-h1',\) with step_graph=False: the "
                                         r"zero-bubble schedule splits each backward in two .* "
                                         r"Pass step_graph=True"):
        hf.plan(mlp(), ranks=2, batch_size=32, profile=measured, schedules=("zb-h1",),
                verbose=0)


def test_contention_slows_the_compute_of_ranks_busy_at_once(capsys):
    graph = LayerGraph(mlp())
    free = profile([1.0] * len(graph))
    free.update_seconds = 5e-4
    busy = planner.Profile(**dict(vars(free), contention=1.5, contention_ranks=2))
    assert [busy.slowdown(k) for k in (1, 2, 4)] == [1.0, 1.5, 1.5]
    # alone: nothing changes; data parallel: every rank computes at once
    one = planner.predict(graph, busy, 1, 1, 1, 32, network=FREE)
    alone = planner.predict(graph, free, 1, 1, 1, 32, network=FREE)
    assert one.step_s == pytest.approx(alone.step_s)
    dp = planner.predict(graph, busy, 1, 2, 1, 32, network=FREE)
    assert dp.step_s == pytest.approx(1.5 * (1e-3 + 1e-4 * 16 + 5e-4))
    # a pipeline fills and drains one rank at a time, then both compute at once
    alone = planner.predict(graph, free, 2, 1, 4, 32, network=FREE, handoff=0.0)
    p = planner.predict(graph, busy, 2, 1, 4, 32, network=FREE, handoff=0.0)
    work = alone.stage_s
    assert p.update_s == pytest.approx(1.5 * alone.update_s) and p.update_s > 0
    assert p.step_s == pytest.approx(sum(work) + 3 * 1.5 * max(work) + p.update_s)
    # given to hf.plan, over this many ranks of a node
    result = hf.plan(mlp(), ranks=2, batch_size=32, profile=free, contention=1.5, network=FREE,
                     verbose=1)
    assert result.find(1, 2, 1).step_s == pytest.approx(dp.step_s)
    assert "hf.plan: compute 1.50× slower with 2 ranks of a node computing at once" in \
        capsys.readouterr().out
    with pytest.raises(ValueError, match="contention=0.5"):
        hf.plan(mlp(), ranks=2, batch_size=32, profile=free, contention=0.5, verbose=0)


def test_contention_grows_linearly_to_the_ranks_it_was_measured_with():
    graph = LayerGraph(mlp())
    busy = planner.Profile(**dict(vars(profile([1.0] * len(graph))), contention=1.3,
                                  contention_ranks=4))
    assert [busy.slowdown(k) for k in (1, 2, 3, 4, 8)] == pytest.approx(
        [1.0, 1.1, 1.2, 1.3, 1.3])
    # 2 pipelines of 2 stages on a 4-rank node: one stage of each fills (2 busy), then all 4
    free = planner.predict(graph, profile([1.0] * len(graph)), 2, 2, 4, 32, network=FREE,
                           handoff=0.0)
    p = planner.predict(graph, busy, 2, 2, 4, 32, network=FREE, handoff=0.0, ranks_per_node=4)
    assert p.step_s == pytest.approx(1.1 * sum(free.stage_s) + 3 * 1.3 * max(free.stage_s))
    # a given split is used as given
    assert planner.predict(graph, busy, 2, 1, 1, 32, split=[1, len(graph) - 1]).sizes == [
        1, len(graph) - 1]


def test_a_profile_survives_json():
    import dataclasses
    import json

    measured = profile([1.0, 2.0])
    measured.split_seconds = {4: 0.01, 32: 0.02}
    again = planner.Profile(**json.loads(json.dumps(dataclasses.asdict(measured))))
    assert again == measured and again.compute(8) == measured.compute(8)


def test_memory_per_rank_is_the_base_plus_the_partitioners_memory_estimate():
    from hyparflow.partitioner import balance, costs

    model = compiled_mlp()
    graph = LayerGraph(model)
    measured = profile([1.0] * len(graph))
    measured.base_bytes = 1e6
    p = planner.predict(graph, measured, 2, 1, 4, 32, network=FREE)
    kept = costs.costs(graph, "memory", partitions=2, microbatch_size=8, microbatches=4,
                       optimizer=model.optimizer)
    bounds = np.concatenate([[0], np.cumsum(p.sizes)])
    assert p.memory_bytes == pytest.approx(1e6 + max(balance.stage_costs(kept, graph, bounds)))
    # GPipe keeps all four micro-batches on every stage but the last (which fuses forward and
    # backward, as under 1F1B): the partitioner's memory estimate under GPipe, the same way
    g = planner.predict(graph, measured, 2, 1, 4, 32, "gpipe", network=FREE)
    assert g.memory_bytes > p.memory_bytes
    kept_g = costs.costs(graph, "memory", partitions=2, microbatch_size=8, microbatches=4,
                         optimizer=model.optimizer, schedule="gpipe")
    split, fused = costs.HELD["split"].kept, costs.HELD["fused"].kept
    assert kept_g.in_flight == pytest.approx((4 * split, fused))
    assert kept.in_flight == pytest.approx((2 * split, fused))
    assert g.memory_bytes == pytest.approx(1e6 + max(balance.stage_costs(kept_g, graph, bounds)))
    # the step graph runs in TensorFlow's dataflow order: GPipe's micro-batches kept whatever
    # the schedule, each stage in the step graph's role (the graph has every call m times:
    # ResNet-110 measured 0.54 of its whole-run peak at m = 8 when the prediction was the
    # executor's 1F1B); the partitioner's estimate in the step graph, the same way
    kept_s = costs.costs(graph, "memory", partitions=2, microbatch_size=8, microbatches=4,
                         optimizer=model.optimizer, step_graph=True)
    held = costs.HELD["graph"]
    assert kept_s.in_flight == pytest.approx((4 * held.kept, held.kept))
    assert kept_s.calls[0] - kept.calls[0] == pytest.approx(
        held.per_call + 4 * held.per_call_microbatch - costs.HELD["split"].per_call)
    for schedule in ("1f1b", "gpipe", "zb-h1"):
        s = planner.predict(graph, measured, 2, 1, 4, 32, schedule, network=FREE,
                            step_graph=True, split=p.sizes)
        assert s.memory_bytes == pytest.approx(
            1e6 + max(balance.stage_costs(kept_s, graph, bounds))), schedule
    # with replicas, each call holds more: its backward runs beside the thread that sums
    # the gradient buckets
    two = planner.predict(graph, measured, 2, 2, 4, 64, network=FREE, split=p.sizes)
    each = balance.stage_costs(kept, graph, bounds)  # the same micro-batches of 8 samples
    assert two.memory_bytes == pytest.approx(
        1e6 + max(held + costs.REPLICATED * n for held, n in zip(each, p.sizes)))
    # one stage: the whole model, as the partitioner's estimate of one stage has it
    alone = planner.predict(graph, measured, 1, 1, 1, 8, network=FREE)
    whole = costs.costs(graph, "memory", partitions=1, microbatch_size=8, microbatches=1,
                        optimizer=model.optimizer)
    assert whole.in_flight == pytest.approx((costs.HELD["whole"].kept,))
    assert alone.memory_bytes == pytest.approx(
        1e6 + balance.stage_costs(whole, graph, [0, len(graph)])[0])
    # a limit leaves out what does not fit, and says so when nothing does
    result = hf.plan(model, ranks=2, batch_size=32, profile=measured, network=FREE,
                     memory_per_rank=p.memory_bytes, verbose=0)
    assert result.predictions and all(q.memory_bytes <= p.memory_bytes
                                      for q in result.predictions)
    assert not any(q.schedule == "gpipe" and q.microbatches == 4 and q.partitions == 2
                   for q in result.predictions)
    # with a limit, one stage may accumulate over micro-batches to fit
    whole = planner.predict(graph, measured, 1, 2, 1, 32, network=FREE)
    accumulated = planner.predict(graph, measured, 1, 2, 4, 32, network=FREE)
    assert accumulated.memory_bytes < whole.memory_bytes
    result = hf.plan(model, ranks=2, batch_size=32, profile=measured, network=FREE,
                     memory_per_rank=accumulated.memory_bytes, verbose=0)
    kept = {(q.partitions, q.replicas, q.microbatches) for q in result.predictions}
    assert (1, 2, 4) in kept and (1, 2, 1) not in kept
    with pytest.raises(ValueError, match=r"no configuration of ranks=2 fits memory_per_rank"):
        hf.plan(model, ranks=2, batch_size=32, profile=measured, memory_per_rank=1e6,
                verbose=0)
    with pytest.raises(ValueError, match="memory_per_rank=-1"):
        hf.plan(model, ranks=2, batch_size=32, profile=measured, memory_per_rank=-1, verbose=0)


def test_messages_and_the_allreduce_cost_latency_plus_bytes_over_bandwidth():
    graph = LayerGraph(mlp())
    net = planner.Network(latency=1e-3, bandwidth=1e6)
    p = planner.predict(graph, profile([1.0] * len(graph)), 2, 1, 1, 32, network=net,
                        handoff=0.0)
    free = planner.predict(graph, profile([1.0] * len(graph)), 2, 1, 1, 32, network=FREE,
                           handoff=0.0)
    # one 16-wide float32 tensor crosses the cut: 32 samples × 64 bytes each way
    message = 1e-3 + 32 * 64 / 1e6
    assert np.subtract(p.stage_s, free.stage_s) == pytest.approx([message, message])
    r = planner.predict(graph, profile([1.0] * len(graph)), 1, 4, 1, 32, network=net)
    params = sum(int(np.prod(w.shape)) for w in mlp().trainable_weights)
    assert r.allreduce_s == pytest.approx(2 * 3 * 1e-3 + 2 * 3 / 4 * 4 * params / 1e6)


def test_an_allreduce_between_nodes_moves_at_the_measured_allreduce_bandwidth():
    # Two nodes of one rank each: the ring's two steps cross the link. Measured between the
    # box's nodes, an allreduce took 1.45 times what its bytes at the link's bandwidth take.
    graph = LayerGraph(mlp())
    params = sum(int(np.prod(w.shape)) for w in mlp().trainable_weights)
    link = {"latency": 1e-4, "bandwidth": 1e6}
    plain = planner.predict(graph, profile([1.0] * len(graph)), 1, 2, 1, 32, network="shm",
                            allreduce_network=link, ranks_per_node=1)
    assert plain.allreduce_s == pytest.approx(2 * (1e-4 + 4 * params / 2 / 1e6))
    ring = planner.predict(graph, profile([1.0] * len(graph)), 1, 2, 1, 32, network="shm",
                           allreduce_network=dict(link, allreduce_bandwidth=0.5e6),
                           ranks_per_node=1)
    assert ring.allreduce_s == pytest.approx(2 * (1e-4 + 4 * params / 2 / 0.5e6))
    with pytest.raises(ValueError, match="allreduce_bandwidth"):
        planner.predict(graph, profile([1.0] * len(graph)), 1, 2, 1, 32,
                        allreduce_network=dict(link, ring=1.0))


def test_gradient_buckets_reduced_during_the_backward_leave_only_what_outlasts_it(
        monkeypatch):
    # Two nodes of one rank each, 1 MB/s between them: 722 parameters, 2888 bytes, in
    # buckets of 1000 bytes from the last layer back, the last one (the first layers') 888.
    graph = LayerGraph(mlp())
    link = {"latency": 1e-4, "bandwidth": 1e6}

    def ring(nbytes):
        return 2 * (1e-4 + nbytes / 2 / 1e6)

    def allreduce(inter_op, bucket_bytes, per_sample=1e-4):
        measured = planner.Profile(call_seconds=[1.0] * len(graph), call_batch=8,
                                   step_seconds={b: 1e-3 + per_sample * b for b in (8, 16, 32)},
                                   inter_op=inter_op)
        return planner.predict(graph, measured, 1, 2, 1, 32, network="shm",
                               allreduce_network=link, ranks_per_node=1,
                               bucket_bytes=bucket_bytes).allreduce_s

    after = ring(2888)
    assert allreduce(1, 1000) == pytest.approx(after)  # one inter-op thread: no overlap
    assert allreduce(2, 0) == pytest.approx(after)  # $HYPARFLOW_BUCKET_MB=0
    # the backward of b = 16 is ⅔ of 2.6 ms: the ring outlasts it by 1.36 ms
    assert allreduce(2, 1000) == pytest.approx(after - 2 / 3 * (1e-3 + 16e-4))
    # a backward longer than the ring: the last bucket's ring is left
    assert allreduce(2, 1000, per_sample=1e-3) == pytest.approx(ring(888))
    # hyparflow's own size (1 MiB at least): one bucket, handed over at the backward's end
    assert allreduce(2, None) == pytest.approx(after)
    # hf.plan reads $HYPARFLOW_BUCKET_MB as hf.fit does; a sharded optimizer's reduce-scatter
    # is after the backward
    measured = planner.Profile(call_seconds=[1.0] * len(graph), call_batch=8,
                               step_seconds={b: 1e-3 + 1e-4 * b for b in (8, 16, 32)},
                               inter_op=2)

    def planned(**kwargs):
        p = hf.plan(mlp(), 2, 32, microbatches=[1], profile=measured, network="shm",
                    allreduce_network=link, ranks_per_node=1, verbose=0, **kwargs)
        return p.find(1, 2, 1, "1f1b").allreduce_s

    monkeypatch.setenv("HYPARFLOW_BUCKET_MB", str(1000 / 2**20))
    assert planned() == pytest.approx(after - 2 / 3 * (1e-3 + 16e-4))
    assert planned(shard_optimizer=True) == pytest.approx(after)
    monkeypatch.setenv("HYPARFLOW_BUCKET_MB", "lots")
    with pytest.raises(ValueError, match="HYPARFLOW_BUCKET_MB='lots'"):
        planned()


def test_plan_ranks_every_configuration_fastest_first():
    model = mlp()
    graph = LayerGraph(model)
    # a cheap first layer and a costly rest: any split is lopsided, data parallel wins
    result = hf.plan(model, ranks=4, batch_size=32, microbatches=(1, 2, 4, 64),
                     profile=profile([1.0] + [50.0] * (len(graph) - 1)), verbose=0)
    steps = [p.step_s for p in result.predictions]
    assert steps == sorted(steps)
    keys = {(p.partitions, p.replicas, p.microbatches, p.schedule) for p in result.predictions}
    assert (4, 1, 4, "gpipe") in keys and (1, 4, 1, "1f1b") in keys
    assert not any(p.microbatches == 64 for p in result.predictions)  # < 1 sample each
    assert not any(p.partitions == 1 and p.microbatches > 1 for p in result.predictions)
    assert result.best.partitions == 1 and result.best.replicas == 4
    assert "images/s" in result.table()
    assert result.find(2, 2, 2).schedule == "1f1b"


@pytest.mark.parametrize("kwargs, match", [
    (dict(ranks=0), "ranks=0"), (dict(batch_size=-1), "batch_size=-1"),
    (dict(network="ethernet"), "network='ethernet'"), (dict(microbatches=(0,)), "microbatches"),
    (dict(schedules=("zb",)), "schedules")])
def test_bad_arguments_name_themselves(kwargs, match):
    args = dict(dict(ranks=2, batch_size=8, profile=profile([1.0] * 5), verbose=0), **kwargs)
    with pytest.raises(ValueError, match=match):
        hf.plan(mlp(), **args)


def test_measure_times_a_copy_and_leaves_the_model_alone():
    model = mlp()
    before = [w.copy() for w in model.get_weights()]
    result = hf.plan(model, ranks=2, batch_size=16, microbatches=(1, 2), verbose=0,
                     memory_per_rank=None)  # (no limit: every size the candidates have)
    assert sorted(result.profile.step_seconds) == [4, 8, 16]
    assert result.profile.whole_sizes == [16, 8, 4]  # largest first
    assert sorted(result.profile.split_seconds) == [4, 8, 16]
    assert all(t > 0 for t in result.profile.step_seconds.values())
    assert all(t > 0 for t in result.profile.split_seconds.values())
    assert result.profile.contention == 1.0  # one process: nothing to contend with
    assert result.profile.base_bytes > 50 * 2**20  # TensorFlow is loaded
    assert len(result.profile.call_seconds) == len(LayerGraph(model))
    assert result.profile.call_batch == 16
    # the calls timed at the smallest size too, both roles: the split moves with the size
    assert sorted(result.profile.calls_by_size) == [4]
    assert [len(t) for t in result.profile.calls_by_size[4]] == [len(LayerGraph(model))] * 2
    assert all(t > 0 for t in result.profile.calls_by_size[4][0])
    assert result.profile.update_seconds == 0.0  # not compiled: no optimizer to time
    # TensorFlow's threads as it runs them: set here through TF_NUM_INTRAOP_THREADS and
    # TF_NUM_INTEROP_THREADS (conftest: HYPARFLOW_THREADS=1), which its getters report as 0
    assert (result.profile.threads, result.profile.inter_op) == (1, 1)
    assert hf.plan(compiled_mlp(), ranks=1, batch_size=16, verbose=0).profile.update_seconds > 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def _within(monkeypatch, graph, size, timed=True):
    """A limit within which the whole of `graph` can be timed (`timed`: one process's step,
    each call holding what it holds under a tape), or trained, at `size` samples and not at
    twice as many, with the process's memory held still (what `measure` reads as its base)."""
    from hyparflow.mpi import memory as memory_
    from hyparflow.partitioner import costs

    monkeypatch.setattr(memory_, "resident", lambda: 300 * 2**20)
    under_tape = timed * len(graph) * (costs.held_per_call("split") - costs.held_per_call("whole"))
    need = [planner.predict(graph, planner.Profile.for_memory(graph, 300 * 2**20), 1, 1, 1, b)
            .memory_bytes + under_tape for b in (size, 2 * size)]
    assert need[0] < need[1]
    return (need[0] + need[1]) / 2


def conv():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    x = inputs
    for filters in (16, 16, 16):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


def test_measure_within_a_limit_times_the_whole_model_only_where_one_process_fits_it(
        monkeypatch):
    # the planning must not need more memory than the configurations it may choose: the whole
    # model is timed only at the sizes one process fits; elsewhere its pieces stand for it,
    # scaled by the whole over its pieces where both were timed
    model = conv()
    graph = LayerGraph(model)
    limit = _within(monkeypatch, graph, 4)
    profile = planner.measure(model, [2, 4, 8, 16], repeats=1, memory_per_rank=limit)
    assert profile.whole_sizes == [4, 2]
    assert sorted(profile.step_seconds) == sorted(profile.split_seconds) == [2, 4, 8, 16]
    for b in (8, 16):
        for k, table in enumerate((profile.step_seconds, profile.split_seconds)):
            scale = table[4] / np.sum(profile.calls_at(4)[k])
            assert table[b] == pytest.approx(np.sum(profile.calls_at(b)[k]) * scale, rel=1e-9)
    # where one process fits it at no size: the pieces' own sums
    nowhere = planner.measure(model, [8, 16], repeats=1, memory_per_rank=1.0)
    assert nowhere.whole_sizes == []
    assert nowhere.step_seconds[16] == pytest.approx(np.sum(nowhere.calls_at(16)[0]), rel=1e-9)
    assert nowhere.split_seconds[8] == pytest.approx(np.sum(nowhere.calls_at(8)[1]), rel=1e-9)


def test_plan_within_a_limit_measures_only_the_sizes_of_configurations_that_fit_it(
        monkeypatch):
    model = conv()
    graph = LayerGraph(model)
    limit = _within(monkeypatch, graph, 8, timed=False)
    # the sizes of the configurations of 2 ranks (batch 16) predicted to fit at the cut where
    # they need least (any cut the times choose needs as much), and only those (one stage:
    # m > 1 only where m = 1 does not fit)
    least = planner.Profile.for_memory(graph, 300 * 2**20, cut="memory")
    fits = {(P, m): p for P, R in ((1, 2), (2, 1)) for m in (1, 2, 4)
            if (p := planner.predict(graph, least, P, R, m, 16)).memory_bytes <= limit}
    fit = {p.microbatch_size for (P, m), p in fits.items()
           if not (P == 1 and m > 1 and (1, 1) in fits)}
    for m in (1, 2, 4):  # the least indeed: no cut of two stages needs less
        need = planner.predict(graph, least, 2, 1, m, 16).memory_bytes
        assert all(need <= planner.predict(graph, least, 2, 1, m, 16, split=[k, len(graph) - k])
                   .memory_bytes for k in range(1, len(graph)))
    sizes = planner.sizes_to_measure(model, 2, 16, memory_per_rank=limit, microbatches=(1, 2, 4))
    assert sizes == sorted(fit)
    assert planner.sizes_to_measure(model, 2, 16, memory_per_rank=None,
                                    microbatches=(1, 2, 4)) == [2, 4, 8, 16] != sizes
    measured = []
    monkeypatch.setattr(planner, "measure", lambda model, sizes, **kw: measured.append(
        (sizes, kw["memory_per_rank"])) or planner.Profile.for_memory(graph, 300 * 2**20))
    result = hf.plan(model, ranks=2, batch_size=16, microbatches=(1, 2, 4),
                     memory_per_rank=limit, verbose=0)
    assert measured == [(sizes, limit)]
    assert {p.microbatch_size for p in result.predictions} == fit
    # no configuration fits: refused before anything is timed, naming where the limit
    # comes from (hf.fit("auto") passes its Budget: the user gave no memory_per_rank)
    with pytest.raises(ValueError, match="no configuration of ranks=2 fits "
                                         r"memory_per_rank=0\.00 GiB"):
        hf.plan(model, ranks=2, batch_size=16, memory_per_rank=2**20, verbose=0)
    from hyparflow.mpi import memory as memory_

    room = memory_.Budget(2**20, "$HYPARFLOW_MEMORY_PER_RANK")
    for call in (lambda: hf.plan(model, ranks=2, batch_size=16, memory_per_rank=room,
                                 verbose=0),
                 lambda: planner.sizes_to_measure(model, 2, 16, memory_per_rank=room)):
        with pytest.raises(ValueError, match=r"fits the 0\.00 GiB a rank may use "
                                             r"\(\$HYPARFLOW_MEMORY_PER_RANK\)"):
            call()
    assert len(measured) == 1


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.AdamW(learning_rate=0.1),  # weight decay 0.004 by default
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.1)])
def test_timing_the_update_moves_neither_the_weights_nor_the_optimizer(optimizer):
    # the update is timed on zero gradients; weight decay still moves a variable, so it must
    # be timed on copies: hf.fit("auto") measures on rank 0, whose weights every rank takes
    model = mlp()
    model.compile(optimizer=optimizer(), loss="mse")
    before = [w.copy() for w in model.get_weights()]
    profile = planner.measure(model, [4])
    assert profile.update_seconds > 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert not model.optimizer.built and int(model.optimizer.iterations.numpy()) == 0


def compiled_mlp():
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.mark.parametrize("auto", [dict(partitions="auto", replicas="auto"),
                                  dict(schedule="auto"),
                                  dict(schedule=hf.Schedule("auto", step_graph=True))])
def test_fit_auto_in_one_process_is_model_fit(auto):
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 8), dtype=np.float32), rng.random((32, 2), dtype=np.float32)
    ours, theirs = compiled_mlp(), compiled_mlp()
    history = hf.fit(ours, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, **auto)
    reference = theirs.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], reference.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(partitions="auto", replicas=3), "replicas=3 with the other 'auto': the job's 1 MPI"),
    (dict(partitions="auto", replicas="auto", batch_size=None), "batch_size=None.*hf.plan"),
    (dict(partitions="automatic", replicas=1), "partitions='automatic'"),
    (dict(schedule=hf.Schedule("auto", chunks=2)),
     r"schedule=hf.Schedule\('auto', chunks=2\): the planner chooses the schedule"),
    (dict(schedule="auto", partitions=2), r"partitions=2 × replicas=1 needs 2 MPI ranks"),
    (dict(schedule="automatic"), "schedule='automatic' is not a schedule"),
])
def test_fit_auto_bad_arguments(kwargs, match):
    x, y = np.zeros((8, 8), np.float32), np.zeros((8, 2), np.float32)
    args = dict(dict(batch_size=4, verbose=0), **kwargs)
    with pytest.raises(ValueError, match=match):
        hf.fit(compiled_mlp(), x, y, **args)


def test_evaluate_auto_reuses_fits_choice_and_needs_a_fit_first():
    x, y = np.zeros((8, 8), np.float32), np.zeros((8, 2), np.float32)
    model = compiled_mlp()
    with pytest.raises(ValueError, match="hf.evaluate.*not been trained with hf.fit yet"):
        hf.evaluate(model, x, y, partitions="auto", replicas="auto", verbose=0)
    hf.fit(model, x, y, partitions="auto", replicas="auto", batch_size=4, verbose=0)
    assert hf.evaluate(model, x, y, partitions="auto", replicas="auto", batch_size=4,
                       verbose=0) == pytest.approx(model.evaluate(x, y, batch_size=4, verbose=0))
    assert len(model._hyparflow_trainers) == 1


def test_plan_skips_stage_counts_a_shared_layer_forbids():
    keras.utils.set_random_seed(0)
    for shared, planned in ((keras.layers.BatchNormalization(name="shared"), {1}),
                            (keras.layers.Dense(4, name="shared"), {1, 2})):
        inputs = keras.Input((4,))
        x = shared(inputs)
        x = keras.layers.Dense(4)(x)
        outputs = shared(x)  # the same layer at both ends: no cut between, unless tied
        model = keras.Model(inputs, outputs)
        result = hf.plan(model, ranks=2, batch_size=8, profile=profile([1.0] * 3), verbose=0)
        assert {p.partitions for p in result.predictions} == planned, shared


def test_plan_measures_a_model_with_a_free_dimension():
    inputs = keras.Input((None, 3))
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(inputs))
    result = hf.plan(keras.Model(inputs, outputs), ranks=1, batch_size=4, verbose=0)
    assert result.best.partitions == 1 and result.profile.step_seconds[4] > 0


def test_plan_with_nothing_that_fits_says_why():
    calls = profile([1.0] * len(LayerGraph(mlp())))
    with pytest.raises(ValueError, match="no configuration of ranks=2 fits batch_size=2"):
        hf.plan(mlp(), ranks=2, batch_size=2, microbatches=(4,), profile=calls, verbose=0)
    # a micro-batch count the user fixed keeps one-stage candidates
    result = hf.plan(mlp(), ranks=2, batch_size=16, microbatches=(4,), profile=calls,
                     verbose=0)
    assert (1, 2, 4) in {(p.partitions, p.replicas, p.microbatches) for p in result.predictions}


def test_fit_auto_plans_once_per_configuration():
    x, y = np.zeros((8, 8), np.float32), np.zeros((8, 2), np.float32)
    model = compiled_mlp()
    for _ in range(2):
        hf.fit(model, x, y, partitions="auto", replicas="auto", batch_size=4, verbose=0)
    assert len(model._hyparflow_auto) == 1


def test_between_nodes_the_allreduce_and_pipeline_use_the_other_network():
    graph = LayerGraph(mlp())
    slow = planner.Network(latency=1e-3, bandwidth=1e6)
    params = sum(int(np.prod(w.shape)) for w in mlp().trainable_weights)
    one_node = planner.predict(graph, profile([1.0] * len(graph)), 1, 4, 1, 32, network=FREE,
                               allreduce_network=slow)
    assert one_node.allreduce_s == 0.0  # 4 ranks on one node: shared memory (free here)
    two_nodes = planner.predict(graph, profile([1.0] * len(graph)), 1, 4, 1, 32, network=FREE,
                                allreduce_network=slow, ranks_per_node=2)
    assert two_nodes.allreduce_s == pytest.approx(2 * 3 * 1e-3 + 2 * 3 / 4 * 4 * params / 1e6)


def test_only_the_boundaries_between_nodes_pay_the_network():
    # 4 stages on 2 nodes of 2 ranks: only stage 1 → 2 crosses (its activation forward,
    # its error backward); the others are shared memory (free here)
    graph = LayerGraph(mlp())
    slow = planner.Network(latency=1e-3, bandwidth=1e6)
    calls = profile([1.0] * len(graph))
    free = planner.predict(graph, calls, 4, 1, 2, 32, network=FREE, handoff=0.0,
                           split=[1, 1, 1, 1])
    p = planner.predict(graph, calls, 4, 1, 2, 32, network=FREE, allreduce_network=slow,
                        ranks_per_node=2, handoff=0.0, split=[1, 1, 1, 1])
    crossing = 1e-3 + 16 * 4 * 16 / 1e6  # one Dense(16) output of 16 samples, float32
    assert p.stage_s == pytest.approx([free.stage_s[0], free.stage_s[1] + crossing,
                                       free.stage_s[2] + crossing, free.stage_s[3]])
    # the second pipeline starts on a node boundary too: the same
    again = planner.predict(graph, calls, 4, 2, 2, 64, network=FREE, allreduce_network=slow,
                            ranks_per_node=2, handoff=0.0, split=[1, 1, 1, 1])
    assert again.stage_s == pytest.approx(p.stage_s)


def test_stages_reducing_at_once_share_the_link_between_nodes():
    # 2 pipelines of 2 stages, one per node: both stages' rings cross the link at every
    # step, at once; within each node nothing is reduced
    graph = LayerGraph(mlp())
    slow = planner.Network(latency=1e-3, bandwidth=1e6)
    p = planner.predict(graph, profile([1.0] * len(graph)), 2, 2, 1, 32, network=FREE,
                        allreduce_network=slow, ranks_per_node=2)
    terms = planner._split_terms(graph, p.sizes)
    chunks = [nbytes / 2 for nbytes in terms.param_bytes]
    assert p.allreduce_s == pytest.approx(2 * (1e-3 + sum(chunks) / 1e6))
    # on one node each ring's own chunk, the slower of the two stages'
    inside = planner.Network(latency=1e-3, bandwidth=1e6)
    q = planner.predict(graph, profile([1.0] * len(graph)), 2, 2, 1, 32, network=inside,
                        ranks_per_node=4)
    assert q.allreduce_s == pytest.approx(2 * (1e-3 + max(chunks) / 1e6))


def test_by_default_a_rank_gets_its_share_of_the_machine_and_a_model_too_big_for_one_rank_is_cut(
        monkeypatch, capsys):
    model = compiled_mlp()
    graph = LayerGraph(model)
    measured = profile([1.0] * len(graph))
    measured.base_bytes = 1e6
    free = hf.plan(model, ranks=2, batch_size=32, profile=measured, network=FREE,
                   memory_per_rank=None, verbose=0)
    assert free.best.partitions == 1  # data parallel is fastest when memory is no object
    one = min(p.memory_bytes for p in free.predictions if p.partitions == 1)
    two = min(p.memory_bytes for p in free.predictions if p.partitions == 2)
    assert two < one
    # a rank may use less than one stage of the whole model needs, more than half of it
    monkeypatch.setenv("HYPARFLOW_MEMORY_PER_RANK", str((one + two) / 2 / 2**30))
    result = hf.plan(model, ranks=2, batch_size=32, profile=measured, network=FREE, verbose=1)
    assert result.best.partitions == 2 and all(p.partitions == 2 for p in result.predictions)
    out = capsys.readouterr().out
    assert re.search(r"configurations left out, predicted above the \d+\.\d\d GiB a rank may "
                     r"use \(\$HYPARFLOW_MEMORY_PER_RANK\)", out), out
    monkeypatch.setenv("HYPARFLOW_MEMORY_PER_RANK", "lots")
    with pytest.raises(ValueError, match=r"HYPARFLOW_MEMORY_PER_RANK='lots': give the memory one "
                                         r"rank may use in GiB, a number > 0"):
        hf.plan(model, ranks=2, batch_size=32, profile=measured, network=FREE, verbose=0)
