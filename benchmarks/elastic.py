"""An elastic job losing a node or a rank, on the cluster in a box: the time from the death to
the first step trained after it, and the steps trained twice.

Each run is `hyparflow-run --elastic` from node 0 of a 2-node box (tests/cluster/box.py), 2 ranks
a node: ResNet v1 (ResNet-56 by default), batch 64, a backup every `--backup-every` seconds. Three
losses, once the job has trained `--kill-at` steps:

* node: a 2 × 2 hybrid (a replica on each node), every process of node 1 killed (SIGKILL); the
  launcher runs the script again on node 0 at 2 × 1, from the last backup (the bundled Open
  MPI's runtime ends a job that loses a node: in place cannot be had);
* rank: data parallel 1 × 4, world rank 3 (on node 1) killed alone; the other three go on in
  place at 1 × 3 from the step they reached (no restart, no backup read);
* rank-hybrid: 2 × 2, world rank 3 (stage 1 of replica 1) killed alone; every stage has a copy
  left: the job goes on in place at 2 × 1 (world rank 2, with no stage, leaves it).

The worker's rank 0 prints each step's wall-clock end and the ranks training (the box's nodes
share the machine's clock), so the recovery time is the first step of the smaller job less the
kill, and the steps trained twice are the last step of the larger job less the first of the
smaller one, plus one. Rounds interleave the link profiles (unshaped; slow = 1 Gb/s and 100 µs
one way) and the losses::

    .venv/bin/python benchmarks/elastic.py                  # ResNet-56, 3 rounds: ~30 min here
    .venv/bin/python benchmarks/elastic.py --rounds 1 --depth 20 --loss rank
"""

import argparse
import os
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))

import box as box_  # noqa: E402  (tests/cluster/box.py)

from benchmarks import harness  # noqa: E402

PREFIX = "hfelastic"  # the box's own name: never the test tier's or bench-cluster's
PROFILES = ("unshaped", "slow")
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "hyparflow-run")


def worker(args):
    """One rank of the job: hf.fit at `--partitions` × (ranks / partitions), rank 0 printing
    ``STEP <global step> <time> RANKS <ranks training>`` at each step's end; every rank its
    process first (``PID <rank> <pid>``)."""
    from benchmarks.models import resnet_v1

    import hyparflow as hf  # isort: skip  (before keras, which loads TensorFlow)
    import keras
    from mpi4py import MPI

    from hyparflow.mpi import comm as comm_

    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    print(f"PID {rank} {os.getpid()}", flush=True)
    x, y, model = harness.cifar_job(resnet_v1, args.depth, args.steps * args.batch_size, 0)
    epoch_now = [0]

    def said(batch, logs):
        if rank == 0:  # (hyparflow's world: fewer ranks once it went on in place)
            print(f"STEP {epoch_now[0] * args.steps + batch} {time.time():.3f} RANKS "
                  f"{comm_.world().Get_size()}", flush=True)

    P = args.partitions
    hf.fit(model, x, y, partitions=P, replicas=size // P, batch_size=args.batch_size,
           epochs=args.epochs, verbose=0, shuffle=False,
           callbacks=[keras.callbacks.LambdaCallback(
               on_epoch_begin=lambda epoch, logs: epoch_now.__setitem__(0, epoch),
               on_train_batch_end=said)])
    if rank == 0:
        print(f"FINISHED RANKS {size}", flush=True)


# P, and the ranks left training after the loss
LOSSES = {"node": (2, 2), "rank": (1, 3), "rank-hybrid": (2, 2)}


def one_run(box, args, folder, loss):
    """The job, node 1 or world rank 3 killed after `--kill-at` steps: what happened."""
    P, left = LOSSES[loss]
    options = shlex.join(box.mpiexec_options(2))
    argv = box.enter(0) + [
        LAUNCHER, "-n", "4", "--mpiexec-args", options, "--elastic", "--elastic-dir", folder,
        "--backup-every", f"{args.backup_every:g}", sys.executable, __file__, "--worker",
        "--depth", str(args.depth), "--steps", str(args.steps), "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--partitions", str(P)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("HYPARFLOW_THREADS", None)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    lines, err = queue.Queue(), []
    readers = [threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True),
               threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)]
    for reader in readers:
        reader.start()
    steps, pids, killed, deadline = [], {}, None, time.monotonic() + args.timeout
    while time.monotonic() < deadline and (readers[0].is_alive() or not lines.empty()):
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        words = line.split()
        if words[:1] == ["PID"] and len(words) == 3:
            pids.setdefault(int(words[1]), int(words[2]))
        if words[:1] == ["STEP"]:
            steps.append((int(words[1]), float(words[2]), int(words[4])))
            if killed is None and int(words[4]) == 4 and int(words[1]) + 1 >= args.kill_at:
                killed = time.time()
                if loss == "node":
                    box.kill(1)
                else:
                    os.kill(pids[3], signal.SIGKILL)
    if proc.poll() is None:  # (out of time)
        os.killpg(proc.pid, 9)
    proc.wait()
    readers[1].join(timeout=5)
    before = [s for s in steps if s[2] == 4]
    after = [s for s in steps if s[2] == left]
    restart = [x for x in err if "elastic restart" in x or "goes on in place" in x]
    if proc.returncode != 0 or killed is None or not after:
        return {"error": f"exit {proc.returncode}; " + "".join(err)[-3000:]}
    return {"recovery_s": after[0][1] - killed, "last_before": before[-1][0],
            "first_after": after[0][0], "steps_twice": before[-1][0] + 1 - after[0][0],
            "step_s_before": statistics.median(b[1] - a[1] for a, b in zip(before, before[1:])),
            "step_s_after": statistics.median(b[1] - a[1] for a, b in zip(after, after[1:])),
            "restart_line": restart[0].strip() if restart else None, "error": None}


