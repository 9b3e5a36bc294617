"""Sums of an array over a communicator's ranks, started now and completed later, by an
algorithm that moves each byte over the network about twice whatever the ranks' count.

MPI libraries do not all: Open MPI's nonblocking allreduce (libnbc) sums an array of 2 or 3
ranks, or any array given `MPI_IN_PLACE`, through one rank — a binomial tree up and down, the
whole array on every hop: at 2 ranks twice the bytes of a ring, at 2 nodes × 2 ranks 2.7×
the time of its own out-of-place algorithm on a 1 Gb/s link (measured: 1.00 s against
0.37 s for 40 MB). So below `FEW` ranks the sum is a ring of messages (reduce-scatter,
then allgather: 2(p − 1) steps of 1/p of the array each), and from `FEW` on MPI's own
out-of-place allreduce (libnbc then reduces and scatters by halving, then gathers by
doubling). Either way every rank ends with the same bytes: each element is summed in one
order, on one rank, and copied from there.
"""

import numpy as np

from hyparflow.mpi.guard import test_all, wait_all

FEW = 4  # from this many ranks on, MPI's out-of-place allreduce; below, the ring
TAGS = 1024  # the largest tags below MPI's bound, kept for rings (no boundary tensor uses them)
_KEYVAL = []  # MPI's attribute key for a communicator's count of rings started on it


def start(array, comm):
    """A `Sum` of the contiguous numpy `array` over `comm`, summed in place once complete.
    Collective: every rank of `comm` starts the same sums in the same order."""
    if not array.flags.c_contiguous:
        raise ValueError("a sum over ranks needs a contiguous array (it is summed in place)")
    p = comm.Get_size()
    if p == 1:
        return Sum(array, [])
    if p >= FEW:
        from mpi4py import MPI

        out = np.empty_like(array)
        return Sum(array, [comm.Iallreduce(array, out, op=MPI.SUM)], out=out)
    return Ring(array, comm)


def reserved_tag_floor():
    """The smallest tag a ring may use: boundary tensors' tags stay below it."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - TAGS + 1


class Sum:
    """A started sum, with mpi4py's request interface and names (`Test`, `Wait`, `Testall`,
    `Waitall`) so the guard waits for it as for an MPI request: complete once `Test` says
    so, the sum then in `array`."""

    def __init__(self, array, requests, out=None):
        self.array = array
        self._requests = requests
        self._out = out
        self._done = not requests

    def _advance(self):
        """Move on as far as the messages that arrived allow; whether the sum is complete."""
        if not self._done and test_all(self._requests):
            if self._out is not None:
                np.copyto(self.array, self._out)
                self._out = None
            self._done = True
        return self._done

    def Test(self, status=None):
        return self._advance()

    def Wait(self, status=None):
        while not self._advance():
            wait_all(self._requests)

    @classmethod
    def Testall(cls, requests, statuses=None):
        moved = [r.Test() for r in requests]  # every sum moves on, not only the first
        return all(moved)

    @classmethod
    def Waitall(cls, requests, statuses=None):
        for r in requests:
            r.Wait()


class Ring(Sum):
    """The ring: the array cut in p chunks; at step s < p − 1 each rank sends chunk
    (rank − s) to the next rank and adds chunk (rank − s − 1) from the previous one to its
    own (then holding chunk rank + 1 summed over every rank), and at the p − 1 steps after,
    passes on the summed chunk it last received. One chunk of scratch."""

    def __init__(self, array, comm):
        super().__init__(array, [])
        self._done = False
        self.comm = comm
        p, rank = comm.Get_size(), comm.Get_rank()
        self._p, self._rank = p, rank
        self._next, self._previous = (rank + 1) % p, (rank - 1) % p
        bounds = np.linspace(0, array.size, p + 1).round().astype(np.int64)
        self._chunks = [array.reshape(-1)[bounds[i]:bounds[i + 1]] for i in range(p)]
        self._scratch = np.empty(max(len(c) for c in self._chunks), array.dtype)
        self._tag = _tag(comm)
        self._step = 0
        self._post()

    def _post(self):
        s, p, rank = self._step, self._p, self._rank
        if s < p - 1:  # reduce-scatter
            send, receive = (rank - s) % p, (rank - s - 1) % p
            into = self._scratch[:len(self._chunks[receive])]
        else:  # allgather
            send, receive = (rank + 1 - (s - p + 1)) % p, (rank - (s - p + 1)) % p
            into = self._chunks[receive]
        self._receiving = receive
        self._requests = [self.comm.Irecv(into, source=self._previous, tag=self._tag),
                          self.comm.Isend(self._chunks[send], dest=self._next, tag=self._tag)]

    def _advance(self):
        while not self._done and test_all(self._requests):
            if self._step < self._p - 1:
                chunk = self._chunks[self._receiving]
                np.add(chunk, self._scratch[:len(chunk)], out=chunk)
            self._step += 1
            if self._step == 2 * (self._p - 1):
                self._done, self._requests = True, []
            else:
                self._post()
        return self._done


def _tag(comm):
    """The tag of the next ring on `comm`: its count of rings so far (an attribute of the
    communicator, so every rank counts the same rings), among the `TAGS` reserved ones."""
    from mpi4py import MPI

    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval())
    count = comm.Get_attr(_KEYVAL[0])
    if count is None:
        count = [0]
        comm.Set_attr(_KEYVAL[0], count)
    count[0] += 1
    return MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - (count[0] % TAGS)
