"""Schedules are data: literal expectations, validation, and the ASCII timeline."""

import pytest

from hyparflow.engine import schedule as S
from hyparflow.engine.schedule import Action


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


def test_one_f_one_b_literal():
    assert S.render(S.one_f_one_b(4, 6)) == "\n".join([
        "stage 0 | 0F0 0F1 0F2 0F3             0B0 0F4 0B1 0F5 0B2     0B3     0B4     0B5",
        "stage 1 |     1F0 1F1 1F2         1B0 1F3 1B1 1F4 1B2 1F5 1B3     1B4     1B5",
        "stage 2 |         2F0 2F1     2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4     2B5",
        "stage 3 |             3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5",
    ])


def test_one_f_one_b_keeps_at_most_p_minus_s_microbatches_alive():
    assert S.live(S.one_f_one_b(4, 8)) == {0: 4, 1: 3, 2: 2, 3: 1}
    assert S.live(S.gpipe(4, 8)) == {0: 8, 1: 8, 2: 8, 3: 1}
    assert S.live(S.one_f_one_b(4, 2)) == {0: 2, 1: 2, 2: 2, 3: 1}
    # what the planner and the memory balance count, from the one place that knows
    assert S.kept("1f1b", 4, 8) == (4, 3, 2, 1) and S.kept("gpipe", 4, 8) == (8, 8, 8, 1)
    assert S.kept("gpipe", 1, 4) == (1,)  # one stage is the last: it fuses


@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_both_schedules_run_in_the_same_time_even_with_skip_connections(P, m):
    # Every stage also sends to every later stage (dense skips), the hardest wiring.
    producers = {s: list(range(s)) for s in range(P)}
    consumers = {s: list(range(s + 1, P)) for s in range(P)}
    for make in (S.gpipe, S.one_f_one_b):
        times = S.simulate(make(P, m), producers, consumers)
        assert len(times) == 2 * P * m
        assert max(times.values()) + 1 == 2 * (m + P - 1)


def test_schedule_names():
    assert S.by_name("1f1b").make is S.one_f_one_b and S.by_name("gpipe").make is S.gpipe
    with pytest.raises(ValueError, match=r"schedule='pipedream' is not a schedule; use one of "
                                         r"'1f1b', 'gpipe', 'interleaved', 'zb-h1'\."):
        S.by_name("pipedream")


def test_lower_runs_the_last_stages_forward_and_backward_as_one_action():
    assert names(S.lower(S.gpipe(2, 3))) == {
        0: ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"],
        1: ["1FB0", "1FB1", "1FB2"],
    }
    assert names(S.lower(S.one_f_one_b(3, 2)))[2] == ["2FB0", "2FB1"]
    assert names(S.lower(S.gpipe(1, 2))) == {0: ["0FB0", "0FB1"]}  # one stage is the last
    # a backward not right after its forward stays apart
    apart = {0: [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0), Action(0, "B", 1)]}
    assert S.lower(apart) == apart
    assert Action.parse("1FB2") == Action(1, S.FUSED, 2) and str(Action(0, "FB", 3)) == "0FB3"
    for bad in ("1X0", "FB", "1FB", "aF0"):
        with pytest.raises(ValueError, match="is not an action"):
            Action.parse(bad)


def test_a_lowered_schedule_runs_in_the_time_of_its_parts():
    # a fused action lasts as long as the forward and backward it runs
    two = lambda a: 2 if a.kind == S.FUSED else 1  # noqa: E731
    for P in (1, 2, 4):
        for m in (1, 3, 8):
            for make in (S.gpipe, S.one_f_one_b):
                starts = S.simulate(S.lower(make(P, m)), durations=two)
                assert max(starts[a] + two(a) for a in starts) == 2 * (m + P - 1)
    assert S.render(S.lower(S.gpipe(2, 2))) == "\n".join([
        "stage 0 | 0F0  0F1  0B0  0B1",
        "stage 1 |      1FB0 1FB1",
    ])
    # stages skipping over others: a fused action waits for every producer's forward
    producers = {0: [], 1: [0], 2: [0, 1]}
    consumers = {0: [1, 2], 1: [2], 2: []}
    starts = S.simulate(S.lower(S.one_f_one_b(3, 2)), producers, consumers)
    assert starts[Action(2, "FB", 0)] > starts[Action(1, "F", 0)]
    assert starts[Action(0, "B", 0)] > starts[Action(2, "FB", 0)]


