"""MPI for hyparflow: nonblocking boundary-tensor messages, fused gradient allreduce, abort."""

import atexit
import itertools
import os
import re
import sys
import time
import traceback
import zlib

import numpy as np

from hyparflow.mpi import guard as guard_
from hyparflow.mpi import placement, sums
from hyparflow.mpi.guard import GRACE, Guard, PeerLeft, WatchdogTimeout, bounded, cause, wait_all
from hyparflow.mpi.placement import TCP_PROGRESS

_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                  "MV2_COMM_WORLD_SIZE", "I_MPI_HYDRA_HOST_FILE")


def launched():
    """Whether this process was started by an MPI launcher."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def launched_size():
    """The number of ranks of the job this process was launched in (1: not launched), less
    those it went on without (`shrink`)."""
    if not launched():
        return 1
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size() - len(_LOST | _LEFT)


def launched_rank():
    """This process's number in MPI_COMM_WORLD (0: not launched)."""
    if not launched():
        return 0
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def progress_between_nodes(environ=os.environ):
    """Ask Open MPI for its TCP progress thread when this job spans nodes, before MPI starts.

    Only under Open MPI (which says its ranks per node and in the job), when some
    rank is on another node, and unless the user set the parameter (0 keeps it
    off). Returns whether it is on.
    """
    local = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    size = environ.get("OMPI_COMM_WORLD_SIZE", "")
    if local.isdigit() and size.isdigit() and int(local) < int(size):
        environ.setdefault(TCP_PROGRESS, "1")
    return environ.get(TCP_PROGRESS) == "1"


_WORLD = []


def world():
    """The job's communicator: MPI.COMM_WORLD, its ranks renumbered node by node if needed.

    The first call (collective: hf.fit, evaluate, predict and save make it on
    every rank) initialises MPI and groups each node's ranks together
    (`placement.grouped`), so that a pipeline's stages share a node whatever the
    launcher's rank placement.
    """
    if not _WORLD:
        from mpi4py import MPI

        grouped = placement.grouped(MPI.COMM_WORLD, bounded(
            MPI.COMM_WORLD, "every rank to make its first hyparflow call (hf.fit, hf.evaluate, "
            "hf.predict and hf.save are collective: call them on every rank)"))
        # (a copy at least: a loss revokes hyparflow's world, never MPI_COMM_WORLD, on which
        # `leaving` tells the others and `abort` ends the job)
        _WORLD.append(grouped.Dup() if grouped == MPI.COMM_WORLD else grouped)
    return _WORLD[0]


def mpi():
    from mpi4py import MPI

    return MPI


def any_thread_sends():
    """Whether this MPI lets a thread other than the main one send (MPI_THREAD_SERIALIZED or
    more): the step graph sends from TensorFlow's own thread."""
    MPI = mpi()
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED


# Tags: each boundary tensor gets a slot per micro-batch and direction.
FORWARD_TAG, BACKWARD_TAG = 0, 1


def tag(i, slot, direction, slots, pair=0, pairs=1):
    """The MPI tag of boundary tensor `slot` for micro-batch `i` in `direction`; `pair` of
    `pairs` tells apart the stages of two ranks that each hold several (interleaved: the
    producer's chunk × chunks + the consumer's)."""
    return ((i * slots + slot) * pairs + pair) * 2 + direction


ALIGN = 64  # TensorFlow takes a numpy buffer without copying when it is 64-byte aligned


