"""An in-process communicator: the ranks of a job as threads of one process, with the subset
of mpi4py's communicator that hyparflow's transport uses, for testing the engine without MPI.

`Job(n).comms` is one `Comm` per rank, each used by one thread. Point-to-point messages are
matched as MPI matches them (by source and tag, in the order posted); each nonblocking
collective completes when every rank has posted it, and a rank that posts another
collective than the others at the same place raises `Mismatch` instead of corrupting or
hanging. Sends complete at once (their bytes are copied). Nothing here waits forever: a
`Wait` longer than `Job.timeout` raises `TimeoutError`.

The transport's helpers (`hyparflow.mpi.comm`) and the watchdog (`hyparflow.mpi.guard`) take
these communicators and requests as they take mpi4py's.
"""

import threading
import time
from collections import defaultdict, deque

import numpy as np
from mpi4py import MPI


class Mismatch(RuntimeError):
    """Ranks posted different collectives at the same place, or a message did not fit."""


def _buffer(spec):
    """(uint8 view of the data, per-rank sizes, offsets) of mpi4py's [array, counts,
    displacements, BYTE] (the transport's helpers count bytes)."""
    array, sizes, offsets, datatype = spec
    if datatype != MPI.BYTE:
        raise Mismatch(f"datatype {datatype} is not supported by the local communicator")
    return _bytes(array), [int(n) for n in sizes], [int(o) for o in offsets]


def _bytes(array):
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


class Request:
    """A posted operation: complete once `done()` says so (which may finish it)."""

    def __init__(self, job, done):
        self.job, self._done, self.complete = job, done, False

    def Test(self):
        if not self.complete:
            with self.job.lock:
                self.complete = self._done()
        return self.complete

    def Wait(self):
        deadline = time.monotonic() + self.job.timeout
        while not self.Test():
            if time.monotonic() > deadline:
                raise TimeoutError(f"a local request waited {self.job.timeout} s")
            with self.job.lock:
                self.job.changed.wait(0.01)

    @classmethod
    def Testall(cls, requests):
        done = [r.Test() for r in requests]  # each tested, as MPI progresses them all
        return all(done)

    @classmethod
    def Waitall(cls, requests):
        for r in requests:
            r.Wait()


class Job:
    """The shared state of `n` ranks: their mailboxes, collectives and duplicates."""

    def __init__(self, n, timeout=120.0):
        self.n, self.timeout = n, timeout
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.sent = defaultdict(deque)  # (source, dest, tag) → messages' bytes, in order
        self.posted = defaultdict(deque)  # (source, dest, tag) → receives' buffers, in order
        self.collectives = {}  # index → [kind, {rank: contribution}, ranks done]
        self.children = {}  # the k-th Dup → its Job
        self.comms = [Comm(self, r) for r in range(n)]

    def _match(self, key):
        """Pair the messages and the receives posted for (source, dest, tag), in order."""
        while self.sent[key] and self.posted[key]:
            data = self.sent[key].popleft()
            buffer, request = self.posted[key].popleft()
            target = _bytes(buffer) if buffer.flags.c_contiguous else None
            if target is None or data.size > target.size:
                raise Mismatch(f"a message of {data.size} bytes from rank {key[0]} (tag "
                               f"{key[2]}) does not fit rank {key[1]}'s receive of "
                               f"{buffer.nbytes} bytes")
            target[:data.size] = data
            request.complete = True
        self.changed.notify_all()