def test_a_fused_action_where_partial_errors_must_come_back_waits_forever():
    bad = {0: [Action(0, "FB", 0)], 1: [Action(1, "F", 0), Action(1, "B", 0)]}
    with pytest.raises(ValueError, match="wait forever: 0FB0, 1F0"):
        S.simulate(bad)
    with pytest.raises(ValueError, match="action 0F0 appears twice"):
        S.simulate({0: [Action(0, "F", 0), Action(0, "FB", 0)]})


def test_durations_give_each_action_its_own_length():
    # 1F1B at P = 2, m = 2: forwards take 1, backwards 2 (the usual 1 : 2)
    length = lambda a: 1 if a.kind == "F" else 2  # noqa: E731
    starts = S.simulate(S.one_f_one_b(2, 2), durations=length)
    assert {str(a): t for a, t in starts.items()} == {
        "0F0": 0, "0F1": 1, "1F0": 1, "1B0": 2, "1F1": 4, "0B0": 4, "1B1": 5, "0B1": 7}
    assert S.live(S.lower(S.gpipe(4, 8))) == {0: 8, 1: 8, 2: 8, 3: 1}


def test_interleaved_literal():
    # P = 2 ranks, v = 2 chunks: rank p holds stages p and p + 2; forwards in groups of P
    # micro-batches chunk by chunk, backwards with the chunks reversed
    assert names(S.interleaved(2, 4, 2)) == {
        0: ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1",
            "2F2", "0B0", "2F3", "0B1", "2B2", "2B3", "0B2", "0B3"],
        1: ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1F2", "1B0",
            "1F3", "1B1", "3F2", "3B2", "3F3", "3B3", "1B2", "1B3"],
    }
    assert S.render(S.lower(S.interleaved(2, 2, 2))) == "\n".join([
        "rank 0 | 0F0  0F1  2F0  2F1  2B0  2B1  0B0  0B1",
        "rank 1 |      1F0  1F1  3FB0 3FB1 1B0  1B1",
    ])
    assert S.interleaved(3, 6, 1) == S.one_f_one_b(3, 6)  # one chunk a rank is 1F1B
    assert S.by_name("interleaved").make is S.interleaved


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_takes_a_vth_of_1f1bs_bubble(P, v, groups):
    # every stage also sends to every later one (dense skips, across ranks and chunks); a
    # chunk's forward takes 1/v of a stage's, its backward 2/v: the step takes
    # 3(m + (P − 1)/v), where 1F1B's takes 3(m + P − 1)
    from fractions import Fraction
    m, V = groups * P, v * P
    producers = {s: list(range(s)) for s in range(V)}
    consumers = {s: list(range(s + 1, V)) for s in range(V)}
    length = lambda a: Fraction({"F": 1, "B": 2, "FB": 3}[a.kind], v)  # noqa: E731
    starts = S.simulate(S.lower(S.interleaved(P, m, v)), producers, consumers, length)
    assert len(starts) == 2 * V * m - m  # the last stage's pairs fused
    assert max(t + length(a) for a, t in starts.items()) == 3 * (m + Fraction(P - 1, v))


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
def test_interleaved_runs_a_ragged_last_group_no_slower_than_1f1b(P):
    # m not a multiple of P: the schedule of whole groups, the missing micro-batches left
    # out (as written first, with the last group short, P ≥ 4 waited forever)
    from fractions import Fraction
    for v in (2, 3, 4):
        V = v * P
        producers = {s: list(range(s)) for s in range(V)}
        consumers = {s: list(range(s + 1, V)) for s in range(V)}
        length = lambda a: Fraction({"F": 1, "B": 2, "FB": 3}[a.kind], v)  # noqa: E731
        for m in range(1, 3 * P + 2):
            starts = S.simulate(S.lower(S.interleaved(P, m, v)), producers, consumers, length)
            assert len(starts) == 2 * V * m - m
            assert max(t + length(a) for a, t in starts.items()) <= 3 * (m + P - 1)