def drive(args):
    started = harness.now()
    ok, reason = box_.available()
    if not ok:
        print(f"elastic.py: the cluster in a box is not available here: {reason}")
        return 0
    runs = []
    losses = list(LOSSES) if args.loss == "all" else [args.loss]
    with box_.Box(nodes=2, profile="unshaped", prefix=PREFIX) as box:
        for r in range(args.rounds):
            arms = [(p, loss) for p in PROFILES for loss in losses]
            for profile, loss in arms if r % 2 == 0 else arms[::-1]:
                box.shape(profile)
                with tempfile.TemporaryDirectory() as tmp:
                    run = one_run(box, args, os.path.join(tmp, "elastic"), loss)
                run.update(round=r + 1, profile=profile, loss=loss)
                runs.append(run)
                print(f"round {r + 1}, {profile}, {loss}: " + (
                    f"recovered in {run['recovery_s']:.1f} s, {run['steps_twice']} steps "
                    "trained twice" if run["error"] is None else f"FAILED {run['error']}"),
                      file=sys.stderr, flush=True)
                box.shape("unshaped")
    report = harness.report(
        "elastic", __doc__, started,
        settings={"model": f"resnet_v1({args.depth})", "batch_size": args.batch_size,
                  "steps_per_epoch": args.steps, "epochs": args.epochs,
                  "kill_at": args.kill_at, "backup_every_s": args.backup_every,
                  "configuration": "2 nodes x 2 ranks; node: 2 x 2, node 1 killed, run again "
                                   "at 2 x 1; rank: 1 x 4, world rank 3 killed, in place at "
                                   "1 x 3; rank-hybrid: 2 x 2, world rank 3 killed, in place "
                                   "at 2 x 1"},
        runs=runs, commands={})
    lines = ["| round | link | loss | recovery | death → first step after (s) | steps trained "
             "twice | a step before / after (s) |",
             "| --- | --- | --- | --- | ---: | ---: | --- |"]
    how = {"node": "2 × 2 → restart at 2 × 1", "rank": "1 × 4 → in place at 1 × 3",
           "rank-hybrid": "2 × 2 → in place at 2 × 1"}
    for run in runs:
        if run["error"] is None:
            lines.append(f"| {run['round']} | {run['profile']} | {run['loss']} | "
                         f"{how[run['loss']]} | {run['recovery_s']:.1f} | {run['steps_twice']} "
                         f"| {run['step_s_before']:.2f} / {run['step_s_after']:.2f} |")
        else:
            lines.append(f"| {run['round']} | {run['profile']} | {run['loss']} | "
                         f"{how[run['loss']]} | failed | | |")
    text = (f"{report['machine']['cpu']}, commit {report['commit']}, {started}.\n\n"
            f"ResNet-{args.depth} v1, batch {args.batch_size}, 2 nodes of the box × 2 ranks, "
            f"the loss after {args.kill_at} steps, a backup every {args.backup_every:g} s.\n\n"
            + "\n".join(lines) + "\n")
    harness.publish(report, os.path.splitext(args.output)[0], text)
    return 0 if all(r["error"] is None for r in runs) else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=56)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="steps an epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=25,
                        help="node 1 is killed once the job has trained this many steps")
    parser.add_argument("--backup-every", type=float, default=20.0)
    parser.add_argument("--loss", choices=(*LOSSES, "all"), default="all",
                        help="what dies: node 1 (a restart), world rank 3 at 1 × 4 or at 2 × 2 "
                             "(in place)")
    parser.add_argument("--partitions", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed a run")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "elastic.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    harness.at_least_one(parser, args, "depth", "batch_size", "steps", "epochs", "rounds")
    if args.worker:
        harness.one_thread_per_rank()
        worker(args)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
