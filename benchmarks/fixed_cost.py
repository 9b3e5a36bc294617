"""What an hf.fit call costs besides its steps, against what model.fit's costs, in one run.

A call's fixed cost is everything it does once: checking its arguments, starting every rank
from rank 0's model, getting every stage's weights and optimizer state back to every rank at
the end. An ultra-deep model has thousands of variables, so it pays most: ResNet-1001 v2
(32×32, batch 8, SGD with momentum, one TensorFlow thread a process) by default, at P = 4
(m = 4) against one process's `model.fit`. Each arm is a child process (the hf one a
`hyparflow-run` job), the arms' launches alternating; in each, a warm-up call (it traces and
compiles), then `--rounds` pairs of calls of 1 and 3 steps (the pair's order alternating);
a pair's fixed cost is T(1) − (T(3) − T(1)) / 2, its step (T(3) − T(1)) / 2; the slower
rank's times::

    .venv/bin/python benchmarks/fixed_cost.py                 # ~12 min here
    .venv/bin/python benchmarks/fixed_cost.py --depth 110 --model v1 --partitions 2
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402

# the target of issue 47, row 4: hf.fit's fixed cost at most this many times model.fit's
TARGET = 2.0


def worker(args):
    harness.one_thread_per_rank()
    import hyparflow as hf  # isort: skip  (before TensorFlow)
    import keras
    import numpy as np

    from benchmarks.models import resnet_v1, resnet_v2

    P = args.partitions if args.worker == "hf" else 1
    comm = None
    if P > 1:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if comm.Get_size() != P:
            raise SystemExit(f"--worker hf needs {P} ranks, got {comm.Get_size()}")
    rng = np.random.default_rng(args.seed)
    x = rng.random((3 * args.batch_size, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, 3 * args.batch_size).astype(np.int32)
    keras.utils.set_random_seed(args.seed)
    model = (resnet_v1 if args.model == "v1" else resnet_v2)(args.depth)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")

    def call(steps):
        n = steps * args.batch_size
        if comm is not None:
            comm.Barrier()
        start = time.perf_counter()
        if P == 1:
            model.fit(x[:n], y[:n], batch_size=args.batch_size, epochs=1, verbose=0,
                      shuffle=False)
        else:
            hf.fit(model, x[:n], y[:n], partitions=P, microbatches=P,
                   batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False)
        seconds = time.perf_counter() - start
        return seconds if comm is None else comm.allreduce(seconds, op=MPI.MAX)

    first = call(1)  # warm-up: cuts, traces and compiles
    rounds = []
    for k in range(args.rounds):
        order = (1, 3) if k % 2 == 0 else (3, 1)
        t = {steps: call(steps) for steps in order}
        rounds.append({"order": list(order), "one_step_s": t[1], "three_steps_s": t[3],
                       "step_s": (t[3] - t[1]) / 2, "fixed_s": t[1] - (t[3] - t[1]) / 2})
    if comm is None or comm.Get_rank() == 0:
        harness.print_result({"arm": args.worker, "partitions": P, "first_call_s": first,
                              "variables": len(model.weights)
                              + len(model.optimizer.variables), "rounds": rounds,
                              "threads": harness.thread_settings()})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("v1", "v2"), default="v2",
                        help="ResNet v1 (depth 6n+2) or v2 (depth 9n+2)")
    parser.add_argument("--depth", type=int, default=1001)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="pairs of calls in a launch")
    parser.add_argument("--launches", type=int, default=2, help="launches of each arm")
    parser.add_argument("--seed", type=int, default=0)
    harness.driver_options(parser, 1800, "fixed_cost.json", roles=("keras", "hf"))
    args = parser.parse_args(argv)
    harness.at_least_one(parser, args, "depth", "batch_size", "partitions", "rounds",
                         "launches")
    return args


def _median(runs, arm, key):
    values = [r[key] for run in runs if run["arm"] == arm and run["result"]
              for r in run["result"]["rounds"]]
    return statistics.median(values) if values else None


def table(report):
    runs = report["runs"]
    lines = ["| launch | arm | first call (s) | per pair: fixed cost (s) | per pair: step (s) |",
             "| ---: | --- | ---: | --- | --- |"]
    for k, run in enumerate(runs):
        r = run["result"]
        if r is None:
            lines.append(f"| {k} | {run['arm']} | failed: {run['error'].splitlines()[0]} | | |")
            continue
        fixed = ", ".join(f"{x['fixed_s']:.2f}" for x in r["rounds"])
        steps = ", ".join(f"{x['step_s']:.2f}" for x in r["rounds"])
        lines.append(f"| {k} | {run['arm']} | {r['first_call_s']:.1f} | {fixed} | {steps} |")
    keras_fixed, hf_fixed = _median(runs, "keras", "fixed_s"), _median(runs, "hf", "fixed_s")
    if keras_fixed and hf_fixed:
        lines += ["", f"Medians: model.fit's fixed cost {keras_fixed:.2f} s, hf.fit's "
                      f"{hf_fixed:.2f} s: **{hf_fixed / keras_fixed:.2f}×** (target ≤ "
                      f"{TARGET:.1f}×); a step {_median(runs, 'keras', 'step_s'):.2f} s and "
                      f"{_median(runs, 'hf', 'step_s'):.2f} s."]
    return "\n".join(lines)


def drive(args):
    started = harness.now()
    words = ["--model", args.model, "--depth", str(args.depth), "--batch-size",
             str(args.batch_size), "--partitions", str(args.partitions), "--rounds",
             str(args.rounds), "--seed", str(args.seed)]
    commands = {"keras": harness.child(__file__, "--worker", "keras", *words),
                "hf": harness.on_ranks(args.partitions, __file__, "--worker", "hf", *words)}
    runs = []
    for _ in range(args.launches):
        for arm in ("keras", "hf"):
            result, error = harness.launch(commands[arm], args.timeout)
            runs.append({"arm": arm, "result": result, "error": error})
    report = harness.report(
        "fixed_cost", __doc__, started,
        settings={"model": f"resnet_{args.model}({args.depth})",
                  "batch_size": args.batch_size, "partitions": args.partitions,
                  "microbatches": args.partitions, "rounds": args.rounds,
                  "launches": args.launches, "seed": args.seed, "threads_per_process": 1,
                  "optimizer": "SGD(learning_rate=0.01, momentum=0.9)"},
        runs=runs, commands=commands)
    stem = os.path.splitext(args.output)[0]
    text = (f"{report['machine']['cpu']}, commit {report['commit']}, {started}.\n\n"
            f"ResNet-{args.depth} {args.model}, batch {args.batch_size}: one process's "
            f"model.fit against hf.fit at P = {args.partitions} (m = {args.partitions}), one "
            "TensorFlow thread a process; every round of every launch.\n\n"
            + table(report) + "\n")
    harness.publish(report, stem, text)
    return 0 if all(r["error"] is None for r in runs) else 1


def main(argv=None):
    return harness.dispatch(parse_args(argv), worker, drive)


if __name__ == "__main__":
    sys.exit(main())
