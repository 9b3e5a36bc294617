"""`hyparflow-run`: start a job with the bundled mpiexec and sensible defaults.

Usage::

    hyparflow-run -n 4 python train.py --epochs 3
    hyparflow-run -n 4 train.py              # a .py file runs with this Python
    python -m hyparflow.run -n 4 -- python train.py

What it adds to a plain ``mpiexec -n N COMMAND``:

* each rank gets its share of its node's cores as TensorFlow threads (cores /
  ranks on the node; ``--threads`` or ``HYPARFLOW_THREADS`` overrides it);
* a Python script runs under ``python -m mpi4py`` so that an unhandled exception
  on any rank aborts the whole job instead of leaving the others waiting;
* with Open MPI: works as root, and with more ranks than cores;
* with ``--huge-pages``: TensorFlow's tensors, whatever their size, live in
  memory backed by transparent huge pages, which lets MPI move boundary tensors
  between ranks 2.5-3.6x faster here (numpy asks for huge pages itself, TensorFlow
  does not); see benchmarks/README.md, ``transfer.py``;
* signals: SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 reach every rank as
  themselves (SIGTERM and SIGHUP through `hyparflow.mpi.signals`' carriers, so that
  hf.fit can checkpoint before it stops); the launcher waits for the job and
  exits with its status. A job still running ``--grace`` seconds after SIGTERM
  or SIGHUP (or at a second signal) is stopped by mpiexec, and 5 s later
  killed; no process of the job outlives the launcher, which also takes the job
  down with it if it is killed itself;
* TensorFlow's start-up lines are left out of the job's stderr (``--tf-logs``
  keeps them; `hyparflow.quiet`);
* with ``--elastic``: a job that loses a node or a rank runs again on what is
  left, from the backup hf.fit writes (`hyparflow.restart`).
"""

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence

from hyparflow import quiet, restart
from hyparflow.engine import buckets
from hyparflow.mpi import signals, threads
from hyparflow.training import elastic

# The signals Open MPI's mpiexec forwards to the ranks by default.
OPEN_MPI_FORWARDS = ("SIGTSTP", "SIGUSR1", "SIGUSR2", "SIGABRT", "SIGALRM", "SIGCONT")
GRACE = 60.0  # seconds a job has after SIGTERM or SIGHUP before mpiexec stops it
KILL_AFTER = 5.0  # seconds from stopping the job to killing what is left of it


