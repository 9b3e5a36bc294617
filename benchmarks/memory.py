"""Peak memory per rank: GPipe, 1F1B and 1F1B + recompute at P = 2 for several m.

The script is its own driver, like `pipeline.py`: for every schedule (gpipe,
1f1b, 1f1b+recompute) and every micro-batch count m it runs a 2-rank
`hyparflow-run` job that trains a deep residual network (ResNet-164 v2 by
default), and one single-process `model.fit` child for reference. Every
process uses one TensorFlow thread. Each process reports, in KiB:

* ``rss_before``: its resident set just before the first fit call (TensorFlow,
  the model, the optimizer and the data loaded, nothing trained yet);
* ``peak``: its peak resident set over the whole run, from
  ``getrusage(RUSAGE_SELF).ru_maxrss`` read after training (see below);
* ``growth``: ``peak - rss_before``, the memory training added: activations kept
  for the backward, gradients, optimizer slots, traced functions, buffers;
* ``steps_peak`` / ``steps_growth``: the same over the measured calls alone.
  After the warm-up call the kernel's high-water mark is reset (writing 5 to
  ``/proc/self/clear_refs``), so this peak leaves out what only the first call
  (tracing, partitioning) needed.

Resetting the high-water mark also resets what ``ru_maxrss`` reports, so
``ru_maxrss`` is read once before the reset and once after training, and
``peak`` is the larger. The batch is fixed (``--batch-size``, 64), so the
micro-batch holds batch/m samples and shrinks as m grows::

    .venv/bin/python benchmarks/memory.py                          # ResNet-164 v2, m = 4 8 16
    .venv/bin/python benchmarks/memory.py --depth 29 --steps 1 --microbatches 4 --output /tmp/m.json
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402
from benchmarks.pipeline import PARTITIONS, balance_arg, balance_option  # noqa: E402

SCHEDULES = {"gpipe": ("gpipe", False), "1f1b": ("1f1b", False),
             "1f1b+recompute": ("1f1b", True)}


# --- memory readings (KiB): harness.current_rss, harness.maxrss, and a reset -----------------

def reset_peak():
    """Reset the kernel's high-water mark of this process's RSS; True if it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --- workers: one measurement each, printed as a RESULT line -------------------------------

def resnet_job(args):
    """One TensorFlow thread, then the data and the compiled ResNet v2 of `args`: (x, y, model)."""
    harness.one_thread_per_rank()  # one TensorFlow thread per process, before TensorFlow loads
    import hyparflow  # noqa: F401  # isort: skip  (before keras, which loads TensorFlow)

    from benchmarks.models import resnet_v2

    return harness.cifar_job(resnet_v2, args.depth, args.steps * args.batch_size, args.seed)


def job_options(parser, depth, batch_size):
    """--depth and --batch-size of `resnet_job` (it reads --steps and --seed too)."""
    parser.add_argument("--depth", type=int, default=depth, help=f"ResNet v2 depth, 9n+2 ({depth})")
    parser.add_argument("--batch-size", type=int, default=batch_size)


def worker(args):
    """Train after recording the RSS; report each rank's peaks on the logging rank."""
    x, y, model = resnet_job(args)
    import hyparflow as hf

    if args.worker == "baseline":
        comm, rank, m = None, 0, None
        schedule = recompute = None

        def run():
            return model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0,
                             shuffle=False)
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        if comm.Get_size() != PARTITIONS:
            raise SystemExit(f"--worker hf needs {PARTITIONS} MPI ranks, got {comm.Get_size()}")
        m = args.microbatches[0]
        schedule, recompute = SCHEDULES[args.schedules[0]]

        def run():
            return hf.fit(model, x, y, partitions=PARTITIONS, replicas=1, microbatches=m,
                          batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False,
                          balance=balance_arg(args.balance), schedule=schedule,
                          recompute=recompute)

    before = harness.current_rss()
    run()  # warm-up: partitions the model (hf) and traces the functions
    warmup_peak = harness.maxrss()
    after_warmup = harness.current_rss()
    if comm is not None:
        comm.Barrier()
    reset = reset_peak()
    history = run()  # measured: `steps` steps
    after_peak = harness.maxrss()
    steps_peak = harness.status_kib("VmHWM") if reset else None
    peak = max(warmup_peak, after_peak)
    record = {
        "rank": rank, "stage": rank % PARTITIONS, "rss_before_kib": before,
        "peak_kib": peak, "growth_kib": peak - before,
        "warmup_peak_kib": warmup_peak, "rss_after_warmup_kib": after_warmup,
        "steps_peak_kib": steps_peak,
        "steps_growth_kib": None if steps_peak is None else steps_peak - before,
        "rss_after_kib": harness.current_rss(), "peak_reset": reset,
        "loss": float(history.history["loss"][-1]),
    }
    if comm is None:
        ranks = [record]
    else:
        ranks = comm.gather(record, root=PARTITIONS - 1)  # replica 0's last stage logs
        if rank != PARTITIONS - 1:
            return
    harness.print_result({
        "worker": args.worker, "depth": args.depth, "batch_size": args.batch_size,
        "steps": args.steps, "microbatches": m,
        "microbatch_size": None if m is None else args.batch_size / m,
        "schedule": None if comm is None else args.schedules[0],
        "ranks": ranks, "threads": harness.thread_settings()})


