"""Measured step time against the pipeline-bubble model, and where each rank waits.

For P = 2 and each m, a two-rank hf.fit job (one TensorFlow thread per rank)
records its timeline (``hf.Trace``) and reports, per step after a warm-up: the
step time, the measured idle share, and each rank's receive-wait share of the
step. A single-process `model.fit` child gives T1, the step time of the whole
model on one core, and the bubble model predicts

    T(m) = T1 / P × (m + P − 1) / m

(perfect balance, free communication, micro-batches as efficient as the full
batch). Run::

    .venv/bin/python benchmarks/bubble.py                 # ResNet-56, m = 1 2 4 8 16
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402
from benchmarks.pipeline import PARTITIONS  # noqa: E402


def worker(args):
    harness.one_thread_per_rank()
    import hyparflow as hf  # isort: skip  (before TensorFlow)

    from benchmarks.models import resnet_v1
    from hyparflow import trace

    x, y, model = harness.cifar_job(resnet_v1, args.depth, args.steps * args.batch_size)
    if args.worker == "baseline":
        import time

        model.fit(x, y, batch_size=args.batch_size, verbose=0, shuffle=False)  # warm-up
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch_size, verbose=0, shuffle=False)
        harness.print_result({"step_s": (time.perf_counter() - start) / args.steps})
        return
    from mpi4py import MPI

    kwargs = dict(partitions=PARTITIONS, microbatches=args.m, batch_size=args.batch_size,
                  verbose=0, shuffle=False, balance="layers", schedule=args.schedule)
    hf.fit(model, x, y, **kwargs)  # warm-up: partition and trace
    path = os.path.join(tempfile.gettempdir(), f"hf-bubble-{os.getppid()}.json")
    hf.fit(model, x, y, callbacks=[hf.Trace(path)], **kwargs)
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    with open(path) as f:
        document = json.load(f)
    os.remove(path)
    steps, idle, waits = [], [], {r: [] for r in range(PARTITIONS)}
    for step in range(args.steps):
        seconds, shares = trace.step_shares(document, step, ("recv wait",))
        steps.append(seconds)
        idle.append(trace.bubble(document, step)[0])
        for r in waits:
            waits[r].append(shares.get(r, 0.0))
    harness.print_result({
        "m": args.m, "step_s": statistics.median(steps), "idle": statistics.median(idle),
        "recv_wait_share": {str(r): statistics.median(w) for r, w in waits.items()}})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=56)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "bubble.json"))
    parser.add_argument("--worker", choices=("baseline", "hf"), default=None)
    parser.add_argument("--m", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    common = ["--depth", str(args.depth), "--batch-size", str(args.batch_size),
              "--steps", str(args.steps), "--schedule", args.schedule]
    base, error = harness.launch(harness.child(__file__, "--worker", "baseline", *common),
                                 args.timeout)
    if base is None:
        raise SystemExit(f"baseline failed: {error}")
    T1 = base["step_s"]
    rows = []
    for m in args.microbatches:
        cmd = harness.on_ranks(PARTITIONS, __file__, "--worker", "hf", "--m", str(m), *common)
        result, error = harness.launch(cmd, args.timeout)
        model = T1 / PARTITIONS * (m + PARTITIONS - 1) / m
        rows.append(dict(result or {"m": m, "error": error}, model_step_s=model))
    report = {"benchmark": "bubble", "machine": harness.machine(), "settings": vars(args),
              "single_process_step_s": T1, "rows": rows}
    harness.write_report(report, args.output)
    print(f"ResNet-{args.depth} v1, batch {args.batch_size}, P = {PARTITIONS}, {args.schedule}, "
          f"one thread per rank; single process: {T1 * 1e3:.0f} ms/step\n")
    print("| m | step ms | bubble model ms | measured / model | idle (measured) | ideal bubble "
          "| recv wait, stage 0 | recv wait, stage 1 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        m = r["m"]
        if "error" in r:
            print(f"| {m} | failed: {r['error'].splitlines()[0]} | | | | | | |")
            continue
        ideal = (PARTITIONS - 1) / (m + PARTITIONS - 1)
        w = r["recv_wait_share"]
        print(f"| {m} | {r['step_s'] * 1e3:.0f} | {r['model_step_s'] * 1e3:.0f} | "
              f"{r['step_s'] / r['model_step_s']:.2f} | {r['idle']:.0%} | {ideal:.0%} | "
              f"{w['0']:.0%} | {w['1']:.0%} |")


if __name__ == "__main__":
    main()
