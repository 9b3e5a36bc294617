"""`make bench-readme`: every row of README.md's Speed table rerun on this commit in one run,
and the table regenerated from that run.

Rounds of every arm on ResNet-110 v1 (batch 64, random CIFAR-shaped data, SGD with
momentum, one TensorFlow thread per process), each arm a child job measuring images/s as
the median of its timed calls after a warm-up call: single-process `model.fit` (the
baseline), `hf.fit` at 1 × 1, data parallel 1 × 2, the pipeline 2 × 1 with no speed
arguments (hyparflow's defaults, which weigh the steps a call plans: calls of 10 steps, and
calls planning a CIFAR epoch stopped after 10) and with the fastest options it has (ZB-H1 and the
interleaved schedule, each step one graph, cut by measured time), and the peers over their
own single process: Horovod data parallel, PyTorch pipelining's 1F1B, interleaved 1F1B and
interleaved zero bubble. Each round runs every arm once (odd rounds in reverse order), so
baselines, peers and candidates interleave; a ratio is taken within its round, and the
median over rounds is what the table shows. Every round is kept.

    .venv/bin/python benchmarks/readme.py             # 3 rounds at ResNet-110: 31–52 min here
    .venv/bin/python benchmarks/readme.py --depth 20 --steps 3 --reps 1 --rounds 1 --no-readme

From a clean checkout the run rewrites README.md's Speed table (between its two
`bench-readme` markers); with uncommitted changes it only writes its record
(`benchmarks/results/readme.md`, `.json`), since its numbers belong to no commit.
"""

import argparse
import datetime
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks import harness, suite  # noqa: E402

README = os.path.join(ROOT, "README.md")
START = "<!-- bench-readme: start"
END = "<!-- bench-readme: end -->"
CIFAR_EPOCH = 782  # steps of one epoch of CIFAR-10's 50,000 images at batch 64
FAST = dict(step_graph=True, balance="time")  # with ZB-H1 or interleaved: hf's fastest options


def arm(name, kind, over, label, **settings):
    """One thing measured each round: `kind` keras, hf, horovod or torch; `over` the arm its
    ratio is taken against (None: a baseline); `label` its row in the table."""
    return dict(name=name, kind=kind, over=over, label=label, **settings)


