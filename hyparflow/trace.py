"""Per-rank timeline of a training run → Chrome trace JSON and a PNG chart.

Record with ``hf.fit(..., trace="run.json")``; draw with::

    python -m hyparflow.trace run.json -o run.png          # the last step
    python -m hyparflow.trace run.json -o run.png --step 3

The JSON opens in chrome://tracing and Perfetto: one row per rank, a box per
forward, backward, receive wait, send wait, allreduce and optimizer step (and, with
replicas, a row per rank of its gradient buckets' allreduces).
"""

import argparse
import contextlib
import json
import time

COMPUTE = ("forward", "backward", "forward+backward", "weights")
COLOURS = {"forward": "#4c9be8", "backward": "#e8804c", "forward+backward": "#8e6bd1",
           "weights": "#c2410c",
           "recv wait": "#d9d9d9", "send wait": "#bfbfbf", "allreduce": "#5cb85c",
           "optimizer": "#2e7d32", "bucket": "#f0c419"}
# Spans measured on another thread of the rank (a gradient bucket's allreduce, which overlaps
# the backward): their own row under the rank in chrome://tracing, a thin bar in the chart.
BESIDE = ("bucket",)


class Recorder:
    """Collects (kind, micro-batch, step, start, duration) spans on one rank."""

    def __init__(self):
        self.events = []
        self.step = 0
        self.recording = True
        self.origin = time.perf_counter()

    def restart(self):
        """Set time zero (call right after a barrier, so ranks share an origin)."""
        self.events.clear()
        self.step = 0
        self.origin = time.perf_counter()

    def next_step(self):
        self.step += 1

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside (validation's forwards between training steps)."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    @contextlib.contextmanager
    def span(self, kind, i=None, **args):
        if not self.recording:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.events.append((kind, i, self.step, start - self.origin, end - start, args))

    def add(self, kind, i, start, end, **args):
        """A span of this step measured elsewhere: `start` and `end` are
        time.perf_counter() values."""
        if self.recording:
            self.events.append((kind, i, self.step, start - self.origin, end - start, args))


class Silent:
    """A Recorder that records nothing (tracing off)."""

    @staticmethod
    def next_step():
        pass

    @staticmethod
    def paused():
        return contextlib.nullcontext()

    @staticmethod
    def span(kind, i=None, **args):
        return contextlib.nullcontext()

    @staticmethod
    def add(kind, i, start, end, **args):
        pass


SILENT = Silent()


def chrome_trace(per_rank, partitions, replicas, microbatches, schedule):
    """The Chrome trace document for every rank's events.

    Args:
        per_rank: list, by world rank, of Recorder.events.
    """
    events = []
    for rank, spans in enumerate(per_rank):
        replica, stage = divmod(rank, partitions)
        held = sorted({s[5]["stage"] for s in spans if "stage" in s[5]} | {stage})
        where = f"stage {stage}" if len(held) == 1 else \
            "stages " + ", ".join(map(str, held))  # interleaved: a rank's compute names its stage
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank} (replica {replica}, {where})"}})
        if any(s[0] in BESIDE for s in spans):
            events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": rank,
                           "args": {"name": f"rank {rank}: gradient buckets"}})
        for kind, i, step, start, duration, args in spans:
            label = kind if i is None else f"{kind} {i}"
            events.append({"name": label, "cat": kind, "ph": "X", "pid": int(kind in BESIDE),
                           "tid": rank,
                           "ts": round(start * 1e6, 3), "dur": round(duration * 1e6, 3),
                           "args": dict(args, step=step, microbatch=i)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"partitions": partitions, "replicas": replicas,
                          "microbatches": microbatches, "schedule": schedule}}


def write(path, document):
    with open(path, "w") as f:
        json.dump(document, f)


def spans_of(document):
    """[(rank, kind, micro-batch, step, start s, duration s)] from a trace document."""
    out = []
    for e in document["traceEvents"]:
        if e.get("ph") == "X":
            out.append((e["tid"], e["cat"], e["args"].get("microbatch"), e["args"]["step"],
                        e["ts"] / 1e6, e["dur"] / 1e6))
    return out


