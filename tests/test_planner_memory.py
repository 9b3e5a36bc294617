"""The planner's memory per rank against the peaks `benchmarks/memory_plan.py` recorded."""

import json
import os

import pytest

from benchmarks import harness
from benchmarks.memory_plan import TOLERANCE, predicted_bytes
from benchmarks.models import resnet_v1

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "benchmarks", "results")
# ResNet-56 and -110 v1 (quick to build; ResNet-1001's records are checked by the benchmark):
# one process and two replicas at 16-128 samples, 2 × 1 on the executor and in the step graph
# at m = 1-8 (1F1B, GPipe, interleaved, ZB-H1), 2 × 2
RECORDS = ["session41-memory-step-graph-resnet56", "session41-memory-step-graph-resnet110",
           "session49-memory-1x1-56-b64", "session49-memory-1x1-110-b32",
           "session49-memory-1x1-110-b64", "session49-memory-1x1-110-b128",
           "session49-memory-1x2-110-b32", "session49-memory-1x2-110-b128",
           "session49-memory-2x2-110-b128"]
_graphs = {}


def _graph(depth):
    from hyparflow.partitioner.graph import LayerGraph

    if depth not in _graphs:
        _, _, model = harness.cifar_job(resnet_v1, depth, 8)
        _graphs[depth] = LayerGraph(model)
    return _graphs[depth]


@pytest.mark.parametrize("name", RECORDS)
def test_the_planner_predicts_each_recorded_configuration_within_15_percent_of_its_peak(name):
    with open(os.path.join(RESULTS, name + ".json")) as f:
        record = json.load(f)
    settings = record["settings"]
    assert settings["model"].startswith("resnet_v1(")
    graph = _graph(int(settings["model"][len("resnet_v1("):-1]))
    off = []
    for run in record["runs"]:
        r = run["result"]
        predicted = predicted_bytes(graph, r, settings["batch_size"])
        peak = max(k["peak_kib"] for k in r["ranks"]) * 1024
        if abs(predicted / peak - 1) > TOLERANCE:
            off.append(f"{run['config']}: predicted ÷ peak {predicted / peak:.2f}")
    assert not off, off
