"""The benchmark suite's pure parts:
the depth search under a memory cap, and ResNet v2 at any depth."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import suite


def test_first_guess_extends_the_line_through_the_probes():
    # 2 MiB per layer from 600 MiB at depth 56: 1024 MiB is reached at depth 268.
    assert suite.next_depth({56: 600.0, 164: 816.0}, cap=1024) == 266  # 3k + 2 below 268


def test_search_narrows_between_the_deepest_fit_and_the_shallowest_failure():
    points = {56: 600.0, 164: 816.0, 266: 1100.0}  # the line bent upwards: 266 does not fit
    depth = suite.next_depth(points, cap=1024)
    assert 164 < depth < 266
    # secant between (164, 816) and (266, 1100): 1024 MiB at ≈ 238.7
    assert depth == 236


def test_search_goes_past_the_deepest_fit_until_something_does_not_fit():
    # the line says 278 would still be 4 MiB short of the cap: try it anyway
    assert suite.next_depth({272: 4052.0, 275: 4092.0}, cap=4096) == 278


def test_search_stops_when_the_gap_is_small_or_nothing_fits():
    assert suite.next_depth({200: 900.0, 206: 1100.0}, cap=1024) is None
    assert suite.next_depth({56: 2000.0, 164: 3000.0}, cap=1024) is None
    # a failed run counts as over the cap, and the search halves the gap
    assert suite.next_depth({56: 600.0, 164: 816.0, 400: None}, cap=1024) == 281


def test_valid_depths():
    assert [suite.valid_v2(d) for d in (5000, 5001, 1001.9, 3)] == [5000, 5000, 1001, 11]


def test_resnet_v2_any_depth_3k_plus_2():
    from benchmarks.models import resnet_v2

    def weighted(model):  # the depth counts convolutions and the classifier, not shortcuts
        return sum(1 for layer in model.layers if type(layer).__name__ in ("Conv2D", "Dense")
                   and not layer.name.endswith("_shortcut"))

    def blocks(model, stage):
        return len({layer.name.split("_")[1] for layer in model.layers
                    if layer.name.startswith(f"stage{stage}_block")})

    model = resnet_v2(41)  # 13 blocks, not 9n + 2: shared out 5, 4, 4
    assert weighted(model) == 41
    assert [blocks(model, s) for s in (1, 2, 3)] == [5, 4, 4]
    assert [blocks(resnet_v2(29), s) for s in (1, 2, 3)] == [3, 3, 3]
    with pytest.raises(ValueError, match="depth=30 .* 3n\\+2 .* n ≥ 3"):
        resnet_v2(30)


def test_wait_shares_are_per_rank_medians_over_steps():
    def span(rank, kind, step, start, dur):
        return {"ph": "X", "tid": rank, "cat": kind, "args": {"step": step},
                "ts": start * 1e6, "dur": dur * 1e6}

    events = []
    for step, (wait, length) in enumerate(((0.1, 1.0), (0.3, 1.2), (0.2, 0.8))):
        t = 10.0 * step
        events += [span(0, "forward", step, t, length), span(1, "recv wait", step, t, wait),
                   span(1, "forward+backward", step, t + wait, 0.5),
                   span(1, "allreduce", step, t + 0.6, 0.05)]
    shares = suite.wait_shares({"traceEvents": events}, ranks=2)
    assert shares["step"] == pytest.approx(1.0)  # the median step
    assert shares["recv wait"] == pytest.approx([0.0, 0.25])  # the median of 0.1, 0.25, 0.25
    assert shares["allreduce"] == pytest.approx([0.0, 0.05 / 1.0])
    assert shares["compute"] == pytest.approx([1.0, 0.5])
