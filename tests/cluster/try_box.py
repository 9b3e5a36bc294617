"""Try the cluster in a box by hand: 2 nodes × 2 ranks report their processor names and an
allreduce, then the bandwidth and latency between two nodes, unshaped, at 1 Gb/s and on the
slow profile (1 Gb/s, 100 us one way: the forwarder in place of the bridge), and the same
allreduce on the slow profile, with the forwarder's counts."""

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import box

HELLO = """
from mpi4py import MPI
world = MPI.COMM_WORLD
total = world.allreduce(world.rank + 1)
print(f"rank {world.rank} of {world.size} on {MPI.Get_processor_name()}: allreduce {total}",
      flush=True)
"""

# Rank 0 and rank 1 on different nodes: one-way bandwidth (64 MiB messages) and half the
# round trip of one byte.
PROBE = """
import time
from mpi4py import MPI
world = MPI.COMM_WORLD
size, rounds, trips = 64 << 20, 4, 2000
data, small = bytearray(size), bytearray(1)
peer = 1 - world.rank
for label, count in (("warm-up", 1), ("measured", rounds)):
    world.Barrier()
    start = time.perf_counter()
    for _ in range(count):
        if world.rank == 0:
            world.Send(data, dest=peer)
        else:
            world.Recv(data, source=peer)
    world.Recv(small, source=peer) if world.rank == 0 else world.Send(small, dest=peer)
    seconds = time.perf_counter() - start
world.Barrier()
start = time.perf_counter()
for _ in range(trips):
    if world.rank == 0:
        world.Send(small, dest=peer)
        world.Recv(small, source=peer)
    else:
        world.Recv(small, source=peer)
        world.Send(small, dest=peer)
one_way = (time.perf_counter() - start) / trips / 2
if world.rank == 0:
    print(f"{MPI.Get_processor_name()} -> {world.recv(source=1)}: "
          f"{rounds * size / seconds / 1e6:.0f} MB/s, one-way latency {one_way * 1e6:.1f} us",
          flush=True)
else:
    world.send(MPI.Get_processor_name(), dest=0)
"""


def run(b, code, ranks_per_node, timeout=120):
    argv, env = b.command("-c", code, ranks_per_node=ranks_per_node,
                          env={"PYTHONUNBUFFERED": "1"})
    start = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"job failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return sorted(done.stdout.splitlines()), time.monotonic() - start


def main():
    ok, reason = box.available()
    if not ok:
        print(f"cluster in a box skipped: {reason}")
        return 0
    start = time.monotonic()
    b = box.Box(nodes=2, profile="unshaped")
    with b:
        print(f"built {b.nodes} nodes ({', '.join(b.hosts)}) in "
              f"{time.monotonic() - start:.2f} s")
        lines, seconds = run(b, HELLO, ranks_per_node=2)
        print(f"2 nodes x 2 ranks ({seconds:.1f} s):", *lines, sep="\n  ")
        for profile in ("unshaped", "1gbit", "slow"):
            b.shape(profile)
            lines, seconds = run(b, PROBE, ranks_per_node=1)
            print(f"{profile:>8}: {lines[0]}")
        lines, seconds = run(b, HELLO, ranks_per_node=2)
        print(f"2 nodes x 2 ranks, slow ({seconds:.1f} s):", *lines, sep="\n  ")
        b.shape("unshaped")  # stops the forwarder, which reports
        print("the forwarder:", *b.forwarder_report, sep="\n  ")
        start = time.monotonic()
    print(f"torn down in {time.monotonic() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