def aligned_empty(shape, dtype, align=ALIGN):
    """An uninitialised numpy array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


class BufferPool:
    """Receive buffers kept from step to step, one per message slot.

    A fresh multi-megabyte buffer per message costs page faults on every step;
    a kept, aligned one is written by MPI and handed to TensorFlow without a copy.
    A buffer is reused only by the same slot in a later step, when nothing from
    the earlier step still reads it.
    """

    def __init__(self):
        self._buffers = {}

    def get(self, key, shape, dtype):
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != np.dtype(dtype):
            buf = self._buffers[key] = aligned_empty(shape, dtype)
        return buf


def message_shape(n, shape):
    """The shape of a boundary message for a micro-batch of n samples, from the tensor's shape
    without its batch axis (None: a stage's loss sum, a scalar)."""
    return () if shape is None else (n,) + tuple(shape)


def dynamic(shape):
    """Whether a boundary tensor of this shape (without its batch axis; None: a loss sum) has
    an axis the model leaves unknown (a sequence's length): its messages carry their shape."""
    return shape is not None and any(d is None for d in shape)


class Shaped:
    """A posted receive of a message whose shape comes first (`Messages.send_shaped`): the
    header's buffer; `payload` posts the tensor's own receive once the header has come."""

    def __init__(self, messages, header, dtype, source, tag_, pool, key):
        self.messages, self.header, self.dtype = messages, header, dtype
        self.source, self.tag, self.pool, self.key = source, tag_, pool, key

    def payload(self):
        """(request, buffer) of the tensor itself, of the shape the header gave."""
        return self.messages.recv(tuple(int(d) for d in self.header), self.dtype, self.source,
                                  self.tag, self.pool, self.key)


class Messages:
    """Nonblocking sends and receives of contiguous numpy buffers on one communicator.

    Sends are kept (with their buffers) until `wait_sends`; receives are waited for
    one at a time with `wait`. A tensor whose shape the receiver cannot derive goes as two
    messages with one tag, its shape first (`send_shaped`, `recv_shaped`): MPI delivers
    the messages of one sender, tag and communicator in the order they were sent.
    """

    def __init__(self, comm):
        self.comm = comm
        self._sends = []
        self._send_buffers = []

    def send(self, buffer, dest, tag_):
        buffer = np.ascontiguousarray(buffer)
        self._sends.append(self.comm.Isend(as_bytes(buffer), dest=dest, tag=tag_))
        self._send_buffers.append(buffer)

    def send_shaped(self, buffer, dest, tag_):
        """Send `buffer`'s shape (int64), then `buffer`, for a `recv_shaped`."""
        buffer = np.ascontiguousarray(buffer)
        self.send(np.array(buffer.shape, np.int64), dest, tag_)
        self.send(buffer, dest, tag_)

    def recv_shaped(self, ndim, dtype, source, tag_, pool=None, key=None):
        """Post the receive of the shape of a tensor of `ndim` axes (`send_shaped`).

        Returns:
            (request, `Shaped`): once the request completes, `Shaped.payload` posts the
            tensor's receive.
        """
        header = np.empty(ndim, np.int64)
        request = self.comm.Irecv(as_bytes(header), source=source, tag=tag_)
        return request, Shaped(self, header, dtype, source, tag_, pool, key)

    def recv(self, shape, dtype, source, tag_, pool=None, key=None):
        """Post a receive into a buffer from `pool` (kept under `key`), or a new one.

        Returns:
            (request, buffer)
        """
        buffer = pool.get(key, shape, dtype) if pool is not None else aligned_empty(shape, dtype)
        return self.comm.Irecv(as_bytes(buffer), source=source, tag=tag_), buffer

    def wait_sends(self, wait=None):
        """Wait for every send posted so far (with `wait(requests)` if given)."""
        if self._sends:
            (wait or wait_all)(self._sends)
        self._sends.clear()
        self._send_buffers.clear()


def from_root(comm, compute, what="computing"):
    """``compute()`` run on rank 0 of `comm`, its (picklable) result returned on every rank.

    The other ranks wait without spinning (a nonblocking barrier, polled with
    sleeps), so that ranks sharing cores with rank 0 leave them to it while it
    measures something. If `compute` raises, every rank raises a RuntimeError
    "`what` failed on rank 0: ..." (the others would wait forever otherwise);
    with `comm` None it runs here, its failure reported the same way.
    """
    ok, value, cause = True, None, None
    if comm is None or comm.Get_rank() == 0:
        try:
            value = compute()
        except BaseException as exc:  # every rank must hear of it, or the others wait
            ok, value, cause = False, f"{type(exc).__name__}: {exc}", exc
    if comm is not None:
        idle(comm.Ibarrier())
        ok, value = broadcast_object((ok, value), 0, comm)
    if not ok:  # rank 0's keeps the original, with its traceback
        raise RuntimeError(f"{what} failed on rank 0: {value}") from cause
    return value


def idle(request):
    """Wait for `request` without spinning (polled with short sleeps): the cores stay free
    for the ranks that are measuring something."""
    while not request.Test():
        time.sleep(0.005)


def complete(request, wait=None):
    """Wait for `request` (one, or a list): by `wait(request)` if given (a guard's bounded
    wait), else MPI's."""
    if wait is not None:
        wait(request)
    elif isinstance(request, list):
        wait_all(request)
    else:
        request.Wait()


def allreduce_sum(arrays, comm, wait=None):
    """Sum a list of numpy arrays over `comm` in one fused message; returns new arrays.

    `wait(request)`, if given, waits for the nonblocking allreduce (a watchdog).
    """
    if comm is None or comm.Get_size() == 1 or not arrays:
        return arrays
    by_dtype = {}
    for j, a in enumerate(arrays):
        by_dtype.setdefault(np.dtype(a.dtype), []).append(j)
    out = list(arrays)
    for dtype, idx in by_dtype.items():
        wide = summable(dtype)
        flat = np.concatenate([np.ravel(arrays[j]) for j in idx]).astype(wide, copy=False)
        complete(sums.start(flat, comm), wait)
        offset = 0
        for j in idx:
            n = arrays[j].size
            out[j] = flat[offset:offset + n].reshape(arrays[j].shape).astype(dtype, copy=False)
            offset += n
    return out


def summable(dtype):
    """The dtype a sum over ranks of `dtype` values is made in: itself, or float32 where MPI
    has no sum for it (bfloat16; float16 not everywhere)."""
    dtype = np.dtype(dtype)
    return dtype if dtype in _MPI_SUMS else np.dtype(np.float32)


_MPI_SUMS = {np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int16, np.int32,
                                   np.int64, np.uint8, np.uint16, np.uint32, np.uint64)}