ARMS = [
    arm("one process", "keras", None, None, threads=1),
    arm("hf 1x1", "hf", "one process", "`hf.fit(P=1, R=1)` ÷ `model.fit`", P=1, R=1,
        defaults=True),
    arm("hf 1x2", "hf", "one process", "data parallel R = 2: `hf.fit(replicas=2)`", P=1, R=2,
        defaults=True),
    arm("hf 2x1 defaults", "hf", "one process",
        "pipeline P = 2: `hf.fit(partitions=2)`, no speed arguments, calls of 10 steps "
        "({choice})", P=2, R=1, defaults=True),
    # a training job's call plans many steps, which the defaults weigh: a CIFAR epoch here
    arm("hf 2x1 defaults long", "hf", "one process",
        f"the same, calls planning {CIFAR_EPOCH} steps (a CIFAR epoch), each stopped after "
        "its 10 ({choice})", P=2, R=1, defaults=True, planned=CIFAR_EPOCH),
    arm("hf 2x1 zb-h1 m=4", "hf", "one process",
        "pipeline P = 2: `schedule=hf.Schedule(\"zb-h1\", step_graph=True)`, "
        "`balance=\"time\"`, m = 4 (cut {cut})", P=2, R=1, m=4, schedule="zb-h1", **FAST),
    arm("hf 2x1 zb-h1 m=8", "hf", "one process", "the same, m = 8 (cut {cut})", P=2, R=1, m=8,
        schedule="zb-h1", **FAST),
    arm("hf 2x1 interleaved m=4", "hf", "one process",
        "pipeline P = 2: `schedule=hf.Schedule(\"interleaved\", step_graph=True)`, "
        "`balance=\"time\"`, m = 4 (cut {cut})", P=2, R=1, m=4, schedule="interleaved", **FAST),
    arm("horovod 1 process", "horovod", None, None, mode="single", ranks=1),
    arm("horovod 1x2", "horovod", "horovod 1 process",
        "data parallel R = 2: Horovod 0.28 (TensorFlow 2.15), over its own one process",
        mode="data", ranks=2),
    arm("torch 1 process", "torch", None, None, mode="single", ranks=1),
    arm("torch 1f1b m=4", "torch", "torch 1 process",
        "pipeline P = 2: PyTorch pipelining `Schedule1F1B`, m = 4, over its own one process",
        mode="pipeline", ranks=2, m=4, schedule="1f1b"),
    arm("torch interleaved m=4", "torch", "torch 1 process",
        "the same, `ScheduleInterleaved1F1B` (2 stages a rank)", mode="pipeline", ranks=2, m=4,
        schedule="interleaved"),
    arm("torch zero-bubble m=4", "torch", "torch 1 process",
        "the same, `ScheduleInterleavedZeroBubble` (2 stages a rank)", mode="pipeline", ranks=2,
        m=4, schedule="zero-bubble"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--depth", type=int, default=110, help="ResNet v1 depth (110)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed call (10)")
    parser.add_argument("--reps", type=int, default=2, help="timed calls per job (2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every arm (3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="run only the arms named (their baselines added)")
    parser.add_argument("--no-readme", dest="readme", action="store_false",
                        help="write the record only, leave README.md as it is")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per job (1800)")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "readme"),
                        help="record stem (benchmarks/results/readme → .md, .json)")
    args = parser.parse_args(argv)
    harness.at_least_one(parser, args, "depth", "batch_size", "reps", "rounds")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (a call's steps are timed end to end)")
    names = [a["name"] for a in ARMS]
    for name in args.only or ():
        if name not in names:
            parser.error(f"--only {name!r}: no such arm; the arms: {', '.join(names)}")
    return args


# --- the jobs -------------------------------------------------------------------------------

def chosen(args, peers):
    """The arms this run measures: those asked for (all by default) with their baselines,
    less the peers not installed."""
    by_name = {a["name"]: a for a in ARMS}
    wanted = set(args.only or by_name)
    wanted |= {by_name[n]["over"] for n in wanted if by_name[n]["over"]}
    return [a for a in ARMS if a["name"] in wanted and peers.get(a["kind"]) is None]


def measure(arms, args):
    """Every round of every arm: {arm name: [the job's record per round]} (a failed job:
    {"error": ...})."""
    rounds = {a["name"]: [] for a in arms}
    for r in range(args.rounds):
        for a in arms if r % 2 == 0 else arms[::-1]:
            result, error = harness.launch(suite.command(a, args), args.timeout)
            rounds[a["name"]].append(result if result else {"error": error})
            rate = result and result["median_images_per_s"]
            print(f"round {r + 1}: {a['name']}: "
                  f"{f'{rate:.1f} images/s' if rate else error}", file=sys.stderr, flush=True)
    return rounds


def ratios(arms, rounds):
    """Per arm with a baseline: its ratio to that baseline in each round (None where either
    failed), and their median over the rounds where both ran."""
    out = {}
    for a in arms:
        if not a["over"] or a["over"] not in rounds:
            continue
        per = [mine["median_images_per_s"] / base["median_images_per_s"]
               if "error" not in mine and "error" not in base else None
               for mine, base in zip(rounds[a["name"]], rounds[a["over"]])]
        got = [v for v in per if v is not None]
        out[a["name"]] = {"rounds": per, "median": statistics.median(got) if got else None}
    return out


def targets(speedups):
    """Issue 47's targets, as this run measured them: (what, value, target, met)."""
    def median(name):
        return speedups.get(name, {}).get("median")

    defaults = "hf 2x1 defaults long"  # what a training job's call runs by default
    hf_fast = [n for n in speedups if n.startswith("hf 2x1") and "defaults" not in n]
    best_hf = max((n for n in hf_fast + [defaults] if median(n)), key=median, default=None)
    best_torch = max((n for n in speedups if n.startswith("torch") and median(n)), key=median,
                     default=None)
    rows = []
    if best_hf and median(defaults):
        rows.append((f"defaults (calls of a CIFAR epoch) ÷ the best hf pipeline ({best_hf})",
                     median(defaults) / median(best_hf), 0.95))
    if best_hf:
        rows.append((f"the best hf pipeline ({best_hf}) over one process", median(best_hf),
                     1.60))
    if best_hf and best_torch:
        rows.append((f"the best hf pipeline ÷ PyTorch's best ({best_torch})",
                     median(best_hf) / median(best_torch), 1.10))
    if median("hf 1x2"):
        rows.append(("data parallel R = 2 over one process", median("hf 1x2"), 1.90))
    return [(what, value, target, value >= target) for what, value, target in rows]


# --- the record and the table --------------------------------------------------------------

def cuts(records):
    """The cuts hf.fit made over the rounds (calls per stage), distinct, in order."""
    seen = []
    for rec in records:  # (a table cell's | escaped)
        cut = r"\|".join(map(str, rec.get("stage_calls") or [])) if "error" not in rec else ""
        if cut and cut not in seen:
            seen.append(cut)
    return ", ".join(seen) or "—"


def shares(rec):
    """'12 % / 3 %, 0 % / 3 %': per rank, a traced step's share in receive waits and in the
    allreduce (hf's jobs only)."""
    waits, reduce = rec.get("recv_wait_share"), rec.get("allreduce_share")
    if not waits:
        return "—"
    return ", ".join(f"{w:.0%} / {a:.0%}" for w, a in zip(waits, reduce))


def label(a, records):
    """The arm's row label, with what the runs chose filled in."""
    first = next((rec for rec in records if "error" not in rec), {})
    ran = first.get("chose") or {}
    where = "in the step graph" if ran.get("step_graph") else "on the executor"
    choice = (f"{ran.get('schedule')} {where}, m = {first.get('microbatches')}, "
              f"cut {cuts(records)} by {ran.get('balance')!r}")
    return a["label"].format(cut=cuts(records), choice=choice)


def cell(value):
    return "failed" if value is None else f"{value:.2f}"


def speed_table(report):
    """README.md's Speed table: the block between the markers, generated from `report`."""
    s, m = report["settings"], report["machine"]
    day = report["started"][:10]
    lines = [
        f"{START}: generated by `make bench-readme` (benchmarks/readme.py); do not edit -->",
        f"ResNet-{s['depth']} v1, batch {s['batch_size']}, random 32×32 images, SGD with "
        f"momentum, one TensorFlow thread per process; measured by `make bench-readme` on "
        f"commit {(report['commit'] or 'unknown')[:10]}, {day}, on {m['cpu']} "
        f"({m['usable_cores']} cores). A cell is images/s over one process (`model.fit`; "
        f"a peer: over its own) in the same round; {s['rounds']} round{'s' * (s['rounds'] > 1)}, "
        "then their median. "
        "Every round: [benchmarks/results/readme.md](benchmarks/results/readme.md).",
        "",
        "| what | rounds | median |",
        "| --- | --- | ---: |"]
    for a in report["arms"]:
        got = report["speedups"].get(a["name"])
        if got is None:
            continue
        rounds = ", ".join(cell(v) for v in got["rounds"])
        lines.append(f"| {label(a, report['rounds'][a['name']])} | {rounds} "
                     f"| **{cell(got['median'])}** |")
    missing = report["peers_missing"]
    if missing:
        lines += ["", "Not measured in this run: " + "; ".join(
            f"{peer} ({why})" for peer, why in missing.items()) + "."]
    lines.append(END)
    return "\n".join(lines)


def markdown(report):
    """The record: the Speed table, the targets, then every round of every arm."""
    lines = ["# `make bench-readme`", "", f"Command: `{report['command']}`; started "
             f"{report['started']}, {report['minutes']:.0f} min; commit {report['commit']}; "
             f"machine: {report['machine']['cpu']}.", "", speed_table(report), "",
             "## Issue 47's targets, as this run measured them", "",
             "| what | measured | target | met |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {what} | {value:.2f} | {target:.2f} | {'yes' if met else 'no'} |"
              for what, value, target, met in report["targets"]]
    lines += ["", "## Every job", "",
              "| arm | round | images/s | timed calls (s) | first call's first step (s) "
              "| a step (s) | cut | a traced step's share waiting on receives / in the "
              "allreduce, per rank |",
              "| --- | ---: | ---: | --- | ---: | ---: | --- | --- |"]
    for a in report["arms"]:
        for r, rec in enumerate(report["rounds"][a["name"]], 1):
            if "error" in rec:
                lines.append(f"| {a['name']} | {r} | failed: "
                             f"{rec['error'].splitlines()[0]} | | | | | |")
                continue
            step = rec.get("step_s")
            first = rec.get("first_step_s")
            calls = ", ".join(f"{t:.2f}" for t in rec.get("seconds") or ()) or "—"
            lines.append(f"| {a['name']} | {r} | {rec['median_images_per_s']:.1f} | {calls} "
                         f"| {'—' if first is None else f'{first:.1f}'} "
                         f"| {'—' if step is None else f'{step:.3f}'} | {cuts([rec])} "
                         f"| {shares(rec)} |")
    return "\n".join(lines) + "\n"


def rewrite_readme(table, path=README):
    """Put `table` between README.md's markers; False (and nothing written) without them."""
    with open(path) as f:
        text = f.read()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        return False
    with open(path, "w") as f:
        f.write(pattern.sub(lambda _: table, text, count=1))
    return True


def drive(args):
    started = datetime.datetime.now(datetime.timezone.utc)
    measured = harness.commit()  # the code the jobs ran (the tree may change while they do)
    peers = suite.installed_peers(suite.PEERS)
    for peer, why in peers.items():
        if why:
            print(f"peer {peer}: {why}; going on without it", file=sys.stderr, flush=True)
    arms = chosen(args, peers)
    rounds = measure(arms, args)
    speedups = ratios(arms, rounds)
    report = harness.report(
        "readme", __doc__, started.isoformat(timespec="seconds"), commit=measured,
        minutes=(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60,
        settings={k: v for k, v in vars(args).items() if k not in ("output", "readme")},
        peers_missing={p: why for p, why in peers.items() if why},
        arms=arms, commands={a["name"]: suite.command(a, args) for a in arms},
        rounds=rounds, speedups=speedups, targets=targets(speedups))
    harness.publish(report, args.output, markdown(report))
    clean = measured and not measured.endswith("+changes")
    if args.readme and not clean:
        print("README.md left as it is: the checkout has uncommitted changes (or no commit), "
              "so these numbers belong to no commit", file=sys.stderr)
    elif args.readme and not rewrite_readme(speed_table(report)):
        print(f"README.md has no {START!r} … {END!r} block to rewrite", file=sys.stderr)
        return 1
    return 0 if all("error" not in rec for recs in rounds.values() for rec in recs) else 1


if __name__ == "__main__":
    sys.exit(drive(parse_args()))
