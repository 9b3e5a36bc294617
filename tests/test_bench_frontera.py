"""The Frontera projection's arithmetic: a larger image's profile, Amdahl's serial fraction
from two thread counts, and a node's ranks."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import frontera
from hyparflow import planner


def profile():
    return planner.Profile(call_seconds=[1.0, 3.0], call_batch=8,
                           step_seconds={1: 0.5, 8: 2.0, 32: 8.0},
                           split_seconds={1: 0.7, 8: 2.4, 32: 8.8}, update_seconds=0.1,
                           calls_by_size={1: [[0.1, 0.1], [0.2, 0.2]]})


def test_a_larger_image_costs_its_pixels_worth_of_small_ones():
    p = profile()
    scaled = frontera.at_scale(p, 4.0)  # a 64 × 64 image: four 32 × 32 ones
    assert scaled.compute(2) == p.compute(8) == 2.0
    assert scaled.compute(8) == p.compute(32) == 8.0
    assert scaled.handoff(2) == pytest.approx(p.handoff(8))
    assert list(scaled.calls_at(2)[0]) == list(p.calls_at(8)[0])
    assert scaled.update_seconds == p.update_seconds  # the weights do not grow
    assert frontera.at_scale(p, 1.0).compute(5) == p.compute(5)


def test_the_serial_fraction_is_read_from_one_and_two_threads():
    # T2 / T1 = f + (1 - f) / 2  →  f = 2 T2 / T1 - 1
    steps = []
    for r in range(3):
        steps += [{"round": r, "threads": 1, "image": 32, "seconds": {"32": 4.0}},
                  {"round": r, "threads": 2, "image": 32, "seconds": {"32": 3.0}},
                  {"round": r, "threads": 1, "image": 64, "seconds": {"8": 4.4}},
                  {"round": r, "threads": 2, "image": 64, "seconds": {"8": 2.64}}]
    found = frontera.derived(steps)
    assert found["serial_32"] == pytest.approx(0.5)
    assert found["serial"] == pytest.approx(0.2)  # the larger image's
    assert len(found["serial_each"]) == 3
    assert found["pixel_cost"] == pytest.approx(1.1)


def test_a_rank_of_a_node_scales_by_amdahl_and_its_node_contention():
    p = profile()
    alone = frontera.on_node(p, threads=4, serial=0.2, core_speed=1.0, contention=1.3,
                             ranks_per_node=1)
    assert alone.compute(8) == pytest.approx(2.0 * (0.2 + 0.8 / 4))
    assert alone.slowdown(1) == 1.0 and alone.contention == 1.0  # one rank: no contention
    # the hand-off (Python per layer call) gains nothing from threads
    assert alone.split_seconds[8] - alone.step_seconds[8] == pytest.approx(0.4)
    shared = frontera.on_node(p, threads=1, serial=0.2, core_speed=2.0, contention=1.3,
                              ranks_per_node=4)
    assert shared.compute(8) == pytest.approx(1.0)
    assert shared.slowdown(4) == pytest.approx(1.3)  # every rank of the node busy


def test_the_box_runs_are_priced_with_their_own_nodes_ranks():
    # one node of 4 ranks: every rank slowed by the contention of 4, the allreduce in shared
    # memory; 2 nodes of 2: the same contention spread over a node's 2, the ring crossing
    # the slow link
    from hyparflow.partitioner.graph import LayerGraph
    from tests.test_planner import compiled_mlp

    graph = LayerGraph(compiled_mlp())
    p = planner.Profile(call_seconds=[1e-3] * len(graph), call_batch=4,
                        step_seconds={4: 1.0}, split_seconds={4: 1.2}, update_seconds=0.1)
    link = {"latency_s": 1e-4, "bandwidth_Bps": 1e5, "allreduce_bandwidth_Bps": 1e5}
    one, two = (next(r for r in frontera.CALIBRATION if r["key"] == key)
                for key in ("dp-node", "dp"))
    node = frontera.box_prediction(graph, p, 2.0, link, one, 16)
    nodes = frontera.box_prediction(graph, p, 2.0, link, two, 16)
    assert node.step_s == pytest.approx(2.0 * (1.0 + 0.1) + node.allreduce_s)
    assert node.allreduce_s < 1e-3 < nodes.allreduce_s
    assert nodes.step_s - nodes.allreduce_s == pytest.approx(node.step_s - node.allreduce_s)
