"""Pipeline speedup: hf.fit with 2 stages × m micro-batches against single-process model.fit.

The script is its own driver: it runs a single-process `model.fit` baseline
child, then for each m a 2-rank `hyparflow-run` job, every process with one
TensorFlow thread, and compares their median images/s with the ideal speedup
2m/(m + 1) that the pipeline bubble allows with perfectly balanced stages::

    .venv/bin/python benchmarks/pipeline.py                      # ResNet-110, m = 1 2 4 8
    .venv/bin/python benchmarks/pipeline.py --depth 20 --reps 1 --steps 2 --microbatches 1 2
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402

PARTITIONS = 2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=110, help="ResNet v1 depth (default 110)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="micro-batch counts m to run (default: 1 2 4 8)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (median taken)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per repetition")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the weights")
    balance_option(parser)
    parser.add_argument("--recompute", action="store_true",
                        help="hf.fit(recompute=True): non-last stages run the forward again "
                             "inside the backward instead of keeping a tape")
    parser.add_argument("--step-graph", action="store_true",
                        help="hf.Schedule(step_graph=True): each stage's whole step one graph")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved", "zb-h1"),
                        default="1f1b",
                        help="hf.fit(schedule=...) (default 1f1b; interleaved: two stages a "
                             "rank; zb-h1: with --step-graph)")
    harness.driver_options(parser, 3600, "pipeline.json")
    args = parser.parse_args(argv)
    harness.at_least_one(parser, args, "depth", "batch_size", "reps", "steps")
    if any(m < 1 for m in args.microbatches):
        parser.error("--microbatches: every m must be at least 1")
    if args.worker == "hf" and len(args.microbatches) != 1:
        parser.error("--worker hf measures one m")
    return args


# --- workers: one measurement each, printed as a RESULT line -------------------------------

def worker(args):
    """Time `reps` calls of `steps` steps after a warm-up call; print the RESULT line."""
    harness.one_thread_per_rank()  # one TensorFlow thread per process, before TensorFlow loads
    import hyparflow as hf  # isort: skip  (before TensorFlow)
    import keras

    from benchmarks.models import resnet_v1

    class StepClock(keras.callbacks.Callback):
        """When each step ended: a call's later steps, without what the call does once."""

        def __init__(self):
            super().__init__()
            self.ends, self.steps = [], []

        def on_train_begin(self, logs=None):
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

        def on_train_end(self, logs=None):
            self.steps += [b - a for a, b in zip(self.ends, self.ends[1:])]

    clock = StepClock()
    samples = args.steps * args.batch_size
    x, y, model = harness.cifar_job(resnet_v1, args.depth, samples, args.seed,
                                    metrics=["accuracy"])

    if args.worker == "baseline":
        comm, rank, log = None, 0, True
        m = None

        def run():
            model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False,
                      callbacks=[clock])
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        if comm.Get_size() != PARTITIONS:
            raise SystemExit(f"--worker hf needs {PARTITIONS} MPI ranks, got {comm.Get_size()}")
        log = rank == PARTITIONS - 1  # replica 0's last stage
        m = args.microbatches[0]

        def run():
            hf.fit(model, x, y, partitions=PARTITIONS, replicas=1, microbatches=m,
                   batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False,
                   balance=balance_arg(args.balance), recompute=args.recompute,
                   schedule=hf.Schedule(args.schedule, step_graph=args.step_graph or None),
                   callbacks=[clock])

    start = time.perf_counter()
    run()  # warm-up: traces the functions (and, for hf, partitions the model)
    first = time.perf_counter() - start
    seconds = []
    clock.steps = []  # the warm-up's not counted
    for _ in range(args.reps):
        if comm is not None:
            comm.Barrier()
        start = time.perf_counter()
        run()
        elapsed = time.perf_counter() - start
        if comm is not None:
            elapsed = comm.allreduce(elapsed, op=MPI.MAX)
        seconds.append(elapsed)
    step_s = [comm.allreduce(s, op=MPI.MAX) for s in clock.steps] if comm is not None \
        else clock.steps  # (each step ends at the logs' allreduce: about alike on every rank)
    if log:
        rates = [samples / s for s in seconds]
        harness.print_result({
            "worker": args.worker, "depth": args.depth, "batch_size": args.batch_size,
            "steps": args.steps, "microbatches": m,
            "ranks": 1 if comm is None else comm.Get_size(),
            "threads": harness.thread_settings(),
            "first_call_s": first, "seconds": seconds, "images_per_s": rates,
            "median_images_per_s": statistics.median(rates),
            # a call's steps after its first, from one step's end to the next
            "step_seconds": step_s,
            "median_step_images_per_s": args.batch_size / statistics.median(step_s)
            if step_s else None,
            "stage_calls": None if comm is None else  # the split hf.fit made
            [len(s.calls) for s in model.__dict__["_hyparflow_fit"].partition.stages]})


# --- driver ---------------------------------------------------------------------------------

