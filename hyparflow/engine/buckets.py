"""Gradient buckets: a stage's dense gradient sums, grouped from its last layer back, each summed
over the replicas from the moment the step's last backward hands it over, while that backward
still runs."""

import os
import queue
import threading
import time

import numpy as np

from hyparflow.mpi import comm as comm_
from hyparflow.mpi import memory as memory_

ENV = "HYPARFLOW_BUCKET_MB"
SMALLEST = 1 << 20  # bytes: a bucket is at least this large ...
MOST = 32  # ... or a 1/MOST of the stage's gradients, whichever is larger
POLL = 0.0002  # seconds between the reducer thread's looks at its allreduces
_STOP = object()


def cap(environ=os.environ):
    """Bytes per bucket asked for by $HYPARFLOW_BUCKET_MB: None (unset: hyparflow chooses),
    0 (one allreduce after the backward, no overlap) or a positive size in MiB.

    Raises:
        ValueError: the variable is not a number ≥ 0, naming it and the fix.
    """
    value, mib = memory_.env_number(ENV, environ)
    if value is None:
        return None
    if not 0 <= mib < float("inf"):
        raise ValueError(
            f"{ENV}={value!r}: give the gradient bucket size in MiB, a number ≥ 0 (e.g. "
            f"{ENV}=4), 0 for one allreduce after the backward, or leave it unset for "
            "hyparflow's choice.")
    return int(mib * 2**20)


