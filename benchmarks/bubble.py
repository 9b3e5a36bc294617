"""Measured step time against the pipeline-bubble model, and where each rank waits.

For P = 2 and each m, a two-rank hf.fit job (one TensorFlow thread per rank)
records its timeline (``trace=``) and reports, per step after a warm-up: the
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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.pipeline import (  # noqa: E402
    PARTITIONS,
    RESULT_PREFIX,
    THREAD_VARS,
    hyparflow_run,
    launch,
    machine,
    write_report,
)


def worker(args):
    for name in THREAD_VARS:
        os.environ[name] = "1"
    import hyparflow as hf  # isort: skip  (before TensorFlow)
    import keras
    import numpy as np

    from benchmarks.models import resnet_v1
    from hyparflow import trace

    samples = args.steps * args.batch_size
    rng = np.random.default_rng(0)
    x = rng.random((samples, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=samples).astype(np.int32)
    keras.utils.set_random_seed(0)
    model = resnet_v1(args.depth)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    if args.worker == "baseline":
        import time

        model.fit(x, y, batch_size=args.batch_size, verbose=0, shuffle=False)  # warm-up
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch_size, verbose=0, shuffle=False)
        print(RESULT_PREFIX + json.dumps({"step_s": (time.perf_counter() - start) / args.steps}),
              flush=True)
        return
    from mpi4py import MPI

    kwargs = dict(partitions=PARTITIONS, microbatches=args.m, batch_size=args.batch_size,
                  verbose=0, shuffle=False, balance="layers", schedule=args.schedule)
    hf.fit(model, x, y, **kwargs)  # warm-up: partition and trace
    path = os.path.join(tempfile.gettempdir(), f"hf-bubble-{os.getppid()}.json")
    hf.fit(model, x, y, trace=path, **kwargs)
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
    print(RESULT_PREFIX + json.dumps({
        "m": args.m, "step_s": statistics.median(steps), "idle": statistics.median(idle),
        "recv_wait_share": {str(r): statistics.median(w) for r, w in waits.items()}}), flush=True)


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
    script = os.path.abspath(__file__)
    common = ["--depth", str(args.depth), "--batch-size", str(args.batch_size),
              "--steps", str(args.steps), "--schedule", args.schedule]
    base, error = launch([sys.executable, script, "--worker", "baseline"] + common, args.timeout)
    if base is None:
        raise SystemExit(f"baseline failed: {error}")
    T1 = base["step_s"]
    rows = []
    for m in args.microbatches:
        cmd = hyparflow_run() + ["-n", str(PARTITIONS), "--threads", "1", sys.executable, script,
                                 "--worker", "hf", "--m", str(m)] + common
        result, error = launch(cmd, args.timeout)
        model = T1 / PARTITIONS * (m + PARTITIONS - 1) / m
        rows.append(dict(result or {"m": m, "error": error}, model_step_s=model))
    report = {"benchmark": "bubble", "machine": machine(), "settings": vars(args),
              "single_process_step_s": T1, "rows": rows}
    write_report(report, args.output)
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