def common_args(args):
    return ["--depth", str(args.depth), "--batch-size", str(args.batch_size),
            "--reps", str(args.reps), "--steps", str(args.steps), "--seed", str(args.seed),
            "--balance", args.balance, "--schedule", args.schedule] + \
        (["--recompute"] if args.recompute else []) + \
        (["--step-graph"] if args.step_graph else [])


def balance_option(parser):
    """--balance, hf.fit's: a method name, or layer counts per stage (see `balance_arg`)."""
    parser.add_argument("--balance", default="layers",
                        help="hf.fit balance: a method name, or layer counts per stage as "
                             "'150,237' (default layers)")


def balance_arg(text):
    """'layers' → 'layers'; '150,237' → [150, 237]."""
    return [int(v) for v in text.split(",")] if "," in text else text


def bubble_bound(m, partitions=PARTITIONS, chunks=1):
    """Ideal pipeline speedup with perfectly balanced stages: P·m / (m + (P − 1)/v), v the
    stages a rank holds (interleaved: 2)."""
    return partitions * m / (m + (partitions - 1) / chunks)


def table(report):
    """The markdown table of a report."""
    settings, base = report["settings"], report["baseline"]
    base_rate = base["median_images_per_s"] if base else None
    base_cell = f"{base_rate:.1f}" if base else "failed"
    lines = [f"ResNet-{settings['depth']} v1, batch {settings['batch_size']}, P = {PARTITIONS}, "
             f"{settings.get('schedule', '1f1b')}, "
             f"one TensorFlow thread per process, median of {settings['reps']} × "
             f"{settings['steps']} steps; baseline: single-process model.fit"
             + ("" if base else f" (failed: {report['baseline_error'].splitlines()[0]})"),
             "",
             "| m | hf images/s | baseline images/s | speedup | a step's speedup "
             "| bubble bound | speedup / bound |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in report["runs"]:
        bound = f"{row['bubble_bound']:.2f}"
        step = f"{row['step_speedup']:.2f}" if row.get("step_speedup") else "—"
        if row["images_per_s"] is None:
            failed = f"failed: {row['error'].splitlines()[0]}"
            lines.append(f"| {row['microbatches']} | {failed} | {base_cell} | — | — | {bound} "
                         "| — |")
        elif row["speedup"] is None:
            lines.append(f"| {row['microbatches']} | {row['images_per_s']:.1f} | {base_cell} "
                         f"| — | — | {bound} | — |")
        else:
            lines.append(f"| {row['microbatches']} | {row['images_per_s']:.1f} | {base_cell} "
                         f"| {row['speedup']:.2f} | {step} | {bound} "
                         f"| {row['speedup'] / row['bubble_bound']:.2f} |")
    return "\n".join(lines)


def drive(args):
    started = harness.now()
    base_cmd = harness.child(__file__, "--worker", "baseline", *common_args(args))
    baseline, baseline_error = harness.launch(base_cmd, args.timeout)
    commands = {"baseline": base_cmd}
    runs = []
    for m in args.microbatches:
        cmd = harness.on_ranks(PARTITIONS, __file__, "--worker", "hf", "--microbatches", str(m),
                               *common_args(args))
        commands[f"hf_m{m}"] = cmd
        result, error = harness.launch(cmd, args.timeout)
        rate = result["median_images_per_s"] if result else None
        speedup = rate / baseline["median_images_per_s"] if rate and baseline else None
        step_rate = result.get("median_step_images_per_s") if result else None
        step_speedup = step_rate / baseline["median_step_images_per_s"] \
            if step_rate and baseline and baseline.get("median_step_images_per_s") else None
        runs.append({"microbatches": m, "images_per_s": rate, "speedup": speedup,
                     "step_speedup": step_speedup,
                     "bubble_bound": bubble_bound(
                         m, chunks=2 if args.schedule == "interleaved" else 1),
                     "error": error, "result": result})
    report = {
        "benchmark": "pipeline",
        "description": "hf.fit(partitions=2, replicas=1, balance=settings.balance) images/s for "
                       "each micro-batch count m, against single-process model.fit on the same "
                       "data and initial weights; one TensorFlow thread per process; median "
                       "of reps timed calls of `steps` steps, each after one warm-up call. "
                       "step_speedup: the same from the median time of a step, from one "
                       "step's end to the next (without what each call does once: every "
                       "rank getting rank 0's weights, every stage's weights gathered).",
        "started": started,
        "machine": harness.machine(),
        "settings": {"depth": args.depth, "batch_size": args.batch_size,
                     "partitions": PARTITIONS, "replicas": 1, "balance": args.balance,
                     "recompute": args.recompute, "step_graph": args.step_graph,
                     "schedule": args.schedule,
                     "microbatches": args.microbatches,
                     "reps": args.reps,
                     "steps": args.steps, "seed": args.seed, "threads_per_process": 1},
        "baseline": baseline,
        "baseline_error": baseline_error,
        "runs": runs,
        "commands": commands,
    }
    harness.write_report(report, args.output)
    print(table(report))
    print(f"\nwritten to {args.output}")
    return 0 if baseline and all(r["error"] is None for r in runs) else 1


def main(argv=None):
    return harness.dispatch(parse_args(argv), worker, drive)


if __name__ == "__main__":
    sys.exit(main())
