"""Every MPI call of hyparflow goes through its transport, hyparflow/mpi/: a collective
called elsewhere would escape the watchdog's bounds (`guard`) and the helpers' care (the
same order on every rank, nonblocking, pickled objects for occasional messages only)."""

import pathlib
import re

import hyparflow

_METHODS = ("Allreduce Iallreduce Bcast Ibcast Barrier Ibarrier Allgather Iallgather Allgatherv "
            "Iallgatherv Gather Igather Gatherv Igatherv Scatter Iscatter Reduce Ireduce "
            "Reduce_scatter Ireduce_scatter Alltoall Ialltoall Isend Irecv Send Recv Sendrecv "
            "Split Dup Free Abort Probe Iprobe allreduce bcast allgather gather scatter "
            "alltoall send recv barrier").split()
# (a receiver that is not a communicator: the transport's helpers, imported as `comm_`;
# TensorFlow's gather; the transport's `comm.Messages` of a step's boundary tensors)
_NOT_MPI = re.compile(r"\b(comm_|tf|ops|np|messages)\.\w+\($")
CALL = re.compile(r"([\w.\]\)]+)\.(" + "|".join(_METHODS) + r")\(")


def test_mpi_is_called_only_from_the_transport():
    root = pathlib.Path(hyparflow.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.parent == root / "mpi":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for m in CALL.finditer(code):
                if not _NOT_MPI.search(code[:m.end()]):
                    found.append(f"{path.relative_to(root)}:{n}: {m.group(0)}")
    assert not found, (f"{found}: call MPI through hyparflow/mpi/comm.py's helpers (bounded "
                       "by the watchdog), or add one there")


def test_the_scan_sees_a_collective():
    # the pattern finds what it must (a scan that finds nothing proves nothing)
    for line in ("world.Iallreduce(IN_PLACE, v)", "self.comm.Dup()", "comm.bcast(x, root=0)",
                 "world.allgather(kept)", "pair.Barrier()", "comm.Send(message, peer)"):
        m = CALL.search(line)
        assert m and not _NOT_MPI.search(line[:m.end()]), line
    for line in ("tf.gather(shape, axes)", "messages.send(buffer, dest, tag_)",
                 "comm_.allreduce(v, world, 'max', wait)"):
        m = CALL.search(line)
        assert m is None or _NOT_MPI.search(line[:m.end()]), line
