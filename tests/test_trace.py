"""The timeline's arithmetic: a step's shares by kind of span, on documents built by hand."""

import pytest

from hyparflow import trace


def _document(per_rank):
    """A trace document from, per rank, (kind, micro-batch, step, start s, duration s)."""
    return trace.chrome_trace([[(*s, {}) for s in spans] for spans in per_rank],
                              partitions=1, replicas=len(per_rank), microbatches=1,
                              schedule="1F1B")


def test_a_span_inside_another_counts_once_in_the_step_shares():
    # One stage's whole step (P = 1): the sum over replicas runs inside the step's compiled
    # function, so its "allreduce" span lies within the "forward+backward" span. The compute
    # share is the step's time less the sum's; the gradient buckets' allreduces (beside the
    # backward, on another thread) take nothing from it.
    step = [("forward+backward", 0, 0, 0.0, 1.0), ("allreduce", None, 0, 0.8, 0.1),
            ("bucket", None, 0, 0.2, 0.5)]
    document = _document([step, [("forward+backward", 0, 0, 0.0, 1.0)]])
    seconds, compute = trace.step_shares(document, 0, trace.COMPUTE)
    _, reduce = trace.step_shares(document, 0, ("allreduce",))
    assert seconds == pytest.approx(1.0)
    assert compute == pytest.approx({0: 0.9, 1: 1.0}) and reduce == pytest.approx({0: 0.1, 1: 0})
    measured, ideal = trace.bubble(document, 0)  # the sum is not computing
    assert measured == pytest.approx(0.05) and ideal == 0


def test_spans_one_after_another_keep_their_whole_durations():
    # the executor's way: a backward's span, then the allreduce and the update after it
    step = [("forward", 0, 3, 0.0, 0.3), ("backward", 0, 3, 0.3, 0.5),
            ("allreduce", None, 3, 0.8, 0.05), ("optimizer", None, 3, 0.85, 0.15)]
    document = _document([step])
    seconds, shares = trace.step_shares(document, 3, ("backward", "optimizer"))
    assert seconds == pytest.approx(1.0) and shares == pytest.approx({0: 0.65})
    with pytest.raises(ValueError, match="no step 4"):
        trace.step_shares(document, 4, ())
