"""Never hang: MPI waits bounded by a watchdog, and a failure on one rank stops every rank."""

import os
import re
import sys
import time
import traceback

DEFAULT_TIMEOUT = 600.0  # seconds a single wait may last (hf.fit(timeout=...))
FIRST_STEP_FACTOR = 3  # the first step also waits for every stage to trace and compile
GRACE = 3.0  # seconds the failing rank gives the others to print before it aborts
NOTICE_TAG = 7  # on the guard's own communicator, so it never meets a training message
RAISED_TAG = 8  # "the user's code raised here" / "not here", on the same communicator
LEFT_TAG = 9  # on MPI.COMM_WORLD: "this rank is leaving its script" (comm.leaving, at exit)
_NOTICE_POLL = 0.05  # seconds between looks for a failure notice while waiting


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def wait_all(requests):
    """Wait for a list of requests: MPI's, or another transport's with mpi4py's request
    interface (`Test`, `Wait` and the class methods `Testall`, `Waitall`)."""
    if requests:
        _each_error(type(requests[0]).Waitall, requests)


def test_all(requests):
    """Whether every request of the list has completed (see `wait_all`)."""
    return not requests or _each_error(type(requests[0]).Testall, requests)


_STATUSES = {}  # number of requests → statuses MPI fills where one of them fails


def _each_error(call, requests):
    """`call(requests)`, an error of one of MPI's requests raised as its own (MPI says only
    "error code in status" of the list: a lost process, a message too long, ...)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not isinstance(requests[0], MPI.Request):
        return call(requests)
    statuses = _STATUSES.get(len(requests))
    if statuses is None:
        statuses = _STATUSES[len(requests)] = [MPI.Status() for _ in requests]
    try:
        return call(requests, statuses)
    except MPI.Exception as exc:
        if exc.Get_error_class() != MPI.ERR_IN_STATUS:
            raise
        errors = [s.Get_error() for s in statuses  # (ERR_PENDING: a request not yet done)
                  if s.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING)]
        if not errors:
            raise
        raise MPI.Exception(errors[0]) from exc


# Called with the exception when a rank ends on a loss (`hyparflow.training.elastic` tells the
# launcher what it knows of it)
LOSS_HOOKS = []


def told_loss(exc):
    """Run the `LOSS_HOOKS` for `exc` (a rank ending on a loss); their own failures are
    printed, not raised: the rank is ending anyway."""
    for hook in LOSS_HOOKS:
        try:
            hook(exc)
        except Exception:
            traceback.print_exc()


# The error classes of a ULFM MPI (`mpiexec --with-ft ulfm`) that say a process of the job
# failed: in an operation with it, in a receive from any rank while one is unacknowledged, or
# on a communicator another survivor revoked to interrupt every wait on it.
_LOSS_NAMES = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")


class RanksLost(RuntimeError):
    """A process of the job failed (a ULFM MPI told it): training cannot go on as it was."""


def lost_ranks(exc):
    """Whether `exc` (or what it was raised from: a TensorFlow op that sent messages wraps
    it) is a ULFM MPI's word that a process of the job failed — or another MPI error while
    this rank knows of a process failed that the job has not gone on without (a collective's
    request whose status Open MPI fills with no error class, MPI_ERR_UNKNOWN, when a process
    of it died: seen in a synchronized BatchNormalization's sums)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        return False
    classes = {getattr(MPI, name) for name in _LOSS_NAMES if hasattr(MPI, name)}
    names = tuple(f"MPI_{name}:" for name in _LOSS_NAMES)
    seen, mpi_error = set(), False
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RanksLost):
            return True
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in classes:
            return True
        if any(name in str(exc) for name in names):  # (TensorFlow's copy of its message)
            return True
        mpi_error = mpi_error or isinstance(exc, MPI.Exception) or "MPI_ERR_" in str(exc)
        exc = exc.__cause__ or exc.__context__
    return mpi_error and bool(_newly_failed())


# MPI_COMM_WORLD ranks the job is without (kept by `comm.shrink` and `comm.keep_first`): here,
# not in comm, so that reading MPI's failed group needs no import of comm
LOST = set()  # known to have failed: the job went on without them
LEFT = set()  # left the job after a loss (no stage for them)


def world_ranks(group):
    """The MPI_COMM_WORLD ranks of `group`'s processes, in its order (`group` freed)."""
    from mpi4py import MPI

    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                          MPI.COMM_WORLD.Get_group())
    finally:
        group.Free()
    return [int(r) for r in ranks if r != MPI.UNDEFINED]


