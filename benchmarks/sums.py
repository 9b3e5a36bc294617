"""A stage's gradient sum over its replicas across two nodes: `hyparflow.mpi.sums` against
MPI's in-place nonblocking allreduce, which hyparflow called before.

How long does summing ResNet-1001's gradients (40 MB of float32) over the replicas take when
they sit on two nodes joined by a 1 Gb/s link? Open MPI's `MPI_Iallreduce` given
`MPI_IN_PLACE` (or 2–3 ranks) sums through one rank — a binomial tree up and down, the whole
array on every hop — where a ring or a reduce-scatter moves each byte about twice; its
reduce-scatter (ZeRO-1's) sums the whole array into one rank before sending the shares. On the
cluster in a box (`tests/cluster/box.py`, the `slow` link: 1 Gb/s, 100 µs each way), 2 nodes
× 1 rank and 2 nodes × 2 ranks; in each launch both arms alternate, `--reps` each, every
rep kept; `--rounds` launches per layout, interleaved.

    .venv/bin/python benchmarks/sums.py          # ~3 minutes here (root: network namespaces)
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402

LAYOUTS = (1, 2)  # ranks per node, on 2 nodes
ARMS = ("MPI_Iallreduce in place", "sums.start",  # the whole sum on every rank
        "MPI_Ireduce_scatter in place", "sums.start_scatter")  # each rank its share (ZeRO-1)
PAIRS = ((ARMS[0], ARMS[1]), (ARMS[2], ARMS[3]))  # (before, after)


def worker(args):
    import numpy as np
    from mpi4py import MPI

    from hyparflow.mpi import sums

    comm = MPI.COMM_WORLD
    array = np.ones(args.mbytes * 10**6 // 4, np.float32)
    p = comm.Get_size()
    counts = [array.size // p + (r < array.size % p) for r in range(p)]
    arms = {ARMS[0]: lambda: comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM).Wait(),
            ARMS[1]: lambda: sums.start(array, comm).Wait(),
            ARMS[2]: lambda: comm.Ireduce_scatter(MPI.IN_PLACE, array, recvcounts=counts,
                                                  op=MPI.SUM).Wait(),
            ARMS[3]: lambda: sums.start_scatter(array, counts, comm).Wait()}
    seconds = {name: [] for name in ARMS}
    for rep in range(args.reps + 1):  # the first of each: a warm-up, not kept
        for name in (ARMS if rep % 2 == 0 else ARMS[::-1]):
            comm.Barrier()
            start = time.perf_counter()
            arms[name]()
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if rep:
                seconds[name].append(elapsed)
    if comm.Get_rank() == 0:
        harness.print_result({"ranks": comm.Get_size(), "seconds": seconds})


def drive(args):
    sys.path.insert(0, os.path.join(harness.ROOT, "tests", "cluster"))
    import box as box_  # tests/cluster/box.py

    from benchmarks import cluster

    started = harness.now()
    runs = []
    with box_.Box(nodes=2, profile=args.link, prefix=cluster.PREFIX) as box:
        link = cluster.measure_link(box, args.timeout)
        print(link["line"], file=sys.stderr, flush=True)
        for r in range(args.rounds):
            for rpn in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
                argv, _ = box.command(os.path.abspath(__file__), "--worker", "--mbytes",
                                        args.mbytes, "--reps", args.reps, ranks_per_node=rpn,
                                        env=dict.fromkeys(harness.THREAD_VARS, "1"))
                result, error = harness.launch(argv, args.timeout)
                runs.append({"round": r, "ranks_per_node": rpn, "result": result,
                             "error": error})
                if error:
                    print(f"  2 × {rpn}: FAILED: {error}", file=sys.stderr, flush=True)
    report = harness.report("sums", __doc__, started, link=link, mbytes=args.mbytes,
                            reps=args.reps, runs=runs)
    harness.publish(report, args.output, markdown(report))
    return 0 if all(run["result"] for run in runs) else 1


def markdown(report):
    lines = [f"# A gradient sum over replicas on 2 nodes: {report['mbytes']} MB of float32", "",
             f"{report['machine']['cpu']}, commit {report['commit']}, {report['started']}. "
             f"Link: {report['link']['line']}. {report['reps']} reps of each arm a launch, "
             "alternating; seconds of the slowest rank, every rep.", "",
             "| layout | arm | seconds, every rep of every round | median |",
             "| --- | --- | --- | ---: |"]
    medians = {}
    for rpn in LAYOUTS:
        done = [run["result"] for run in report["runs"]
                if run["ranks_per_node"] == rpn and run["result"]]
        for name in ARMS:
            each = [s for result in done for s in result["seconds"][name]]
            medians[rpn, name] = statistics.median(each) if each else None
            lines.append(f"| 2 nodes × {rpn} | {name} | "
                         f"{', '.join(f'{s:.3f}' for s in each) or 'failed'} | "
                         f"{medians[rpn, name]:.3f} |" if each else
                         f"| 2 nodes × {rpn} | {name} | failed | — |")
    lines.append("")
    for rpn in LAYOUTS:
        for old, new in PAIRS:
            before, after = medians[rpn, old], medians[rpn, new]
            if before and after:
                lines.append(f"2 nodes × {rpn}: {new} takes {after / before:.2f} of "
                             f"{old}'s time ({before / after:.2f}× faster).")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mbytes", type=int, default=40, help="the array summed, MB")
    parser.add_argument("--reps", type=int, default=5, help="timed sums of each arm a launch")
    parser.add_argument("--rounds", type=int, default=3, help="launches per layout")
    parser.add_argument("--link", default="slow", help="the box's link profile")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "sums"))
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