def test_interleaved_counts_what_each_chunk_keeps():
    with pytest.raises(ValueError, match="chunks=0"):
        S.interleaved(2, 4, 0)
    # per stage of the v·P: rank 0 keeps all m of its first chunk's micro-batches
    assert S.kept("interleaved", 4, 8, 2) == (8, 8, 7, 5, 4, 4, 3, 1)
    assert S.kept("interleaved", 2, 4, 1) == S.kept("1f1b", 2, 4) == (2, 1)
    # in the step graph, TensorFlow's dataflow order: all m on every stage but the last
    assert S.kept("interleaved", 4, 8, 2, step_graph=True) == (8,) * 7 + (1,)
    assert S.kept("zb-h1", 2, 4, step_graph=True) == S.kept("gpipe", 2, 4) == (4, 1)
    assert S.forward_only(2, 2, 2) == {
        0: [Action(0, "F", 0), Action(2, "F", 0), Action(0, "F", 1), Action(2, "F", 1)],
        1: [Action(1, "F", 0), Action(3, "F", 0), Action(1, "F", 1), Action(3, "F", 1)]}
    S.simulate(S.forward_only(2, 2, 2))  # runs
    with pytest.raises(ValueError, match="listed under rank 0, but stage 1 is rank 1's"):
        S.simulate({0: [Action(1, "F", 0)], 1: []})


def test_zero_bubble_literal():
    # 1F1B's order with each backward split: B sends the partial errors, W (the weight
    # gradients) runs when the stage would wait; the last stage's B sends before its W
    assert names(S.zero_bubble(2, 4)) == {
        0: ["0F0", "0F1", "0B0", "0W0", "0F2", "0B1", "0W1", "0F3", "0B2", "0W2", "0B3", "0W3"],
        1: ["1F0", "1B0", "1W0", "1F1", "1B1", "1W1", "1F2", "1B2", "1W2", "1F3", "1B3", "1W3"],
    }
    assert S.lower(S.zero_bubble(2, 4)) == S.zero_bubble(2, 4)  # nothing fused: B sends first
    assert S.lower(S.zero_bubble(1, 2)) == {0: [Action(0, "FB", 0), Action(0, "FB", 1)]}
    assert S.by_name("zb-h1").make is S.zero_bubble and \
        S.build("zb-h1", 3, 5) == S.zero_bubble(3, 5)
    assert Action.parse("0W12") == Action(0, "W", 12) and str(Action(2, "W", 1)) == "2W1"


@pytest.mark.parametrize("P", [2, 3, 4, 6])
def test_zero_bubble_keeps_1f1bs_activations_and_beats_its_time(P):
    # a micro-batch is kept from its forward to its W: stage s keeps P − s, as in 1F1B;
    # with F, B and W a tick each it ends sooner than 1F1B whose backward takes two
    for m in (1, P - 1, P, 2 * P + 1, 16):
        if m < 1:
            continue
        zb = S.zero_bubble(P, m)
        assert S.live(zb) == S.live(S.one_f_one_b(P, m))
        assert S.kept("zb-h1", P, m) == S.kept("1f1b", P, m)
        ticks = max(S.simulate(S.lower(zb)).values()) + 1
        two = lambda a: 2 if a.kind == "B" else 1  # noqa: E731
        one_f = max(t + two(a) for a, t in S.simulate(S.one_f_one_b(P, m), durations=two).items())
        assert one_f == 3 * m + 3 * (P - 1)  # the bubble: (P − 1)(F + B + W)
        if m >= P:  # the bubble: (P − 1)(F + B)
            assert ticks == 3 * m + 2 * (P - 1)
        else:
            assert ticks <= one_f


def test_a_weight_pass_needs_its_own_backward_first():
    bad = {0: [Action(0, "F", 0), Action(0, "W", 0), Action(0, "B", 0)]}
    with pytest.raises(ValueError, match="0W0 runs before 0B0 on stage 0"):
        S.simulate(bad)


def test_fit_accepts_and_documents_exactly_the_registered_schedules():
    # a new schedule is a function and an entry of SCHEDULES: hf.fit's signature and
    # docstring must follow
    import ast
    import inspect

    import hyparflow as hf

    hint = inspect.signature(hf.fit).parameters["schedule"].annotation  # "Literal[...] | ..."
    literal, *other = hint.split(" | ")
    assert other == ["Schedule", "None"]  # (hf.Schedule: a name and more; None: the defaults')
    assert sorted(ast.literal_eval(literal[len("Literal"):])) == sorted([*S.SCHEDULES, "auto"])
    doc = hf.fit.__doc__.split("schedule:", 1)[1].split("recompute:", 1)[0]
    assert [name for name in S.SCHEDULES if f'"{name}"' not in doc] == []
