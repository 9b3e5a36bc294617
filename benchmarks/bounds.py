"""The most two ranks can give over one process on this machine, for the Speed table's targets.

Each round times, one thread per process, the steady step of `model.fit` on ResNet-110 v1 (SGD
with momentum, random CIFAR-shaped data) at the whole batch (64) and at the per-rank batches of
data parallelism (R = 2: 32) and of a two-stage pipeline's micro-batches (m = 4: 16), each once
alone and once as two independent processes side by side (no messages: what two ranks pay for
sharing the machine), and the optimizer's update alone (`hf.plan`'s `update_seconds`). A
step's time is the median of a job's steady steps; a pair's is its slower process's. From
them, per round, nothing assumed but the schedule's bubble:

    data parallel R = 2          t(64) / t_pair(32)
    pipeline P = 2, m, v chunks  t(64) / ((m + (P − 1)/v) · (t_pair(64/m) − u) / P + u / P)

(an upper bound: the sum over replicas, the messages, the cut's imbalance and the update's own
contention are taken as free). Arms alternate within a round (odd rounds reversed); every round
is kept, and the medians are what the targets are held against.

    .venv/bin/python benchmarks/bounds.py                  # 3 rounds: ~15 min here
    .venv/bin/python benchmarks/bounds.py --depth 20 --steps 3 --rounds 1   # a smoke run
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402 (no TensorFlow yet)

# what `make bench-readme` holds against its targets: (name, P, m, v, the target)
PIPELINES = [("pipeline P = 2, 1F1B, m = 4", 2, 4, 1, None),
             ("pipeline P = 2, interleaved (2 chunks a rank), m = 4", 2, 4, 2, 1.60)]
DATA_PARALLEL_TARGET = 1.90


def arms(batch, microbatches):
    """(name, per-process batch, processes side by side): the whole batch alone, the data-
    parallel share and the micro-batch alone and in pairs."""
    micro = batch // microbatches
    return [("one process", batch, 1), ("one, half batch", batch // 2, 1),
            ("pair, half batch", batch // 2, 2), ("one, micro-batch", micro, 1),
            ("pair, micro-batch", micro, 2)]


def worker(args):
    """A warm-up call, then `reps` timed calls of `steps` steps (after a barrier when two run
    side by side); RESULT: each process's median steady step, and the update's time."""
    harness.one_thread_per_rank(1)
    import hyparflow  # noqa: F401  # isort: skip  (before TensorFlow: one thread)
    import keras

    from benchmarks.models import resnet_v1

    comm = None
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))) > 1:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    x, y, model = harness.cifar_job(resnet_v1, args.depth, args.batch * args.steps, args.seed)
    ends = []
    timer = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(time.perf_counter()))

    def call():
        model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=[timer])

    call()  # traces and compiles
    steps = []
    for _ in range(args.reps):
        if comm is not None:
            comm.Barrier()  # the pair's timed calls overlap
        ends.clear()
        call()
        steps += [b - a for a, b in zip(ends, ends[1:])]
    step = statistics.median(steps)
    update = None
    if args.update:
        from hyparflow import planner

        update = planner.update_seconds(model.optimizer, list(model.trainable_variables),
                                        repeats=max(3, args.reps))
    per_process = [step] if comm is None else comm.gather(step, root=0)
    if comm is None or comm.Get_rank() == 0:
        harness.print_result({"batch": args.batch, "processes": len(per_process),
                              "step_s": per_process, "update_s": update})


def command(arm, args):
    name, batch, processes = arm
    words = ["--worker", "one", "--depth", str(args.depth), "--batch", str(batch), "--steps",
             str(args.steps), "--reps", str(args.reps), "--seed", str(args.seed)]
    if name == "one, micro-batch":
        words.append("--update")
    if processes == 1:
        return harness.child(__file__, *words)
    return harness.on_ranks(processes, __file__, *words)


def bounds(times, update, microbatches):
    """{what: the bound} from one round's `times` ({arm name: step s, a pair's slower}) and
    the update's seconds."""
    whole = times["one process"]
    out = {"data parallel R = 2": whole / times["pair, half batch"]}
    for what, P, m, v, _ in PIPELINES:
        if m != microbatches:
            continue
        micro = times["pair, micro-batch"] - update  # a micro-batch's forward + backward
        out[what] = whole / ((m + (P - 1) / v) * micro / P + update / P)
    return out


