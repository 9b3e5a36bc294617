"""Multi-rank tier: hyparflow-run passes signals on to every rank, exits with the job's status, and leaves no process behind."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from mpi.launch import HERE, LAUNCHER


def _left(mark):
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


class Job:
    """`hyparflow-run -n 2 python signal_target.py MARK`, read line by line as it runs."""

    def __init__(self, *launcher_args, script_args=()):
        self.mark = f"mark-{uuid.uuid4().hex}"
        command = [LAUNCHER, "-n", "2", *launcher_args, sys.executable,
                   os.path.join(HERE, "signal_target.py"), self.mark, *script_args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.lines = []
        self.queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

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
                                     f"ended: {self.lines}")
            self.lines.append(line)

    def finish(self, timeout=60):
        """Wait for the launcher: (exit code, stdout lines, stderr, seconds it took)."""
        start = time.monotonic()
        try:
            err = self.proc.stderr.read() if self.proc.wait(timeout=timeout) is not None else ""
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the launcher did not end within {timeout} s: {self.lines}")
        seconds = time.monotonic() - start
        while (line := self.queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return self.proc.returncode, self.lines, err, seconds

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in _left(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"])
def test_each_signal_reaches_every_rank_as_itself_and_the_launcher_exits_with_the_job(name):
    job = Job()
    job.read_until("UP 0", "UP 1")
    job.proc.send_signal(getattr(signal, name))
    code, lines, err, seconds = job.finish()
    number = int(getattr(signal, name))
    assert f"GOT {name} 0" in lines or f"GOT {name} 1" in lines, (lines, err)
    assert code == 100 + number, (code, lines, err)  # the job's status
    assert seconds < 5, seconds
    time.sleep(0.2)
    assert not _left(job.mark), "a process of the job outlived the launcher"
    assert "Traceback" not in err


def test_ctrl_c_stops_the_job_with_one_line():
    job = Job()
    job.read_until("UP 0", "UP 1")
    job.proc.send_signal(signal.SIGINT)
    code, lines, err, seconds = job.finish()
    assert code != 0 and seconds < 5, (code, seconds)
    assert "hyparflow-run: interrupted (SIGINT): stopping the job." in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    time.sleep(0.2)
    assert not _left(job.mark)


def test_a_job_that_ignores_sigterm_is_stopped_after_the_grace_time():
    job = Job("--grace", "2", script_args=["--ignore-term"])
    job.read_until("UP 0", "UP 1")
    job.proc.send_signal(signal.SIGTERM)
    job.read_until("GOT SIGTERM 0", "GOT SIGTERM 1")  # each rank had its chance
    code, lines, err, seconds = job.finish()
    assert code != 0 and seconds < 2 + 5, (code, seconds, err)
    assert "the job did not end within 2 s: stopping it." in err, err
    time.sleep(0.2)
    assert not _left(job.mark)


def test_the_job_does_not_outlive_a_launcher_killed_outright():
    job = Job()
    job.read_until("UP 0", "UP 1")
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait()
    deadline = time.monotonic() + 5
    while _left(job.mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _left(job.mark), "the job outlived its launcher by more than 5 s"