def as_bytes(array):
    """A contiguous array's memory as uint8 (MPI moves bytes; numpy's bfloat16, float16 and
    bool need no MPI datatype of their own this way)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


CHUNK = 64 * 2**20  # bytes per broadcast message: bounds the extra memory of a model's broadcast


def broadcast_chunks(arrays, root, comm, wait=None):
    """Broadcast numpy arrays from `root` over `comm`, bit for bit whatever the dtypes.

    A generator of lists of consecutive arrays, one message of at most `CHUNK` bytes
    (or one larger array, broadcast in place) each: a caller that uses each list
    before asking for the next holds one message at a time, not a copy of
    everything, and `arrays` may be read lazily. Every rank passes arrays of the
    same shapes and dtypes; their values on ranks other than `root` are ignored.
    """
    if comm is None or comm.Get_size() == 1:
        yield list(arrays)
        return
    group, size = [], 0
    for a in itertools.chain(arrays, [None]):
        if group and (a is None or size + np.asarray(a).nbytes > CHUNK):
            yield _broadcast_group(group, root, comm, wait)
            group, size = [], 0
        if a is not None:
            group.append(a)
            size += np.asarray(a).nbytes


def _broadcast_group(group, root, comm, wait):
    """One message: a lone array in place, several through one concatenated buffer."""
    if len(group) == 1:
        g = np.asarray(group[0])  # (ascontiguousarray would make a scalar 1-d)
        g = g if g.flags.c_contiguous and g.flags.writeable else g.copy()
        complete(comm.Ibcast(as_bytes(g), root=root), wait)
        return [g]
    flat = np.concatenate([as_bytes(g) for g in group])
    complete(comm.Ibcast(flat, root=root), wait)
    out, offset = [], 0
    for g in group:
        g = np.asarray(g)
        out.append(flat[offset:offset + g.nbytes].view(g.dtype).reshape(g.shape))
        offset += g.nbytes
    return out


def allgather_rows(arrays, comm, wait=None):
    """Concatenate each array's rows over the ranks of `comm`, in rank order (every rank gets
    them); the arrays may have different numbers of rows on different ranks."""
    if comm is None or comm.Get_size() == 1:
        return arrays
    counts = np.zeros(comm.Get_size() * len(arrays), np.int64)
    complete(comm.Iallgather(np.array([len(a) for a in arrays], np.int64), counts), wait)
    counts = counts.reshape(comm.Get_size(), len(arrays))
    out = []
    for j, a in enumerate(arrays):
        a = np.ascontiguousarray(a)
        row = a[:1].nbytes if len(a) else int(np.prod(a.shape[1:], dtype=np.int64)) * a.itemsize
        sizes = counts[:, j] * row
        received = np.empty((int(counts[:, j].sum()),) + a.shape[1:], a.dtype)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        complete(comm.Iallgatherv(as_bytes(a), [as_bytes(received), sizes, offsets, mpi().BYTE]),
              wait)
        out.append(received)
    return out


def allgather_objects(obj, comm, wait=None):
    """Every rank gets the list of every rank's picklable object (occasional messages)."""
    import pickle

    if comm is None or comm.Get_size() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.zeros(comm.Get_size(), np.int64)
    complete(comm.Iallgather(np.array([data.size], np.int64), sizes), wait)
    received = np.empty(int(sizes.sum()), np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    complete(comm.Iallgatherv(data, [received, sizes, offsets, mpi().BYTE]), wait)
    return [pickle.loads(received[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]


_MADE = []  # the communicators hyparflow made (dup, split) and has not freed: revoked on a loss


def dup(comm):
    """A communicator of `comm`'s ranks for messages of their own, which never meet
    `comm`'s (collective over `comm`)."""
    made = comm.Dup()
    _MADE.append(made)
    return made


def split(comm, color, key):
    """`comm.Split(color, key)`, kept for `shrink` to revoke (collective over `comm`)."""
    made = comm.Split(color=color, key=key)
    _MADE.append(made)
    return made


def free(comm):
    """Release a communicator `dup` made (collective over it)."""
    if comm in _MADE:
        _MADE.remove(comm)
    comm.Free()


_LOST = guard_.LOST  # MPI_COMM_WORLD ranks known to have failed (skipped by `leaving`)
_LEFT = guard_.LEFT  # MPI_COMM_WORLD ranks that left the job after a loss (`keep_first`): likewise


def _world_ranks(comm, failed=False):
    """The MPI_COMM_WORLD ranks of `comm`'s processes, sorted (`failed`: of those this rank
    knows to have failed)."""
    return sorted(guard_.world_ranks(comm.Get_failed() if failed else comm.Get_group()))


def world_order(comm):
    """The MPI_COMM_WORLD ranks of `comm`'s processes, in `comm`'s order."""
    return guard_.world_ranks(comm.Get_group())


def gone(comm):
    """Whether `comm` is of a world the job went on without (revoked by `shrink`)."""
    return bool(_LOST) and comm is not None and comm.Is_revoked()


def lost_world_ranks():
    """The MPI_COMM_WORLD ranks the job went on without (`shrink`)."""
    return sorted(_LOST)


def left_world_ranks():
    """The MPI_COMM_WORLD ranks that left the job after a loss (`keep_first`)."""
    return sorted(_LEFT)


def failed_world_ranks(comm):
    """The MPI_COMM_WORLD ranks of `comm`'s processes this rank knows to have failed."""
    return _world_ranks(comm, failed=True)


def shrink(seconds):
    """After a loss (collective over the survivors): every communicator hyparflow made
    revoked, so that no survivor waits on one; the world without the failed processes
    becomes hyparflow's world. Returns it and the MPI_COMM_WORLD ranks that were lost. A
    survivor that waits `seconds` for the others to agree ends its process, with a line."""
    import threading

    MPI = mpi()
    old = world()
    for made in [old] + _MADE:
        if made != MPI.COMM_NULL:
            try:
                made.Revoke()
            except MPI.Exception:
                pass

    def stuck():  # (MPI_Comm_ishrink fails in Open MPI 5.0: the blocking one, watched)
        sys.stderr.write(f"hyparflow: rank {launched_rank()} waited {seconds:.0f} s for the "
                         "others left after a loss to agree on it; it ends.\n")
        sys.stderr.flush()
        guard_.told_loss(RuntimeError("the survivors did not agree"))
        os._exit(1)

    watchdog = threading.Timer(seconds, stuck)
    watchdog.daemon = True
    watchdog.start()
    try:
        new = old.Shrink()
    finally:
        watchdog.cancel()
    lost = sorted(set(_world_ranks(old)) - set(_world_ranks(new)))
    _MADE.clear()
    _LOST.update(lost)
    # a receive from any rank on MPI_COMM_WORLD (`guard.check_left`) may go on
    MPI.COMM_WORLD.Ack_failed()
    _WORLD[:] = [new]
    return new, lost


def keep_first(comm, n):
    """After a loss (collective over `comm`, the survivors' world): its first `n` ranks become
    hyparflow's world, returned to them; the others get None and are counted out of the job
    (`launched_size`, `leaving`): they leave it."""
    stays = comm.Get_rank() < n
    new = comm.Split(0 if stays else mpi().UNDEFINED, comm.Get_rank())
    _LEFT.update(world_order(comm)[n:])
    if not stays:
        return None
    _WORLD[:] = [new]
    return new


def start_allreduce(array, comm, op="sum", out=None):
    """Start combining `array` over `comm` by `op` ("sum" or "max"), in place (or into
    `out`); returns the request, for the caller to poll or `complete`. A sum in place moves
    each byte about twice whatever the ranks' count (`sums`)."""
    ops = {"sum": mpi().SUM, "max": mpi().MAX}
    if op == "sum" and out is None:
        return sums.start(array, comm)
    if out is None:
        return comm.Iallreduce(mpi().IN_PLACE, array, op=ops[op])
    return comm.Iallreduce(array, out, op=ops[op])


def allreduce(array, comm, op="sum", wait=None):
    """`array` combined over `comm` by `op` ("sum" or "max"), in place; `wait(request)`
    bounds it."""
    complete(start_allreduce(array, comm, op), wait)
    return array


def broadcast_array(array, root, comm, wait=None):
    """`root`'s `array` into every rank's `array` (same shape and dtype), in place."""
    complete(comm.Ibcast(array, root=root), wait)
    return array


def reduce_scatter_sum(flat, counts, comm, wait=None):
    """`flat` summed over `comm`, each rank keeping its `counts[rank]` elements, in place at
    the start of `flat` (no second buffer)."""
    complete(sums.start_scatter(flat, counts, comm), wait)
    return flat


def allgather_bytes(buffer, sizes, offsets, comm, wait=None):
    """Every rank's bytes of `buffer` (at its `offsets[rank]`, `sizes[rank]` long, already in
    place) into every rank's `buffer`."""
    complete(comm.Iallgatherv(mpi().IN_PLACE, [buffer, sizes, offsets, mpi().BYTE]), wait)
    return buffer


def broadcast_object(obj, root, comm, wait=None):
    """`root`'s picklable object, returned on every rank of `comm` (occasional messages),
    through nonblocking calls so that `wait(request)` can bound them."""
    import pickle

    if comm is None or comm.Get_size() == 1:
        return obj
    mine = comm.Get_rank() == root
    data = np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                         np.uint8) if mine else None
    size = np.array([data.size if mine else 0], np.int64)
    complete(comm.Ibcast(size, root=root), wait)
    if not mine:
        data = np.empty(int(size[0]), np.uint8)
    complete(comm.Ibcast(data, root=root), wait)
    return obj if mine else pickle.loads(data.tobytes())


def barrier(comm, wait=None):
    """Every rank of `comm` here, bounded by `wait(request)`."""
    if comm is not None and comm.Get_size() > 1:
        complete(comm.Ibarrier(), wait)


def gather_objects(obj, root, comm, wait=None):
    """Gather one picklable object per rank on `root` (a list there, None elsewhere).

    For occasional messages (checkpoints), through nonblocking calls so that
    `wait(request)` can bound them.
    """
    import pickle

    if comm is None or comm.Get_size() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.zeros(comm.Get_size(), np.int64) if comm.Get_rank() == root else None
    complete(comm.Igather(np.array([data.size], np.int64), [sizes, mpi().INT64_T], root=root),
          wait)
    if comm.Get_rank() != root:
        complete(comm.Igatherv(data, None, root=root), wait)
        return None
    received = np.empty(int(sizes.sum()), np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    complete(comm.Igatherv(data, [received, sizes, offsets, mpi().BYTE], root=root), wait)
    return [pickle.loads(received[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]


def agree(error, comm, fingerprint=None, wait=None, call="hf.fit"):
    """Collective check: raise the same exception on every rank if any rank has one.

    Args:
        error: an exception found on this rank, or None.
        comm: the communicator whose ranks must agree (None: this rank alone).
        fingerprint: a dict of what must be equal on every rank (e.g. the number of
            samples); ranks that differ get a ValueError naming the entry.
        wait: `wait(request)` bounds the wait for every rank to arrive (a watchdog);
            then the verdicts are exchanged.
        call: the call named in messages.

    Raises:
        The lowest failing rank's exception type with its message, on every rank;
        else a ValueError if the fingerprints differ.
    """
    if comm is None or comm.Get_size() == 1:
        if error is not None:
            raise error
        return
    if wait is not None:  # every rank arrives (bounded), and says if anything is wrong
        # and which call it is in: collectives match in order whatever code makes them, so
        # ranks in different hyparflow calls (rank 0 saving alone while the others evaluate)
        # would go on out of step; each sends its call's code and its negation, whose
        # maxima differ in sign unless every rank is in the same call
        code = zlib.crc32(call.encode()) & 0x7FFFFFFF
        flag = np.array([0 if error is None else 1, code, -code], np.int64)
        wait(comm.Iallreduce(mpi().IN_PLACE, flag, op=mpi().MAX))
        if flag[1] != -flag[2]:
            raise Guard.mark_agreed(ValueError(_out_of_step(allgather_objects(call, comm, wait))))
        if not flag[0] and not fingerprint:
            return
    verdicts = allgather_objects((None if error is None else (type(error), str(error)),
                                  fingerprint), comm, wait)
    failing = [(r, v) for r, (v, _) in enumerate(verdicts) if v is not None]
    if failing:
        rank, (kind, message) = failing[0]
        if error is not None and comm.Get_rank() == rank:
            raise Guard.mark_agreed(error)
        try:
            exc = kind(message)
        except Exception:  # exception types whose constructor takes other arguments
            exc = RuntimeError(message)
        raise Guard.mark_agreed(exc)
    prints = [f for _, f in verdicts]
    for key in (fingerprint or {}):
        values = {}
        for r, f in enumerate(prints):
            values.setdefault(repr(f.get(key)), []).append(r)
        if len(values) > 1 and all(isinstance(f.get(key), list) for f in prints):
            raise Guard.mark_agreed(
                ValueError(_first_difference(call, key, [f.get(key) for f in prints])))
        if len(values) > 1:
            shown = "; ".join(f"{v} on ranks {_ranks(rs)}" for v, rs in values.items())
            raise Guard.mark_agreed(ValueError(
                f"{call} got different {key} on different ranks: {shown}. Every rank must call "
                f"{call} with the same model, data and arguments (each rank reads its own share "
                "of the data by itself)."))


def _out_of_step(calls):
    """The message for ranks that are in different hyparflow calls (`calls`, by rank)."""
    where = {}
    for r, c in enumerate(calls):
        where.setdefault(c, []).append(r)
    shown = "; ".join(f"{c} on ranks {_ranks(rs)}" for c, rs in where.items())
    return (f"the ranks are in different hyparflow calls: {shown}. Every rank must make the "
            "same hyparflow calls (hf.fit, hf.evaluate, hf.predict, hf.save) in the same "
            "order: call hf.save on every rank too, not only on rank 0 (one rank writes).")


def _first_difference(call, key, lists):
    """The message for ranks whose `key` lists differ: the first differing entry, by rank."""
    k = 0
    while (all(k < len(entries) for entries in lists)
           and len({entries[k] for entries in lists}) == 1):
        k += 1
    values = {}
    for r, entries in enumerate(lists):
        values.setdefault(entries[k] if k < len(entries) else "(nothing: it ends there)",
                          []).append(r)
    shown = "; ".join(f"{v!r} on ranks {_ranks(rs)}" for v, rs in values.items())
    hint = ""
    if key.startswith("models") and all(isinstance(e, str) for es in lists for e in es) and \
            len({tuple(_AUTOMATIC.sub("", e) for e in entries) for entries in lists}) == 1:
        hint = (" They differ only in the names Keras numbers automatically (dense_1, "
                "input_layer_2): a rank built another model or layer first (say inside `if "
                "rank == 0:`). Build the same models in the same order on every rank, or name "
                "the layers (name=...).")
    return (f"{call} got different {key} on different ranks; the first difference, at entry "
            f"{k}: {shown}. Every rank must call {call} with the same model, data and "
            f"arguments (each rank reads its own share of the data by itself).{hint}")


# The number Keras appends to a name it makes up (dense_1, input_layer_2, functional_3).
_AUTOMATIC = re.compile(r"(?<=[A-Za-z])_\d+\b")


def _ranks(ranks):
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}, ..., {ranks[-1]}] ({len(ranks)})"


_hook_installed = False
LEAVING_WAIT = 1.0  # seconds a rank at the end of its script waits for every rank to be there


def leaving():
    """At the end of a rank's script (atexit): if not every rank is ending too, tell them.

    A rank whose script ends while another waits for it in a collective (hf.save
    or hf.fit called on some ranks only) would otherwise sit in MPI_Finalize, and
    the other wait until its watchdog. When the job's guard exists (some
    hyparflow call was collective), a nonblocking barrier of every rank's exit on
    its notice communicator (where no other collective runs) tells whether every
    rank is ending; if it does not complete within LEAVING_WAIT seconds, or with
    no guard, this rank sends each other rank a note on COMM_WORLD, which a
    hyparflow wait turns into an error within 50 ms (`guard.check_left`). Then
    it waits for the others, as MPI_Finalize would.
    """
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return
    job = guard_.for_job(None) if guard_.for_job_made() else None
    everyone = job.notices.Ibarrier() if job is not None and job.notices is not None else None
    deadline = time.monotonic() + LEAVING_WAIT
    while everyone is not None and not everyone.Test():
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    else:
        if everyone is not None:
            return  # every rank is ending
    me = world.Get_rank()
    notes = [world.isend("leaving", dest=r, tag=guard_.LEFT_TAG)
             for r in range(world.Get_size()) if r != me and r not in _LOST | _LEFT]
    if everyone is not None:
        everyone.Wait()
    MPI.Request.Waitall(notes)


def install_abort_hook():
    """Make an unhandled exception on any rank abort the whole MPI job.

    Without it, a failing rank exits while the others wait for its messages forever.
    Installed on import of hyparflow when running under an MPI launcher.
    """
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    atexit.register(leaving)
    previous = sys.excepthook

    def abort_on_exception(kind, value, tb):
        try:
            from mpi4py import MPI

            running = MPI.Is_initialized() and not MPI.Is_finalized()
            rank = MPI.COMM_WORLD.Get_rank() if running else 0
            if running and MPI.COMM_WORLD.Get_size() > 1:
                if Guard.agreed(value) and rank != 0:
                    # every rank raised it (hyparflow agreed on it): rank 0 prints it whole
                    sys.stderr.write(f"hyparflow: rank {rank} stops on the same "
                                     f"{kind.__name__} as every rank: {cause(value)}\n")
                    sys.stderr.flush()
                    time.sleep(GRACE)  # rank 0's traceback first, then its abort
                elif isinstance(value, (PeerLeft, WatchdogTimeout)):  # its report says it all
                    sys.stderr.write(f"{value}\n")
                elif guard_.lost_ranks(value):  # (outside any hf call: the launcher runs it again)
                    sys.stderr.write(f"hyparflow: rank {rank}: a rank of the job failed "
                                     f"({cause(value)}); the job ends.\n")
                    guard_.told_loss(value)
                else:
                    previous(kind, value, tb)
                    sys.stderr.write(f"hyparflow: rank {rank} failed; aborting the job.\n")
                    sys.stderr.flush()
                MPI.COMM_WORLD.Abort(1)
        except Exception:
            traceback.print_exc()
        previous(kind, value, tb)

    sys.excepthook = abort_on_exception