def _newly_failed():
    """The MPI_COMM_WORLD ranks this rank knows to have failed, less those the job went on
    without or that left it (none where MPI tells no failures: not ULFM)."""
    MPI = sys.modules.get("mpi4py.MPI")
    try:
        failed = world_ranks(MPI.COMM_WORLD.Get_failed())
    except Exception:
        return []
    return sorted(set(failed) - LOST - LEFT)


class PeerFailed(RuntimeError):
    """Another rank failed and told this one; it stops too."""


class WatchdogTimeout(RuntimeError):
    """A wait lasted longer than the timeout."""


# First lines of an error that say only where it happened; the cause is further down.
_WRAPPERS = ("Graph execution error:", "in user code:")
_CAUSE_CHARS = 400


def cause(exc):
    """The line of `exc`'s message that names the problem, for the other ranks' one-line notice.

    TensorFlow's graph errors start with "Graph execution error:" and Keras'
    traced ones with "in user code:", followed by where it ran; the problem
    (``Received a label value of 3 which is outside the valid range of [0, 3)``,
    ``ValueError: Arguments `target` and `output` must have the same rank``)
    is the last line but the node reference. An error raised inside a function that
    another calls (the step graph) starts with the function's node, dropped here.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return ""
    line = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", lines[0])
    if line in _WRAPPERS:
        told = [ln for ln in lines[1:] if not ln.startswith("[[")]
        line = told[-1] if told else line
    return line if len(line) <= _CAUSE_CHARS else line[:_CAUSE_CHARS - 1] + "…"


def _summary(exc):
    """`exc` in one line for the other ranks: its type and `cause`."""
    return f"{type(exc).__name__}: {cause(exc)}"


class PeerLeft(RuntimeError):
    """Another rank finished its script while this one waits for it in a collective."""


def check_left(world, where, what):
    """Raise `PeerLeft` if a rank said, as its script ended, that it is leaving (`comm.leaving`)."""
    from mpi4py import MPI

    status = MPI.Status()
    try:
        probed = MPI.COMM_WORLD.Iprobe(source=MPI.ANY_SOURCE, tag=LEFT_TAG, status=status)
    except MPI.Exception:  # (ULFM: a process failed since the last acknowledgement)
        if _newly_failed():  # one the job has not gone on without: a loss
            raise
        MPI.COMM_WORLD.Ack_failed()  # (a rank that left the job ended: receives go on)
        return
    if not probed:
        return
    MPI.COMM_WORLD.recv(source=status.Get_source(), tag=LEFT_TAG)
    rank = status.Get_source()
    if world is not None and world != MPI.COMM_WORLD:  # hyparflow's numbers (placement)
        rank = MPI.Group.Translate_ranks(MPI.COMM_WORLD.Get_group(), [rank],
                                         world.Get_group())[0]
    raise PeerLeft(
        f"hyparflow: rank {rank} finished its script (it is exiting) while {where} waits for "
        f"{what}. Every rank must make the same hyparflow calls (hf.fit, hf.evaluate, "
        "hf.predict, hf.save) in the same order: call them on every rank, and hyparflow "
        "writes or prints from one.")


class Guard:
    """Bounded waits and job-wide failure handling for one rank of an hf.fit job.

    Every wait of the training loop goes through `wait`, which polls its MPI
    requests until they complete, the watchdog's deadline passes (it raises
    `WatchdogTimeout` describing what was awaited), or another rank's failure
    notice arrives (it raises `PeerFailed`). `fail` turns any exception on this
    rank into the end of the job: it prints the traceback once, prefixed with
    this rank's place, tells every other rank, and aborts.

    An exception the user's code raises alike on every rank (a callback that
    interrupts training at the same step everywhere, as callbacks see the same
    logs) is not a failure: `agree_raise` finds that every rank raised at the
    same point, and hf.fit lets it reach the caller on every rank, the job
    healthy. A rank that hears, while it waits, that another raised where it did
    not, ends the job as for any failure.

    Args:
        world: the job's communicator (None or size 1: waits are plain and
            `fail` re-raises).
        where: "rank r (replica q, stage s)", printed with every report.
        timeout: seconds a single wait may last, None for no watchdog.
    """

    def __init__(self, world, where, timeout=DEFAULT_TIMEOUT, notices=True):
        """`notices=False`: no notice communicator (its creation is a collective): a guard for
        the first collective of a call, which must not hang when some rank never comes."""
        self.world = world if world is not None and world.Get_size() > 1 else None
        self.where = where
        self.timeout = timeout
        self.first_step = notices
        self.context = None  # a callable returning extra lines for a timeout report
        # Notices travel on a duplicate of the world, so they never match a training message.
        # (never waited on, only probed: a loss needs it not revoked, `comm.shrink`)
        self.notices = self.world.Dup() if self.world is not None and notices else None
        self._raised = {}  # rank → (where, point, summary, when heard) of a peer's raise
        self._refused = False  # a peer answered "not here" to this rank's raise

    def bounded(self, what):
        """A `wait(request)` for a collective outside a step (no schedule to show)."""
        def wait(request):
            self.context = None
            self.wait(request, what)
        return wait

    def wait(self, requests, what, peer=None):
        """Wait for MPI `requests` (one or a list); `what` says what they carry.

        Raises:
            WatchdogTimeout: not complete within the timeout.
            PeerFailed: another rank failed meanwhile.
        """
        requests = requests if isinstance(requests, list) else [requests]
        if self.world is None:
            wait_all(requests)
            return
        limit = None if self.timeout is None else (
            self.timeout * (FIRST_STEP_FACTOR if self.first_step else 1))
        start = time.monotonic()
        next_look = start + _NOTICE_POLL
        spins = 0
        while not test_all(requests):
            spins += 1
            if spins < 200:
                continue  # a message usually arrives within microseconds: spin first
            _yield()
            now = time.monotonic()
            if now < next_look:
                continue
            next_look = now + _NOTICE_POLL
            self.check_notices()
            check_left(self.world, self.where, what)
            self._check_raised(now)
            if limit is not None and now - start > limit:
                raise WatchdogTimeout(self._timeout_report(what, peer, now - start, limit))

    def check_notices(self):
        """Raise `PeerFailed` if another rank has reported a failure; keep what raises the
        others reported (`agree_raise`)."""
        if self.notices is None:
            return
        from mpi4py import MPI

        status = MPI.Status()
        if self.notices.Iprobe(source=MPI.ANY_SOURCE, tag=NOTICE_TAG, status=status):
            where, summary = self.notices.recv(source=status.Get_source(), tag=NOTICE_TAG)
            raise PeerFailed(f"{where} failed: {summary}")
        while self.notices.Iprobe(source=MPI.ANY_SOURCE, tag=RAISED_TAG, status=status):
            source = status.Get_source()
            message = self.notices.recv(source=source, tag=RAISED_TAG)
            if message[0] == "raised":
                self._raised[source] = message[1:] + (time.monotonic(),)
            else:  # "not here": a peer did not raise where this rank did (agree_raise)
                self._refused = True

    def _check_raised(self, now):
        """While this rank waits: a peer that raised GRACE seconds ago, where this rank did
        not (the wait both were in would have completed by now), ends the job."""
        if not self._raised:
            return
        where, point, summary, heard = min(self._raised.values(), key=lambda v: v[3])
        if now - heard < GRACE:
            return
        for r in self._raised:
            self.notices.send(("not here", self.where), dest=r, tag=RAISED_TAG)
        raise PeerFailed(f"{where} failed: {summary}")  # in `point`, where this rank did not

    def agree_raise(self, exc, point):
        """The user's code raised `exc` at `point` (a callback hook and its step or epoch):
        returns if every rank raised there (then `agreed(exc)`), else raises what ends the job.

        Each rank that raised tells every other, then waits to hear the same from
        all of them. A rank that did not raise answers "not here" (`_check_raised`):
        then `exc` itself is raised again, for `fail` to end the job with its
        traceback.

        Raises:
            `exc` (a peer did not raise), RuntimeError (peers raised at another
            point), PeerFailed, WatchdogTimeout.
        """
        if self.world is None:
            self.mark_agreed(exc)
            return
        summary = _summary(exc)
        me = self.world.Get_rank()
        for r in range(self.world.Get_size()):
            if r != me:
                self.notices.send(("raised", self.where, point, summary), dest=r, tag=RAISED_TAG)
        start = time.monotonic()
        while len(self._raised) < self.world.Get_size() - 1:
            self.check_notices()
            check_left(self.world, self.where, f"every rank's word on its {summary}")
            if self._refused:
                self._raised, self._refused = {}, False
                raise exc
            if self.timeout is not None and time.monotonic() - start > self.timeout:
                raise WatchdogTimeout(
                    f"hyparflow watchdog: {self.where} raised {summary} in {_point(point)} "
                    f"and waited {self.timeout:.0f} s to hear whether every rank raised there; "
                    f"ranks {sorted(self._raised)} did.")
            time.sleep(0.001)
        heard, self._raised = self._raised, {}
        elsewhere = {r: p for r, (_, p, _, _) in heard.items() if p != point}
        if elsewhere:
            raise RuntimeError(
                f"{type(exc).__name__} raised by the user's code in {_point(point)} on "
                f"{self.where}, but elsewhere on other ranks: "
                + "; ".join(f"rank {r} in {_point(p)}" for r, p in sorted(elsewhere.items()))
                + ". Code that interrupts training must raise at the same step on every rank.")
        self.mark_agreed(exc)

    @staticmethod
    def mark_agreed(exc):
        """Mark `exc` as raised alike on every rank (a collective's outcome, or `agree_raise`)."""
        exc._hyparflow_agreed = True
        return exc

    @staticmethod
    def agreed(exc):
        """Whether every rank raised `exc` alike (`agree_raise`): the job is healthy."""
        return getattr(exc, "_hyparflow_agreed", False)

    def _timeout_report(self, what, peer, waited, limit):
        lines = [f"hyparflow watchdog: {self.where} waited {waited:.0f} s (limit {limit:.0f} s"
                 f"{', first step' if self.first_step else ''}) for {what}"
                 + (f" from {peer}" if peer else "") + ", and it did not come."]
        if self.context is not None:
            lines += self.context()
        lines.append(
            "Likely causes: the peer is stuck or much slower (a step longer than the timeout: "
            "raise hf.fit(timeout=...)), or ranks run different code or data (every rank must "
            "call hf.fit with the same model, arguments and number of samples).")
        return "\n".join(lines)

    def fail(self, exc):
        """End the job because of `exc` on this rank. Never returns on a multi-rank job."""
        if self.world is None:
            raise exc
        if lost_ranks(exc):  # a process failed (ULFM): no notice reaches every rank
            if not isinstance(exc, RanksLost):
                _print(f"hyparflow: {self.where}: a rank of the job failed ({cause(exc)}); the "
                       "job ends.")
            elif getattr(exc, "speaks", True):  # (the survivors' first, for all of them)
                _print(str(exc))
            told_loss(exc)
            if getattr(exc, "agreed", False):
                # every survivor agreed on the loss and ends here: each exits (under ULFM,
                # MPI_Abort once all of a node's ranks are gone was seen to hang mpiexec)
                sys.stdout.flush()
                os._exit(1)
            abort(1)
        try:
            if isinstance(exc, PeerFailed):
                _print(f"hyparflow: {exc} — {self.where} stops too.")
            else:
                if isinstance(exc, (WatchdogTimeout, PeerLeft)):  # the report says it all
                    text = str(exc)
                else:
                    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                _print("".join(f"[{self.where}] {line}\n" for line in text.rstrip().split("\n")))
                summary = _summary(exc)
                if isinstance(exc, WatchdogTimeout):
                    summary = "its watchdog timed out (see its report)"
                if isinstance(exc, PeerLeft):
                    summary = "a rank left its script (see its report)"
                for r in range(self.world.Get_size()) if self.notices is not None else ():
                    if r != self.world.Get_rank():
                        self.notices.isend((self.where, summary), dest=r, tag=NOTICE_TAG)
                deadline = time.monotonic() + GRACE
                while time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            # A rank that only heard of a failure leaves the abort to the failing rank,
            # unless that rank is gone: then it aborts after the grace period itself.
            if isinstance(exc, PeerFailed):
                time.sleep(2 * GRACE)
            abort(1)


def _point(point):
    """("on_epoch_end", 2) → "on_epoch_end(2)"."""
    name, *args = point
    return f"{name}({', '.join(str(a) for a in args)})"


_job = None


def bounded(comm, what, timeout=DEFAULT_TIMEOUT):
    """A `wait(request)` for a collective over `comm` outside a call's guard (before it
    exists, or in hf.plan), bounded by a watchdog of its own without a notice communicator
    (making one is a collective); `what` says what it waits for."""
    rank = comm.Get_rank() if comm is not None else 0
    return Guard(comm, f"rank {rank}", timeout, notices=False).bounded(what)


def for_job(world, where=None, timeout=DEFAULT_TIMEOUT):
    """This process's `Guard` (created on first use: collective over `world`).

    Later calls update where it reports from and its timeout when given.
    """
    global _job
    if _job is None:
        _job = Guard(world, where or "rank 0", timeout)
    elif where is not None:
        _job.where, _job.timeout = where, timeout
    return _job


def forget_job():
    """Forget this process's `Guard` (its world lost ranks): the next `for_job` makes one anew."""
    global _job
    _job = None


def for_job_made():
    """Whether this process's `Guard` exists (`for_job` was called)."""
    return _job is not None


def _print(text):
    sys.stderr.write(text if text.endswith("\n") else text + "\n")
    sys.stderr.flush()


def abort(code=1):
    """Abort the whole MPI job with `code`."""
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)