def find_mpiexec():
    """The mpiexec beside this Python (the Open MPI wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise SystemExit(
            "hyparflow-run: no mpiexec found. Install the bundled Open MPI with "
            "`pip install 'hyparflow[mpi]'`, or load your site's MPI module."
        )
    return found


def _version(mpiexec):
    try:
        return subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def is_open_mpi(mpiexec):
    out = _version(mpiexec)
    return "Open MPI" in out or "OpenRTE" in out or "prte" in out.lower()


def has_ulfm(mpiexec):
    """Whether `mpiexec` is Open MPI 5 or later, whose ``--with-ft ulfm`` lets a job's ranks
    outlive one that dies (User-Level Failure Mitigation: the bundled one is built with it)."""
    found = re.search(r"\(Open MPI\) (\d+)\.", _version(mpiexec))
    return found is not None and int(found.group(1)) >= 5


def _is_python(word):
    name = os.path.basename(word)
    return name.startswith("python") or word == sys.executable


def rank_command(command):
    """The command each rank runs: Python scripts go through `python -m mpi4py`."""
    if command[0].endswith(".py"):
        command = [sys.executable] + command
    if _is_python(command[0]) and len(command) > 1 and command[1].endswith(".py"):
        command = [command[0], "-m", "mpi4py"] + command[1:]
    return command


# glibc tunables behind --huge-pages, read by glibc when each rank starts. TensorFlow
# takes its CPU tensors from malloc one by one; by default malloc maps each one of
# 128 KiB and more on its own (too small for a 2 MiB page) and serves each thread
# from an arena of its own. Here every allocation below 32 MiB comes from the one
# main heap, and glibc asks the kernel to back what it maps with huge pages.
HUGE_PAGES = ("glibc.malloc.hugetlb=1", "glibc.malloc.mmap_threshold=33554432",
              "glibc.malloc.arena_max=1")


def build(n: int, command: Sequence[str], threads_per_rank: int | None = None,
          mpiexec: str | None = None, extra: Iterable[str] = (), huge_pages: bool = False,
          tf_logs: bool = False, forward: dict[str, str] | None = None,
          fault_tolerant: bool = False) -> tuple[list[str], dict[str, str]]:
    """The full mpiexec command line and environment for `n` ranks.

    The launcher leaves TensorFlow's start-up lines out of the job's stderr
    unless `tf_logs`; either way the ranks are told not to filter again. `forward`:
    more variables every rank gets (an elastic job's folder and backup interval).
    `fault_tolerant`: the ranks outlive one that dies, where the MPI can (`has_ulfm`: an
    elastic job goes on in place).

    Returns:
        (argv, env)
    """
    mpiexec = mpiexec or find_mpiexec()
    env = dict(os.environ)
    # Without --threads each rank takes cores / ranks on its node (threads.share(), from the
    # launcher's local size): right on one node and across nodes alike. What importing
    # hyparflow set here (this process's whole share) is not the ranks'.
    for name in threads.set_here():
        env.pop(name, None)
    if threads_per_rank is not None:  # asked for explicitly: wins over TensorFlow's own too
        env["TF_NUM_INTRAOP_THREADS"] = env["TF_NUM_INTEROP_THREADS"] = str(threads_per_rank)
        env[threads.ENV] = str(threads_per_rank)
    told = quiet.KEEP_ENV if tf_logs else quiet.FILTERED_ENV
    env[told] = "1"
    env.update(forward or {})
    if huge_pages:  # read by glibc when each rank starts: it must be in the environment
        tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
        ours = list(HUGE_PAGES)
        if "glibc.malloc.hugetlb=2" in tunables:  # reserved huge pages asked for: keep them
            ours = [t for t in ours if not t.startswith("glibc.malloc.hugetlb=")]
        names = {t.split("=")[0] for t in ours}
        env["GLIBC_TUNABLES"] = ":".join(
            [t for t in tunables if t.split("=")[0] not in names] + ours)
    argv = [mpiexec, "-n", str(n)]
    if is_open_mpi(mpiexec):
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        carried = signals.carriers()
        env[signals.ENV] = signals.encode(carried)
        # the list replaces Open MPI's own: keep its defaults in it
        forwarded = ",".join(list(OPEN_MPI_FORWARDS) + [str(c) for c in carried.values()])
        argv += ["--oversubscribe", "--forward-signals", forwarded,
                 "-x", signals.ENV, "-x", told]
        if fault_tolerant and has_ulfm(mpiexec):
            argv += ["--with-ft", "ulfm"]
        for name in (threads.ENV, "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS",
                     "GLIBC_TUNABLES", buckets.ENV, *(forward or {})):
            if name in env:
                argv += ["-x", name]
    argv += list(extra)
    return argv + rank_command(list(command)), env


def _session(sid):
    """Pids of the processes in session `sid` (mpiexec's, and the ranks it started here)."""
    pids = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


# Open MPI's mpiexec (PRRTE 3) ends the job when it loses a node's daemon, and then exits 0
# at times: the launcher reads its notice in the job's stderr and exits 1, naming the node.
_LOST = re.compile(rb"PRTE has lost communication with a remote daemon|"
                   rb"A daemon failed to report back")
_LOST_NODE = re.compile(rb"(?:Remote daemon: .* on node|Remote host:)\s+(\S+)")
# ... a rank that ended the job (its banner names the error code a few lines further)
_ABORTED = re.compile(rb"MPI_ABORT was invoked on rank \d+")
_ABORT_CODE = re.compile(rb"^\s*Errorcode: (\d+)")
# ... and a rank that died by a signal (killed, out of memory), its notice cut where it likes
_KILLED = re.compile(rb"noticed that process rank (\d+) with PID \d+ on node (\S+) exited on\s+"
                     rb"signal (\d+)")


class Notices:
    """Reads the job's stderr for mpiexec's notices of a loss: a node's daemon lost (`lost`,
    `node`), or a rank killed by a signal (`killed`: (world rank, node, signal)); and of a rank
    that ended the job with MPI_ABORT (`aborted`: its error code)."""

    def __init__(self):
        self.lost, self.node, self.killed, self.aborted = False, None, None, None
        self._tail = self._previous = b""

    def scan(self, data):
        lines = (self._tail + data).split(b"\n")
        self._tail = lines.pop()[-4096:]
        for line in lines:
            if _LOST.search(line):
                self.lost = True
            elif self.lost and self.node is None and (found := _LOST_NODE.search(line)):
                self.node = found.group(1).decode(errors="replace")
            if _ABORTED.search(line) and self.aborted is None:
                self.aborted = 1  # (until its error code comes)
            elif self.aborted == 1 and (found := _ABORT_CODE.search(line)):
                self.aborted = int(found.group(1)) or 1
            two = self._previous + b" " + line
            if self.killed is None and (found := _KILLED.search(two)):
                self.killed = (int(found.group(1)), found.group(2).decode(errors="replace"),
                               int(found.group(3)))
            self._previous = line[-4096:]

    @property
    def mid_line(self):
        """Whether the stream read so far ends inside a line (no newline after its last bytes:
        a killed process's last words)."""
        return bool(self._tail)

    def merge(self, other):
        """Take what `other` (reading another stream of the job) saw and this did not."""
        self.lost = self.lost or other.lost
        self.node = self.node or other.node
        self.killed = self.killed or other.killed
        self.aborted = self.aborted if self.aborted is not None else other.aborted


def _copy(source, target, drop, notices):
    """Copy a stream of the job (a pipe) to `target` as it comes, leaving out TensorFlow's
    start-up lines if `drop`; `notices` reads it on the way."""
    out = getattr(target, "buffer", target)

    def write(data):
        notices.scan(data)
        out.write(data)
        out.flush()

    quiet.copy(lambda n: os.read(source.fileno(), n), write, drop=drop)


class Supervisor:
    """Runs mpiexec and passes the launcher's signals on to the job; `wait` returns its status.

    mpiexec starts in a session of its own, so a terminal's Ctrl-C reaches the
    launcher alone, which passes it on once: every signal takes one path. A
    signal is handled between two polls of mpiexec (never inside the handler).

    Args:
        argv, env: the mpiexec command and environment (`build`).
        carried: {signal: carrier} to send mpiexec in place of SIGTERM/SIGHUP
            (Open MPI), or {} to send them as they are.
        grace: seconds the job has after SIGTERM or SIGHUP to end by itself.
    """

    def __init__(self, argv, env, carried, grace=GRACE, quiet=True, read_stdout=False):
        """`quiet`: drop TensorFlow's start-up lines (`quiet.NOISE`) from the job's stderr;
        `read_stdout`: read mpiexec's notices in the job's stdout too (some come there: an
        elastic job's launcher needs them all)."""
        self.carried, self.grace = carried, grace
        self.pending = []
        self.stop_at = self.kill_at = None
        self.interrupted = False  # Ctrl-C: the job ends with 130, as shells expect
        self.previous = {s: signal.signal(s, lambda s, f: self.pending.append(s))
                         for s in signals.PASSED_ON}
        try:
            self.proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                         preexec_fn=lambda: signals.die_with_parent(
                                             signal.SIGTERM),
                                         stderr=subprocess.PIPE,
                                         stdout=subprocess.PIPE if read_stdout else None)
        except BaseException:
            self.restore()
            raise
        self.notices = Notices()
        self.copiers = [threading.Thread(target=_copy, daemon=True, args=(
            self.proc.stderr, sys.stderr, quiet, self.notices))]
        if read_stdout:
            self.stdout_notices = Notices()
            self.copiers.append(threading.Thread(target=_copy, daemon=True, args=(
                self.proc.stdout, sys.stdout, False, self.stdout_notices)))
        for copier in self.copiers:
            copier.start()

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _say(self, text):
        sys.stderr.write(f"hyparflow-run: {text}\n")
        sys.stderr.flush()

    def _handle(self, s, now):
        name = signal.Signals(s).name
        if self.stop_at is not None and s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._say(f"{name} again: stopping the job now.")
            self._stop(now)
            return
        if s == signal.SIGINT:  # Ctrl-C: mpiexec ends the job itself
            self._say("interrupted (SIGINT): stopping the job.")
            self.interrupted = True
            self._stop(now, s)
        elif s in (signal.SIGTERM, signal.SIGHUP):
            self._say(f"{name}: passed on to every rank; the job has {self.grace:.0f} s to end "
                      "(hf.fit checkpoints and stops), then it is stopped.")
            self.proc.send_signal(self.carried.get(s, s))
            self.stop_at = now + self.grace
        else:  # SIGUSR1, SIGUSR2: mpiexec forwards them to every rank
            self.proc.send_signal(s)

    def _stop(self, now, s=signal.SIGTERM):
        self.proc.send_signal(s)  # mpiexec ends the job
        self.stop_at = now
        self.kill_at = now + KILL_AFTER

    def _kill(self):
        for pid in _session(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def wait(self):
        """Wait for the job; returns its exit status (128 + N for a job killed by signal N)."""
        try:
            while True:
                try:
                    code = self.proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.monotonic()
                while self.pending:
                    self._handle(self.pending.pop(0), now)
                if self.kill_at is not None and now > self.kill_at:
                    self._say("the job did not end: killing it.")
                    self._kill()
                    self.kill_at = float("inf")
                elif self.stop_at is not None and self.kill_at is None and now > self.stop_at:
                    self._say(f"the job did not end within {self.grace:.0f} s: stopping it.")
                    self._stop(now)
            for copier in self.copiers:  # the job's last words
                copier.join(timeout=KILL_AFTER)
            if self.notices.mid_line:  # the launcher's lines below start on lines of their own
                sys.stderr.write("\n")
                sys.stderr.flush()
            if len(self.copiers) > 1:
                self.notices.merge(self.stdout_notices)
            if code == 0 and self.notices.lost:
                self._say(f"the job lost node {self.notices.node or '(not named)'}: every "
                          "process there stopped answering, and mpiexec ended the job (its "
                          "exit status 0 notwithstanding). Exit code 1.")
                code = 1
            # Ranks mpiexec left behind (it was killed) go within KILL_AFTER seconds.
            deadline = time.monotonic() + KILL_AFTER
            while _session(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._kill()
        finally:
            self.restore()
        if self.interrupted and code != 0:  # (mpiexec's own status says 1)
            return 128 + signal.SIGINT
        return 128 - code if code < 0 else code

    @property
    def stopped(self):
        """Whether the launcher was told to stop the job (a signal to it)."""
        return self.stop_at is not None or self.interrupted


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hyparflow-run",
        description="Run COMMAND on N MPI ranks with the bundled mpiexec.",
        allow_abbrev=False,  # (the program's options are the program's: never matched here)
    )
    parser.add_argument("-n", "--np", type=int, required=True, dest="n",
                        help="number of ranks (partitions × replicas)")
    parser.add_argument("--threads", type=int, default=None,
                        help="TensorFlow threads per rank (default: cores / N, at least 1)")
    parser.add_argument("--mpiexec", default=None, help="mpiexec to use (default: bundled)")
    parser.add_argument("--mpiexec-args", default="", metavar="ARGS",
                        help="more options for mpiexec, in one quoted string (e.g. "
                             "\"--hostfile hosts --map-by ppr:4:node\" for several nodes)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="keep TensorFlow's tensors in transparent huge pages (glibc "
                             "tunables: one malloc arena, huge pages for what it maps): "
                             "faster transfers of boundary tensors")
    parser.add_argument("--grace", type=float, default=GRACE,
                        help="seconds the job has to end by itself after SIGTERM or SIGHUP "
                             f"(hf.fit checkpoints and stops) before it is stopped "
                             f"(default: {GRACE:.0f})")
    parser.add_argument("--tf-logs", action="store_true",
                        default=quiet.keep(),
                        help="keep TensorFlow's start-up lines (absl, oneDNN, CPU "
                             f"instructions) in the ranks' output (or {quiet.KEEP_ENV}=1)")
    parser.add_argument("--elastic", action="store_true",
                        help="when the job loses a node or a rank, run it again on what is "
                             "left, resuming from the backup hf.fit writes (see "
                             "--elastic-dir, --backup-every, --restarts)")
    parser.add_argument("--elastic-dir", default="hyparflow-elastic", metavar="DIR",
                        help="folder of an elastic job's backups, on a file system every node "
                             "sees (default: ./hyparflow-elastic); emptied when the job ends "
                             "well")
    parser.add_argument("--backup-every", type=float, default=elastic.DEFAULT_SECONDS,
                        metavar="SECONDS",
                        help="seconds between two backups of an elastic job, at a step "
                             f"boundary (default: {elastic.DEFAULT_SECONDS:.0f})")
    parser.add_argument("--restarts", type=int, default=restart.RESTARTS,
                        help="times an elastic job runs again after a loss (default: "
                             f"{restart.RESTARTS})")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the mpiexec command and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program each rank runs, e.g. `python train.py`")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command each rank runs, e.g. `hyparflow-run -n 4 python train.py`")
    if args.n < 1:
        parser.error(f"-n {args.n}: the number of ranks must be at least 1")
    try:
        extra = shlex.split(args.mpiexec_args)
    except ValueError as e:
        parser.error(f"--mpiexec-args {args.mpiexec_args!r}: {e}")
    if args.restarts < 0:
        parser.error(f"--restarts {args.restarts}: the number of restarts must be at least 0")
    if not args.backup_every >= 0:
        parser.error(f"--backup-every {args.backup_every:g}: use a number of seconds ≥ 0")
    forward = None
    if args.elastic:
        folder = os.path.abspath(args.elastic_dir)
        forward = {elastic.ENV: folder, elastic.SECONDS_ENV: f"{args.backup_every:g}"}

    def launch(n, extra):
        return build(n, command, args.threads, args.mpiexec, extra=extra,
                     huge_pages=args.huge_pages, tf_logs=args.tf_logs, forward=forward,
                     fault_tolerant=args.elastic)

    full, env = launch(args.n, extra)
    if args.dry_run:
        tunables = env.get("GLIBC_TUNABLES")  # --huge-pages: it must travel with the command
        prefix = [f"GLIBC_TUNABLES={tunables}"] if tunables != os.environ.get("GLIBC_TUNABLES") \
            else []
        print(" ".join(prefix + full))
        return 0
    carried = signals.carriers() if env.get(signals.ENV) else {}
    if not args.elastic:
        return Supervisor(full, env, carried, grace=args.grace, quiet=not args.tf_logs).wait()

    def attempt(n, extra):
        full, env = launch(n, extra)
        job = Supervisor(full, env, carried, grace=args.grace, quiet=not args.tf_logs,
                         read_stdout=True)
        code = job.wait()
        if code == 0 and job.notices.aborted is not None:
            # (fault tolerant, Open MPI 5.0 exits 0 when the last rank left calls MPI_ABORT)
            code = job.notices.aborted
        return code, job.notices, job.stopped

    os.makedirs(folder, exist_ok=True)
    return restart.supervise(args.n, extra, attempt, folder, args.restarts,
                             lambda text: sys.stderr.write(f"hyparflow-run: {text}\n"))


if __name__ == "__main__":
    sys.exit(main())