def step_shares(document, step, kinds):
    """One step's duration (s), and each rank's share of it spent in spans of `kinds`.

    The step runs from its first span's start to its last span's end, over all
    ranks. A span counts without the spans inside it on its rank's own row (one stage's
    whole step holds the sum over replicas: that time is the allreduce's, not compute's).
    Returns ``(seconds, {rank: share})`` for the ranks with spans in the step.
    """
    spans = [s for s in spans_of(document) if s[3] == step]
    if not spans:
        raise ValueError(f"the trace has no step {step}")
    begin = min(s[4] for s in spans)
    seconds = max(s[4] + s[5] for s in spans) - begin
    ranks = sorted({s[0] for s in spans})
    return seconds, {r: sum(_own(s, spans) for s in spans if s[0] == r and s[1] in kinds)
                     / seconds for r in ranks}


def _own(span, spans):
    """`span`'s duration less that of the spans directly inside it on its rank's row."""
    def inside(a, b):  # a within b, on b's row
        return (a is not b and a[0] == b[0] and a[1] not in BESIDE and b[1] not in BESIDE
                and b[4] <= a[4] and a[4] + a[5] <= b[4] + b[5])

    within = [s for s in spans if inside(s, span)]
    return span[5] - sum(s[5] for s in within if not any(inside(s, o) for o in within))


def bubble(document, step):
    """Measured idle share of one step, averaged over ranks, and the ideal (P−1)/(m+P−1).

    A rank is busy while it computes (forward, backward); everything else in the
    step's span — waiting, sending, reducing gradients, stepping the optimizer —
    counts as idle.
    """
    _, busy = step_shares(document, step, COMPUTE)
    measured = sum(1 - b for b in busy.values()) / len(busy)
    meta = document["otherData"]
    P, m = meta["partitions"], meta["microbatches"]
    return measured, (P - 1) / (m + P - 1)


def draw(document, path, step=None):
    """Draw one step of the timeline as a PNG: a row per rank, a box per action."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing a timeline needs matplotlib: pip install matplotlib (or "
                          "hyparflow's [bench] extra); the trace JSON opens without it in "
                          "chrome://tracing or Perfetto.") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = spans_of(document)
    steps = sorted({s[3] for s in spans})
    step = steps[-1] if step is None else step
    spans = [s for s in spans if s[3] == step]
    if not spans:
        raise ValueError(f"the trace has no step {step}; it has steps {steps}")
    begin = min(s[4] for s in spans)
    ranks = sorted({s[0] for s in spans})
    meta = document["otherData"]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.6))
    for rank, kind, i, _, start, duration in spans:
        y = len(ranks) - 1 - ranks.index(rank)
        x = (start - begin) * 1e3
        band = (y - 0.4, 0.15) if kind in BESIDE else (y - 0.4, 0.8)
        ax.broken_barh([(x, duration * 1e3)], band, color=COLOURS.get(kind, "#999"),
                       edgecolor="black" if kind in COMPUTE else "none", linewidth=0.5)
        if i is not None and kind in COMPUTE and duration * 1e3 > 0:
            ax.text(x + duration * 1e3 / 2, y, str(i), ha="center", va="center", fontsize=7)
    P = meta["partitions"]
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r} (r{r // P}, s{r % P})" for r in reversed(ranks)])
    ax.set_xlabel("milliseconds since the step began")
    measured, ideal = bubble(document, step)
    ax.set_title(f"{meta['schedule']}, P={P}, R={meta['replicas']}, m={meta['microbatches']}, "
                 f"step {step}: bubble measured {measured:.0%}, ideal (P-1)/(m+P-1) {ideal:.0%}")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(COLOURS), fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hyparflow.trace",
                                     description="Draw a hyparflow trace as a PNG timeline.")
    parser.add_argument("trace", help="the JSON written by hf.fit(..., trace=PATH)")
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    parser.add_argument("--step", type=int, default=None, help="step to draw (default: the last)")
    args = parser.parse_args(argv)
    with open(args.trace) as f:
        document = json.load(f)
    draw(document, args.output, args.step)
    spans = spans_of(document)
    step = max(s[3] for s in spans) if args.step is None else args.step
    measured, ideal = bubble(document, step)
    print(f"{args.output}: step {step}, bubble measured {measured:.1%}, ideal {ideal:.1%}")


if __name__ == "__main__":
    main()
