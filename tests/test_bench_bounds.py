"""`benchmarks/bounds.py`'s arithmetic: the most two ranks can give, from steps measured."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bounds


def test_the_bounds_take_the_pairs_steps_and_the_schedules_bubble():
    times = {"one process": 1.2, "one, half batch": 0.6, "pair, half batch": 0.63,
             "one, micro-batch": 0.31, "pair, micro-batch": 0.33}
    got = bounds.bounds(times, update=0.02, microbatches=4)
    assert got["data parallel R = 2"] == pytest.approx(1.2 / 0.63)
    # 1F1B: (m + P − 1) micro-batches' halves of the model; interleaved: (m + (P − 1)/2)
    assert got["pipeline P = 2, 1F1B, m = 4"] == pytest.approx(1.2 / (5 * 0.31 / 2 + 0.01))
    interleaved = "pipeline P = 2, interleaved (2 chunks a rank), m = 4"
    assert got[interleaved] == pytest.approx(1.2 / (4.5 * 0.31 / 2 + 0.01))
    # with no cost beyond compute, two ranks give 2 (less the bubble)
    even = {k: 1.2 * (0.5 if "half" in k else 0.25 if "micro" in k else 1) for k in times}
    assert bounds.bounds(even, 0.0, 4)["data parallel R = 2"] == pytest.approx(2.0)
    assert bounds.bounds(even, 0.0, 4)[interleaved] == pytest.approx(2 / (1 + 1 / 8))
    assert set(bounds.bounds(times, 0.02, 8)) == {"data parallel R = 2"}  # m it did not time


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(SystemExit):
        bounds.parse_args(["--batch", "62", "--microbatches", "4"])
    with pytest.raises(SystemExit):
        bounds.parse_args(["--steps", "1"])
    assert bounds.parse_args([]).microbatches == 4
