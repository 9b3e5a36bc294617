"""Sums of an array over a communicator's ranks (whole, or each rank's share of it), started
now and completed later, by algorithms that move each byte over the network about twice
(once for a share) whatever the ranks' count.

MPI libraries do not all: Open MPI's nonblocking allreduce (libnbc) sums an array of 2 or 3
ranks, or any array given `MPI_IN_PLACE`, through one rank — a binomial tree up and down, the
whole array on every hop: at 2 ranks twice the bytes of a ring, at 2 nodes × 2 ranks 2.7×
the time of its own out-of-place algorithm on a 1 Gb/s link (measured: 1.00 s against
0.37 s for 40 MB). So below `FEW` ranks the sum is a ring of messages (reduce-scatter,
then allgather: 2(p − 1) steps of 1/p of the array each), and from `FEW` on MPI's own
out-of-place allreduce (libnbc then reduces and scatters by halving, then gathers by
doubling). Either way every rank ends with the same bytes: each element is summed in one
order, on one rank, and copied from there. A sum of which each rank keeps a share (ZeRO-1's
gradients) is the ring's first half at every size: Open MPI's nonblocking reduce-scatter
sums the whole array into one rank first.
"""

import numpy as np

from hyparflow.mpi.guard import test_all, wait_all

FEW = 4  # from this many ranks on, MPI's out-of-place allreduce; below, the ring
TAGS = 1024  # the largest tags below MPI's bound, kept for rings (no boundary tensor uses them)
_KEYVAL = []  # MPI's attribute key for a communicator's count of rings started on it


def start(array, comm):
    """A `Sum` of the contiguous numpy `array` over `comm`, summed in place once complete.
    Collective: every rank of `comm` starts the same sums in the same order."""
    _contiguous(array)
    p = comm.Get_size()
    if p == 1:
        return Sum(array, [])
    if p >= FEW:
        from mpi4py import MPI

        out = np.empty_like(array)
        return Sum(array, [comm.Iallreduce(array, out, op=MPI.SUM)], out=out)
    return Ring(array, comm, _bounds(array.size, p))


def start_scatter(array, counts, comm):
    """A `Sum` of `array` over `comm` of which each rank keeps its share: rank r the
    `counts[r]` elements after the first r ranks', summed, at the start of its `array` once
    complete. A ring's first half at every size (MPI's nonblocking reduce-scatter of Open
    MPI sums the whole array into one rank, then sends each its share). Collective."""
    _contiguous(array)
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if bounds[-1] > array.size or len(counts) != comm.Get_size():
        raise ValueError(f"counts {list(counts)} do not fit {comm.Get_size()} ranks' shares "
                         f"of an array of {array.size}")
    if comm.Get_size() == 1:
        return Sum(array, [])
    return Ring(array, comm, bounds, scatter=True)


def _contiguous(array):
    if not array.flags.c_contiguous:
        raise ValueError("a sum over ranks needs a contiguous array (it is summed in place)")


def _bounds(n, p):
    return np.linspace(0, n, p + 1).round().astype(np.int64)


def reserved_tag_floor():
    """The smallest tag a ring may use: boundary tensors' tags stay below it."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - TAGS + 1


class Sum:
    """A started sum, with mpi4py's request interface and names (`Test`, `Wait`, `Testall`,
    `Waitall`) so the guard waits for it as for an MPI request: complete once `Test` says
    so, the sum then in `array`."""

    def __init__(self, array, requests, out=None, done=None):
        self.array = array
        self._requests = requests
        self._out = out
        self._done = not requests if done is None else done

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
    """The ring: the array cut in p chunks (at `bounds`). At step s < p − 1 each rank sends
    chunk (rank + shift − 1 − s) to the next rank and adds chunk (rank + shift − 2 − s) from
    the previous one to its own, then holding chunk rank + shift summed over every rank;
    unless `scatter` (shift 0: its own chunk, then moved to the array's start), p − 1 steps
    more pass each summed chunk on (shift 1). One chunk of scratch."""

    def __init__(self, array, comm, bounds, scatter=False):
        super().__init__(array, [], done=False)
        self.comm = comm
        p, rank = comm.Get_size(), comm.Get_rank()
        self._p, self._rank, self._scatter = p, rank, scatter
        self._shift = 0 if scatter else 1
        self._next, self._previous = (rank + 1) % p, (rank - 1) % p
        flat = array.reshape(-1)
        self._chunks = [flat[bounds[i]:bounds[i + 1]] for i in range(p)]
        self._scratch = np.empty(max(len(c) for c in self._chunks), array.dtype)
        self._steps = p - 1 if scatter else 2 * (p - 1)
        self._tag = _tag(comm)
        self._step = 0
        self._post()

    def _post(self):
        s, p, first = self._step, self._p, self._rank + self._shift
        if s < p - 1:  # reduce-scatter
            send, receive = (first - 1 - s) % p, (first - 2 - s) % p
            into = self._scratch[:len(self._chunks[receive])]
        else:  # allgather
            t = s - (p - 1)
            send, receive = (first - t) % p, (first - 1 - t) % p
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
            if self._step == self._steps:
                self._done, self._requests = True, []
                if self._scatter:
                    own = self._chunks[self._rank]
                    np.copyto(self.array.reshape(-1)[:len(own)], own)  # (numpy minds overlap)
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
    return reserved_tag_floor() + (count[0] % TAGS)
