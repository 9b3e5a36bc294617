"""Multi-rank tier: hyparflow-run passes signals on to every rank, exits with the job's status,
and leaves no process behind."""

import signal
import time
import uuid

import pytest

from mpi.launch import Streaming
from mpi.launch import left as _left


class Job(Streaming):
    """`hyparflow-run -n 2 python signal_target.py MARK`, read line by line as it runs."""

    def __init__(self, *launcher_args, script_args=()):
        self.mark = f"mark-{uuid.uuid4().hex}"
        super().__init__(2, "signal_target.py", self.mark, *script_args,
                         launcher_args=launcher_args)


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
    assert code == 130 and seconds < 5, (code, seconds)  # as shells expect (it was 1)
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
