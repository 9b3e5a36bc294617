"""comm.from_root when rank 0's computation raises: every rank raises, none waits forever."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI

from hyparflow.mpi import comm


def compute():
    raise ValueError("no such layer")


world = MPI.COMM_WORLD
assert comm.from_root(world, lambda: world.Get_rank() * 10 + 7, "adding") == 7
try:
    comm.from_root(world, compute, "profiling")
except RuntimeError as exc:
    print(f"rank {world.Get_rank()} raised: {exc}", flush=True)
    sys.exit(3)
print(f"rank {world.Get_rank()} did not raise", flush=True)
