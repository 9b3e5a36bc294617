"""Launch a script on N ranks with hyparflow-run, bounded by a timeout that kills the job."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "hyparflow-run")


def launch(n, script, *args, timeout=240, plain=False, env=None, launcher=()):
    """Run `script` (a file in tests/mpi) on `n` ranks; returns (returncode, stdout, stderr,
    seconds).

    The whole process group is killed when `timeout` expires, and the test fails
    with what the job printed so far: a hang can never stall the suite. With
    `plain`, the bundled mpiexec runs `python script` itself, as a user's own
    `mpirun -n N python script.py` would (no `-m mpi4py`). `env`: more environment variables;
    `launcher`: more options of hyparflow-run.
    A launch Open MPI could not start at all (`NOT_STARTED`: no rank ran) is made again, at
    most twice.
    """
    env = dict(os.environ, HYPARFLOW_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1",
               **(env or {}))
    if plain:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        command = [mpiexec, "-n", str(n), "--oversubscribe", "-x", "HYPARFLOW_THREADS"]
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
        command += [sys.executable, os.path.join(HERE, script)]
    else:
        command = [LAUNCHER, "-n", str(n), *map(str, launcher), sys.executable,
                   os.path.join(HERE, script)]
    command += [str(a) for a in args]
    for _ in range(3):
        start = time.monotonic()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(command)} did not finish within {timeout} s\n"
                                 f"--- stdout ---\n{out}\n--- stderr ---\n{err[-5000:]}")
        if proc.returncode == 0 or NOT_STARTED not in out + err:
            break
        # Open MPI's launcher itself could not start, and no rank ran: launched again
    return proc.returncode, out, err, time.monotonic() - start


# What the bundled Open MPI prints when its launcher fails before starting any rank (seen in
# one fresh-clone `make test`, 2026-11-26, on a busy machine); nothing of the test has run.
NOT_STARTED = "The PMIx server's listener thread failed to start"


def left(mark):
    """Pids of processes whose command line holds `mark` (what is left of a job)."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if mark.encode() in f.read():
                    pids.append(int(name))
        except (OSError, ValueError):
            pass
    return pids


class Streaming:
    """`hyparflow-run -n N python SCRIPT ARGS…` (a file in tests/mpi), its output read line
    by line as it runs, so that a test can act in the middle of a job (send a signal); every
    wait is bounded and a test that fails kills the job."""

    def __init__(self, n, script, *args, launcher_args=()):
        env = dict(os.environ, HYPARFLOW_THREADS="1", PYTHONUNBUFFERED="1")
        command = [LAUNCHER, "-n", str(n), *launcher_args, sys.executable,
                   os.path.join(HERE, script), *[str(a) for a in args]]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True, env=env)
        self.lines, self.errors = [], []
        self.queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.errors.extend(self.proc.stderr),
                         daemon=True).start()
        self.mark = getattr(self, "mark", os.path.join(HERE, script))

    def _read(self):
        for line in self.proc.stdout:
            self.queue.put(line.strip())
        self.queue.put(None)

    def read_until(self, *wanted, timeout=60):
        """Read stdout until every line in `wanted` has appeared."""
        deadline = time.monotonic() + timeout
        while not all(w in self.lines for w in wanted):
            try:
                line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if not line:
                self.kill()
                raise AssertionError(f"no {wanted} within {timeout} s or before the job "
                                     f"ended: {self.lines}\n{''.join(self.errors)[-3000:]}")
            self.lines.append(line)

    def finish(self, timeout=60):
        """Wait for the launcher: (exit code, stdout lines, stderr, seconds it took)."""
        start = time.monotonic()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the launcher did not end within {timeout} s: {self.lines}")
        seconds = time.monotonic() - start
        while (line := self.queue.get(timeout=10)) is not None:
            self.lines.append(line)
        time.sleep(0.1)  # the stderr reader's last lines
        return self.proc.returncode, self.lines, "".join(self.errors), seconds

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in left(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