def limit_of(total, limit=None):
    """Bytes per bucket of a stage whose dense gradients take `total` bytes: `limit` if
    given, else the larger of `SMALLEST` and 1/`MOST` of the whole."""
    return max(SMALLEST, total // MOST) if limit is None else limit


def layout(sizes, dtypes, limit=None):
    """The buckets of a stage's dense gradients: lists of variable positions, the last
    variable's bucket first (a backward computes the last layers' gradients first).

    Args:
        sizes: bytes of each variable's gradient in the stage's order, None where it
            has no dense sum (a sparse gradient) and takes no bucket.
        dtypes: the dtype each sum travels in (`comm.summable`): a bucket holds one.
        limit: bytes per bucket (None: the larger of `SMALLEST` and 1/`MOST` of the
            whole); a variable larger than it gets a bucket of its own.
    """
    present = [k for k, n in enumerate(sizes) if n is not None]
    limit = limit_of(sum(sizes[k] for k in present), limit)
    buckets, size = [], 0
    for k in reversed(present):
        if buckets and size + sizes[k] <= limit and dtypes[buckets[-1][0]] == dtypes[k]:
            buckets[-1].append(k)
            size += sizes[k]
        else:
            buckets.append([k])
            size = sizes[k]
    return buckets


class _Bucket:
    """One bucket: its variables' positions, shapes and dtypes, and the flat buffer (in the
    dtype MPI sums) it is reduced in."""

    def __init__(self, positions, variables):
        self.positions = positions
        self.shapes = [tuple(variables[k].shape) for k in positions]
        self.dtypes = [np.dtype(variables[k].dtype.as_numpy_dtype) for k in positions]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.buffer = None

    def renew(self):
        """A new buffer for a step (the last step's values stay with whoever holds them)."""
        self.buffer = np.empty(sum(self.sizes), comm_.summable(self.dtypes[0]))

    def fill(self, arrays):
        offset = 0
        for a, n in zip(arrays, self.sizes):
            self.buffer[offset:offset + n] = np.ravel(a)
            offset += n

    def values(self):
        """{position: the summed gradient, in its variable's shape and dtype}."""
        out, offset = {}, 0
        for k, shape, dtype, n in zip(self.positions, self.shapes, self.dtypes, self.sizes):
            out[k] = self.buffer[offset:offset + n].reshape(shape).astype(dtype, copy=False)
            offset += n
        return out


class Reducer:
    """Sums a stage's dense gradients over its replicas bucket by bucket, starting each as
    soon as the step's last backward has finished it.

    `hooks`, called as the stage's accumulation traces, puts one small Python op per
    bucket in the compiled function, after that bucket's sums, under a condition on a
    flag variable (other micro-batches do not enter Python). On the step's last
    micro-batch (`arm`) each op copies its bucket and hands it to a reducer thread,
    which starts the buckets' allreduces in bucket order (the same on every replica,
    as MPI requires of collectives) and keeps them moving while TensorFlow computes
    the earlier layers' gradients. `finish`, on the training thread after the
    backward, waits for them through the watchdog. The buckets and their order are
    the same whether the thread starts them early or `finish` starts them late, so
    the sums are too: overlap changes when bytes move, never what is summed.

    How early a bucket is handed over is TensorFlow's executor's choice: with one
    inter-op thread it runs the weight gradients and these ops after the input
    gradients, so the buckets reach the thread only at the end of the backward.

    Args:
        comm: the stage's replicas (used by the thread only between `arm` and `finish`,
            while the training thread sends on other communicators).
        limit: bytes per bucket (None: `layout`'s choice).
        threaded: start allreduces on a thread (None: when MPI allows any thread to call
            it, MPI_THREAD_MULTIPLE); else `finish` starts them all.
        record: record(kind, bucket, start, end), to put spans on the step's timeline.
    """

    def __init__(self, comm, limit=None, threaded=None, record=None):
        self.comm = comm
        self.limit = limit
        if threaded is None:
            threaded = comm_.mpi().Query_thread() == comm_.mpi().THREAD_MULTIPLE
        self.threaded = threaded
        self.record = record
        self.buckets = None  # fixed by the first trace
        self.armed = False
        self._stale = []  # allreduces a step that ended early left running (`abort`)
        self._handed = []  # whether each bucket was handed over this step
        self._requests = []
        self._started = []  # perf_counter time each bucket's allreduce started
        self._ended = []
        self._arrivals = queue.Queue()
        self._idle = threading.Event()
        self._thread = None
        self._error = None
        self._flag = None  # a boolean tf.Variable: the hand-over ops run (armed)

    def hooks(self, sums):
        """Add, while a function traces, the op that hands over each bucket of `sums` (the
        stage's gradient sums, tf.Variables, None where sparse) once they hold the step's
        last micro-batch; returns their outputs."""
        import tensorflow as tf

        self._build(sums)
        if self._flag is None:  # armed or not, in the graph: unarmed calls skip Python
            with tf.init_scope():
                self._flag = tf.Variable(self.armed, trainable=False, name="hyparflow_armed")
        return [tf.cond(self._flag, lambda j=j, bucket=bucket: tf.numpy_function(
            self._hand(j), [sums[k].read_value() for k in bucket.positions], Tout=tf.bool,
            stateful=True, name=f"hyparflow_bucket_{j}"), lambda: tf.constant(False))
            for j, bucket in enumerate(self.buckets)]

    def _build(self, sums):
        """Fix the buckets of `sums` (the first time; later, check they did not change)."""
        sizes = [None if s is None else s.shape.num_elements() * s.dtype.size for s in sums]
        dtypes = [None if s is None else comm_.summable(s.dtype.as_numpy_dtype) for s in sums]
        positions = layout(sizes, dtypes, self.limit)
        if self.buckets is None:
            self.buckets = [_Bucket(p, sums) for p in positions]
            if self.armed:  # traced by the armed call itself (the first step)
                self._renew()
        elif positions != [b.positions for b in self.buckets]:
            raise RuntimeError(
                f"the stage's gradient buckets changed between traces ({positions} after "
                f"{[b.positions for b in self.buckets]}): its sparse gradients changed.")

    def _hand(self, j):
        def hand(*arrays):
            self.buckets[j].fill(arrays)
            self._handed[j] = True
            if self.threaded:
                self._arrivals.put(j)
            return True
        return hand

    def arm(self):
        """The next accumulation is the step's last: hand its buckets over."""
        self._settle()
        self._idle.clear()
        if self.threaded and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hyparflow-buckets",
                                            daemon=True)
            self._thread.start()
        if self.buckets is not None:
            self._renew()
        self.armed = True
        if self._flag is not None:
            self._flag.assign(True)

    def _renew(self):
        """Forget the last step's buckets (their values stay with whoever holds them)."""
        n = len(self.buckets)
        self._handed, self._started, self._ended = [False] * n, [None] * n, [None] * n
        self._requests = [None] * n
        for bucket in self.buckets:
            bucket.renew()

    def _start(self, j):
        self._started[j] = time.perf_counter()
        self._requests[j] = comm_.start_allreduce(self.buckets[j].buffer, self.comm, "sum")

    def _run(self):
        """The reducer thread: start each handed-over bucket in order, then test the started
        ones until the next arrives; hand the requests back at `_STOP`."""
        while True:
            item = self._arrivals.get()
            arrived, following = set(), 0
            try:
                while item is not _STOP:
                    arrived.add(item)
                    while following in arrived:
                        self._start(following)
                        following += 1
                    item = self._progress(following)
            except BaseException as exc:  # reported by `finish` on the training thread
                self._error = exc
                while item is not _STOP:
                    item = self._arrivals.get()
            self._idle.set()

    def _progress(self, started):
        """Test the started allreduces until the next bucket (or `_STOP`) arrives."""
        while True:
            try:
                return self._arrivals.get(timeout=POLL if self._pending(started) else None)
            except queue.Empty:
                pass

    def _pending(self, started):
        busy = False
        for j in range(started):
            if self._ended[j] is None:
                if self._requests[j].Test():
                    self._ended[j] = time.perf_counter()
                else:
                    busy = True
        return busy

    def abort(self):
        """After a step that ended early (an error every rank raised alike, which the caller
        may catch): the thread stopped, nothing armed. The allreduces it started are the
        same on every replica; they complete before the next step's (`arm`, `finish`)."""
        if not self.armed:
            return
        self._disarm()
        self._error = None
        self._stale += [r for j, r in enumerate(self._requests)
                        if r is not None and self._ended[j] is None]

    def _disarm(self):
        """Nothing handed over any more; the thread (if any) stopped, the requests back."""
        self.armed = False
        if self._flag is not None:
            self._flag.assign(False)
        if self.threaded:
            self._arrivals.put(_STOP)
            self._idle.wait()

    def _settle(self, wait=None):
        """Complete what an aborted step left running (long done by now)."""
        stale, self._stale = self._stale, []
        if stale:
            comm_.complete(stale, wait)

    def finish(self, sums, local, wait=None):
        """{variable position: its gradient summed over the replicas}, for every bucket.

        Buckets the step did not hand over (a replica without samples in this step
        runs no backward) are filled here from `local(position)` (this replica's sum
        as numpy, None for zeros), and every replica starts the same allreduces in the
        same order. `sums` are the stage's gradient sums (the buckets' layout if no
        function has traced yet); `wait(requests)` waits for the allreduces still
        running (a guard's watchdog).
        """
        armed = self.armed
        if armed:
            self._disarm()
            if self._error is not None:
                error, self._error = self._error, None
                raise error
        self._settle(wait)
        if self.buckets is None:
            self._build(sums)
        if not armed or not self._handed:
            self._renew()
        for j, bucket in enumerate(self.buckets):
            if not self._handed[j]:
                bucket.fill([np.zeros(n, bucket.buffer.dtype) if a is None else a
                             for a, n in zip(map(local, bucket.positions), bucket.sizes)])
                self._handed[j] = True
            if self._requests[j] is None:
                self._start(j)
        remaining = [r for j, r in enumerate(self._requests) if self._ended[j] is None]
        if remaining:
            comm_.complete(remaining, wait)
        now = time.perf_counter()
        out = {}
        for j, bucket in enumerate(self.buckets):
            self._ended[j] = self._ended[j] or now
            if self.record is not None:
                self.record("bucket", j, self._started[j], self._ended[j])
            out.update(bucket.values())
        return out