# --- driver ---------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    job_options(parser, depth=164, batch_size=64)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16],
                        help="micro-batch counts m to run (default: 4 8 16)")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                        help="schedules to run (default: gpipe 1f1b 1f1b+recompute)")
    parser.add_argument("--steps", type=int, default=3,
                        help="optimizer steps of the measured call, and of the warm-up call")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the weights")
    balance_option(parser)
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the single-process model.fit child")
    harness.driver_options(parser, 900, "memory.json")
    args = parser.parse_args(argv)
    harness.at_least_one(parser, args, "depth", "batch_size", "steps")
    if any(m < 1 for m in args.microbatches):
        parser.error("--microbatches: every m must be at least 1")
    if args.worker == "hf" and (len(args.microbatches) != 1 or len(args.schedules) != 1):
        parser.error("--worker hf measures one m and one schedule")
    return args


def common_args(args):
    return ["--depth", str(args.depth), "--batch-size", str(args.batch_size),
            "--steps", str(args.steps), "--seed", str(args.seed), "--balance", args.balance]


def mib(kib):
    return "—" if kib is None else f"{kib / 1024:.0f}"


def table(report, peak="peak_kib", growth="growth_kib"):
    """Markdown table of a report: per schedule and m, each stage's peak and growth (MiB)."""
    lines = [("| schedule | m | micro-batch | peak RSS stage 0 (MiB) | peak RSS stage 1 (MiB) "
              "| growth stage 0 (MiB) | growth stage 1 (MiB) |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = report["baseline"]
    if base is not None:
        b = base["ranks"][0]
        lines.append(f"| `model.fit`, 1 process | — | {report['settings']['batch_size']} "
                     f"| {mib(b[peak])} (whole model) | — | {mib(b[growth])} (whole model) | — |")
    elif report["baseline_error"]:
        lines.append(f"| `model.fit`, 1 process | — | — "
                     f"| failed: {report['baseline_error'].splitlines()[0]} | | | |")
    for row in report["runs"]:
        head = f"| {row['schedule']} | {row['microbatches']} "
        if row["result"] is None:
            lines.append(head + f"| — | failed: {row['error'].splitlines()[0]} | | | |")
            continue
        by_stage = {r["stage"]: r for r in row["result"]["ranks"]}
        s0, s1 = by_stage[0], by_stage[1]
        mb = row["result"]["microbatch_size"]
        lines.append(head + f"| {mb:g} | {mib(s0[peak])} | {mib(s1[peak])} "
                     f"| {mib(s0[growth])} | {mib(s1[growth])} |")
    return "\n".join(lines)


def drive(args):
    started = harness.now()
    commands = {}
    baseline = baseline_error = None
    if not args.no_baseline:
        cmd = harness.child(__file__, "--worker", "baseline", *common_args(args))
        commands["baseline"] = cmd
        baseline, baseline_error = harness.launch(cmd, args.timeout)
    runs = []
    for name in args.schedules:
        for m in args.microbatches:
            cmd = harness.on_ranks(PARTITIONS, __file__, "--worker", "hf", "--microbatches",
                                   str(m), "--schedules", name, *common_args(args))
            commands[f"{name}_m{m}"] = cmd
            result, error = harness.launch(cmd, args.timeout)
            runs.append({"schedule": name, "microbatches": m, "error": error, "result": result})
    report = {
        "benchmark": "memory",
        "description": "Peak resident set (KiB) of each rank of a 2-rank hf.fit job "
                       "(partitions=2, replicas=1) for each schedule and micro-batch count "
                       "m, and of a single-process model.fit, on ResNet v2. One TensorFlow "
                       "thread per process. The batch is fixed, so a micro-batch holds "
                       "batch_size/m samples. rss_before: RSS just before the first fit "
                       "call; peak: max of ru_maxrss read after the warm-up call and after "
                       "the measured call (the high-water mark is reset between them); "
                       "growth = peak - rss_before; steps_peak: VmHWM over the measured "
                       "call alone (after the reset); steps_growth = steps_peak - rss_before.",
        "started": started,
        "machine": harness.machine(),
        "settings": {"depth": args.depth, "model": f"resnet_v2({args.depth})",
                     "batch_size": args.batch_size, "partitions": PARTITIONS, "replicas": 1,
                     "balance": args.balance, "microbatches": args.microbatches,
                     "schedules": args.schedules, "steps": args.steps,
                     "warmup_calls": 1, "seed": args.seed, "threads_per_process": 1,
                     "optimizer": "SGD(learning_rate=0.01, momentum=0.9)"},
        "baseline": baseline,
        "baseline_error": baseline_error,
        "runs": runs,
        "commands": commands,
    }
    harness.write_report(report, args.output)
    print(f"ResNet-{args.depth} v2, batch {args.batch_size} fixed (a micro-batch holds "
          f"{args.batch_size}/m samples), P = {PARTITIONS}, balance={args.balance}, one "
          f"TensorFlow thread per process; one warm-up call, then {args.steps} measured steps. "
          f"Peak = ru_maxrss over the whole run; growth = peak - RSS just before the first "
          f"fit call.\n")
    print(table(report))
    print("\nThe measured call alone (high-water mark reset after the warm-up call; "
          "steps_peak_kib in the results file):\n")
    print(table(report, "steps_peak_kib", "steps_growth_kib"))
    print(f"\nwritten to {args.output}")
    ok = (args.no_baseline or baseline is not None) and all(r["error"] is None for r in runs)
    return 0 if ok else 1


def main(argv=None):
    return harness.dispatch(parse_args(argv), worker, drive)


if __name__ == "__main__":
    sys.exit(main())