def targets():
    return {"data parallel R = 2": DATA_PARALLEL_TARGET,
            **{what: target for what, *_, target in PIPELINES if target}}


def drive(args):
    started, measured = harness.now(), harness.commit()
    runs = arms(args.batch, args.microbatches)
    records = {name: [] for name, *_ in runs}
    for r in range(args.rounds):
        for arm in runs if r % 2 == 0 else runs[::-1]:
            result, error = harness.launch(command(arm, args), args.timeout)
            records[arm[0]].append(result or {"error": error})
            print(f"round {r + 1}: {arm[0]}: "
                  f"{result['step_s'] if result else error}", file=sys.stderr, flush=True)
    per_round = []
    for r in range(args.rounds):
        got = {name: records[name][r] for name in records}
        if any("error" in g for g in got.values()):
            per_round.append(None)
            continue
        times = {name: max(g["step_s"]) for name, g in got.items()}
        per_round.append({"times": times, "update_s": got["one, micro-batch"]["update_s"],
                          "bounds": bounds(times, got["one, micro-batch"]["update_s"],
                                           args.microbatches)})
    kept = [p for p in per_round if p]
    medians = {what: statistics.median(p["bounds"][what] for p in kept)
               for what in (kept[0]["bounds"] if kept else {})}
    report = harness.report("bounds", __doc__, started, commit=measured,
                            settings={k: v for k, v in vars(args).items()
                                      if k not in ("output", "worker", "update")},
                            records=records, rounds=per_round, medians=medians,
                            targets=targets())
    harness.publish(report, args.output, markdown(report))
    return 0 if len(kept) == args.rounds else 1


def markdown(report):
    s, m = report["settings"], report["machine"]
    lines = ["# `benchmarks/bounds.py`", "",
             f"Command: `{report['command']}`; started {report['started']}; commit "
             f"{report['commit']}; machine: {m['cpu']} ({m['usable_cores']} cores). ResNet-"
             f"{s['depth']} v1, batch {s['batch']}, m = {s['microbatches']}; a step is the "
             f"median of {s['reps']} calls' steady steps.", "",
             "| round | " + " | ".join(f"{name} (s)" for name, *_ in
                                       arms(s["batch"], s["microbatches"]))
             + " | update (s) | " + " | ".join(report["medians"]) + " |",
             "| ---: |" + " ---: |" * (len(arms(s["batch"], s["microbatches"])) + 1
                                       + len(report["medians"]))]
    for r, got in enumerate(report["rounds"], 1):
        if got is None:
            lines.append(f"| {r} | failed |")
            continue
        lines.append(f"| {r} | " + " | ".join(f"{t:.3f}" for t in got["times"].values())
                     + f" | {got['update_s']:.4f} | "
                     + " | ".join(f"{got['bounds'][w]:.2f}" for w in report["medians"]) + " |")
    lines += ["", "| the most two ranks can give over one process | median bound | target |",
              "| --- | ---: | ---: |"]
    for what, value in report["medians"].items():
        target = report["targets"].get(what)
        lines.append(f"| {what} | {value:.2f} | {'—' if target is None else f'{target:.2f}'}"
                     " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=110, help="ResNet v1 depth (110)")
    parser.add_argument("--batch", type=int, default=64, help="the whole batch (64)")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="the pipeline's micro-batches, m (4)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed call (10)")
    parser.add_argument("--reps", type=int, default=2, help="timed calls per job (2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every arm (3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--update", action="store_true", help=argparse.SUPPRESS)
    harness.driver_options(parser, 1200, "bounds", roles=("one",))
    args = parser.parse_args(argv)
    harness.at_least_one(parser, args, "depth", "batch", "microbatches", "reps", "rounds")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (steady steps: from one's end to the next's)")
    if args.batch % 2 or args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} must divide into 2 replicas and into "
                     f"--microbatches {args.microbatches} micro-batches")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(harness.dispatch(arguments, worker, drive))
