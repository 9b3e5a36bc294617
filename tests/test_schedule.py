"""Schedules are data: literal expectations, validation, and the ASCII timeline."""

import pytest

from hyparflow import schedule as S
from hyparflow.schedule import Action


def names(schedule):
    return {s: [str(a) for a in acts] for s, acts in schedule.items()}


def test_gpipe_literal():
    # All forwards, then all backwards; the last stage runs each backward at once.
    assert names(S.gpipe(2, 3)) == {
        0: ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"],
        1: ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"],
    }


def test_gpipe_timeline_literal():
    assert S.render(S.gpipe(3, 2)) == "\n".join([
        "stage 0 | 0F0 0F1             0B0     0B1",
        "stage 1 |     1F0 1F1     1B0     1B1",
        "stage 2 |         2F0 2B0 2F1 2B1",
    ])


def test_action_parse_and_print():
    assert Action.parse("1F0") == Action(1, "F", 0)
    assert str(Action(3, "B", 12)) == "3B12"
    with pytest.raises(ValueError):
        Action.parse("1X0")


def test_simulated_gpipe_takes_2_times_m_plus_p_minus_1_ticks():
    for P in (1, 2, 4):
        for m in (1, 3, 8):
            times = S.simulate(S.gpipe(P, m))
            assert max(times.values()) + 1 == 2 * (m + P - 1)


def test_backward_before_forward_is_rejected():
    bad = {0: [Action(0, "B", 0), Action(0, "F", 0)]}
    with pytest.raises(ValueError, match="0B0 runs before 0F0"):
        S.simulate(bad)


def test_a_schedule_that_waits_forever_is_shown():
    # Stage 1 wants micro-batch 1 first; stage 0 wants stage 1's backward of 0 first.
    bad = {0: [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
           1: [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)]}
    with pytest.raises(ValueError) as err:
        S.simulate(bad)
    assert "wait forever: 0B0, 1F1" in str(err.value)
    assert "<-- waiting: 1F1" in str(err.value)


def test_skip_connections_order_dependencies():
    # Stage 2 also consumes stage 0 directly: still runnable under GPipe.
    producers = {0: [], 1: [0], 2: [0, 1]}
    consumers = {0: [1, 2], 1: [2], 2: []}
    times = S.simulate(S.gpipe(3, 2), producers, consumers)
    assert times[Action(2, "F", 0)] > times[Action(0, "F", 0)]
    assert times[Action(0, "B", 0)] > times[Action(2, "B", 0)]