class Comm:
    """Rank `rank` of a `Job`: mpi4py's communicator methods that hyparflow's transport uses."""

    def __init__(self, job, rank):
        self.job, self.rank = job, rank
        self._collectives = 0  # collectives this rank has posted
        self._children = 0  # Dup calls this rank has made
        self._attributes = {}  # MPI's attributes cached on this rank's communicator

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.job.n

    # Point to point
    def Isend(self, buffer, dest, tag):
        key = (self.rank, dest, tag)
        with self.job.lock:
            self.job.sent[key].append(_bytes(buffer).copy())
            self.job._match(key)
        return Request(self.job, lambda: True)

    def Irecv(self, buffer, source, tag):
        key = (source, self.rank, tag)
        request = Request(self.job, lambda: request.complete)
        with self.job.lock:
            self.job.posted[key].append((np.asarray(buffer), request))
            self.job._match(key)
        return request

    # Communicators
    def Dup(self):
        """This rank's communicator of the job its k-th Dup makes (the first caller makes it)."""
        with self.job.lock:
            k = self._children
            self._children += 1
            if k not in self.job.children:
                self.job.children[k] = Job(self.job.n, self.job.timeout)
            return self.job.children[k].comms[self.rank]

    def Free(self):
        pass

    def Get_attr(self, keyval):
        return self._attributes.get(keyval)

    def Set_attr(self, keyval, value):
        self._attributes[keyval] = value

    # Collectives: each posts its contribution; its result is made when every rank has posted
    def _collective(self, kind, contribution, finish):
        job = self.job
        with job.lock:
            k = self._collectives
            self._collectives += 1
            entry = job.collectives.setdefault(k, [kind, {}, 0])
            if entry[0] != kind:
                raise Mismatch(f"rank {self.rank} posted {kind} as collective {k} where "
                               f"another rank posted {entry[0]}")
            entry[1][self.rank] = contribution
            job.changed.notify_all()

        def done():
            if len(entry[1]) < job.n:
                return False
            finish(entry[1])
            entry[2] += 1
            if entry[2] == job.n:
                del job.collectives[k]
            return True
        return Request(job, done)

    def Ibarrier(self):
        return self._collective("barrier", None, lambda all_: None)

    def Iallreduce(self, sendbuf, recvbuf, op):
        out = np.asarray(recvbuf)
        data = (out if sendbuf is MPI.IN_PLACE else np.asarray(sendbuf)).copy()
        name = "sum" if op == MPI.SUM else "max" if op == MPI.MAX else None
        if name is None:
            raise Mismatch(f"op {op} is not supported by the local communicator")
        combine = np.add if name == "sum" else np.maximum

        def finish(all_):
            total = all_[0].copy()
            for r in range(1, self.job.n):
                total = combine(total, all_[r])
            out[...] = total.reshape(out.shape)
        return self._collective(f"allreduce {name}", data, finish)

    def Ibcast(self, buffer, root=0):
        out = _bytes(buffer) if np.asarray(buffer).flags.c_contiguous else None
        data = out.copy() if self.rank == root else None

        def finish(all_):
            out[:] = all_[root]
        return self._collective(f"bcast from {root}", data, finish)

    def Iallgather(self, sendbuf, recvbuf):
        out = np.asarray(recvbuf).reshape(-1)
        data = np.asarray(sendbuf).reshape(-1).copy()

        def finish(all_):
            out[:] = np.concatenate([all_[r] for r in range(self.job.n)])
        return self._collective("allgather", data, finish)

    def Iallgatherv(self, sendbuf, recvbuf):
        out, sizes, offsets = _buffer(recvbuf)
        if sendbuf is MPI.IN_PLACE:
            o, n = offsets[self.rank], sizes[self.rank]
            data = out[o:o + n].copy()
        else:
            data = _bytes(sendbuf).copy()

        def finish(all_):
            for r in range(self.job.n):
                out[offsets[r]:offsets[r] + sizes[r]] = all_[r]
        return self._collective("allgatherv", data, finish)

    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts, op):
        out = np.asarray(recvbuf)
        data = (out if sendbuf is MPI.IN_PLACE else np.asarray(sendbuf)).reshape(-1).copy()
        start = int(sum(recvcounts[:self.rank]))
        n = int(recvcounts[self.rank])

        def finish(all_):
            total = sum(all_[r][start:start + n] for r in range(self.job.n))
            out.reshape(-1)[:n] = total
        return self._collective("reduce_scatter sum", data, finish)


def grid(partitions, replicas, timeout=120.0):
    """Per rank (rank = replica × partitions + stage, as `Topology`): its (pipeline, stage)
    communicators, as `Topology.communicators` splits a job's."""
    pipelines = [Job(partitions, timeout) for _ in range(replicas)]
    stages = [Job(replicas, timeout) for _ in range(partitions)]
    return [(pipelines[r].comms[s], stages[s].comms[r])
            for r in range(replicas) for s in range(partitions)]
