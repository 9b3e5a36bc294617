"""Peak memory per rank and time to first step as the number of stages P grows.

For each P it runs a P-rank `hyparflow-run` job (replicas=1) that trains a deep
pre-activation ResNet (ResNet-1001 v2, batch 32 by default) for a few steps,
and one single-process `model.fit` child for reference. Every process uses one
TensorFlow thread. Each rank reports:

* ``rss_before`` (KiB): resident set just before the fit call (TensorFlow, the
  whole Keras model the script built, the data);
* ``peak`` (KiB): peak resident set over the run (``ru_maxrss``);
* ``first_step_s``: seconds from the fit call to the end of the first step
  (partitioning, tracing, compiling, and the step itself);
* ``step_s``: median seconds of the later steps;

so ``first_step_s - step_s`` is the time to first step spent before training
(trace + compile). The peaks of the ranks are compared with the single
process's peak::

    .venv/bin/python benchmarks/stages.py                        # ResNet-1001 v2, P = 1 2 4
    .venv/bin/python benchmarks/stages.py --depth 56 --partitions 1 2 --output /tmp/s.json
"""

import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402
from benchmarks.memory import job_options, mib, resnet_job  # noqa: E402


def worker(args):
    """Train `steps` steps, timing each; report every rank's readings from rank 0."""
    x, y, model = resnet_job(args)
    import hyparflow as hf  # isort: skip  (before TensorFlow)
    import keras
    ends = []
    timer = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(time.perf_counter()))
    comm = None
    P = args.partitions[0]
    if args.worker == "hf":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        comm.Barrier()
    before = harness.current_rss()
    start = time.perf_counter()
    if args.worker == "baseline":
        model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False,
                  callbacks=[timer])
    else:
        hf.fit(model, x, y, partitions=P, replicas=1, batch_size=args.batch_size,
               microbatches=args.microbatches, epochs=1, verbose=0, shuffle=False,
               balance=args.balance, callbacks=[timer])
    steps = [b - a for a, b in zip(ends, ends[1:])]
    record = {"rank": 0 if comm is None else comm.Get_rank(), "rss_before_kib": before,
              "peak_kib": harness.maxrss(), "first_step_s": ends[0] - start,
              "step_s": statistics.median(steps) if steps else None}
    ranks = [record] if comm is None else comm.gather(record, root=0)
    if ranks is None:
        return
    harness.print_result({
        "worker": args.worker, "partitions": None if comm is None else P, "ranks": ranks,
        "threads": harness.thread_settings()})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    job_options(parser, depth=1001, batch_size=32)
    parser.add_argument("--partitions", type=int, nargs="+", default=[1, 2, 4],
                        help="stage counts P to run (default: 1 2 4)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="micro-batches m (default: hf.fit's default for each P)")
    parser.add_argument("--balance", default="params", help="hf.fit balance (default params)")
    parser.add_argument("--steps", type=int, default=3, help="steps per run (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    harness.driver_options(parser, 1800, "stages.json")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is timed apart)")
    return args


def table(report):
    """Markdown table: per P, the largest peak over ranks, its ratio to one process, times."""
    base = report["baseline"]
    base_peak = base["ranks"][0]["peak_kib"] if base else None
    lines = ["| run | ranks | peak RSS per rank (MiB) | largest / single process "
             "| RSS before fit (MiB) | first step (s) | later steps (s) | time to first step "
             "minus a step (s) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    rows = ([("`model.fit`, 1 process", base, None)] if base else []) + [
        (f"`hf.fit` P = {r['partitions']}", r["result"], r["error"]) for r in report["runs"]]
    for name, result, error in rows:
        if result is None:
            lines.append(f"| {name} | — | failed: {error.splitlines()[0]} | | | | | |")
            continue
        ranks = result["ranks"]
        peaks = [r["peak_kib"] for r in ranks]
        first = max(r["first_step_s"] for r in ranks)
        step = max(r["step_s"] for r in ranks)
        ratio = f"{max(peaks) / base_peak:.2f}" if base_peak else "—"
        lines.append(f"| {name} | {len(ranks)} | {' / '.join(mib(p) for p in peaks)} | {ratio} "
                     f"| {mib(max(r['rss_before_kib'] for r in ranks))} | {first:.1f} "
                     f"| {step:.1f} | {first - step:.1f} |")
    return "\n".join(lines)


def drive(args):
    common = ["--depth", str(args.depth), "--batch-size", str(args.batch_size),
              "--steps", str(args.steps), "--seed", str(args.seed), "--balance", args.balance]
    if args.microbatches:
        common += ["--microbatches", str(args.microbatches)]
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    commands = {"baseline": harness.child(__file__, "--worker", "baseline", *common)}
    baseline, baseline_error = harness.launch(commands["baseline"], args.timeout)
    runs = []
    for P in args.partitions:
        cmd = harness.on_ranks(P, __file__, "--worker", "hf", "--partitions", str(P), *common)
        commands[f"P{P}"] = cmd
        result, error = harness.launch(cmd, args.timeout)
        runs.append({"partitions": P, "result": result, "error": error})
    report = {
        "benchmark": "stages",
        "description": "Peak resident set per rank (KiB) and time to first step of hf.fit "
                       "at P stages (replicas=1), and of a single-process model.fit, on "
                       "ResNet v2; one TensorFlow thread per process.",
        "started": started, "machine": harness.machine(),
        "settings": {"depth": args.depth, "model": f"resnet_v2({args.depth})",
                     "batch_size": args.batch_size, "partitions": args.partitions,
                     "microbatches": args.microbatches, "balance": args.balance,
                     "steps": args.steps, "seed": args.seed, "threads_per_process": 1},
        "baseline": baseline, "baseline_error": baseline_error, "runs": runs,
        "commands": commands,
    }
    harness.write_report(report, args.output)
    print(f"ResNet-{args.depth} v2, batch {args.batch_size}, balance={args.balance}, "
          f"{args.steps} steps, one TensorFlow thread per process.\n")
    print(table(report))


def main(argv=None):
    return harness.dispatch(parse_args(argv), worker, drive)


if __name__ == "__main__":
    sys.exit(main())
