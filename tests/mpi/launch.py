"""Launch a script on N ranks with hyparflow-run, bounded by a timeout that kills the job."""

import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "hyparflow-run")


def launch(n, script, *args, timeout=240, plain=False):
    """Run `script` (a file in tests/mpi) on `n` ranks; returns (returncode, stdout, stderr, seconds).

    The whole process group is killed when `timeout` expires, and the test fails
    with what the job printed so far: a hang can never stall the suite. With
    `plain`, the bundled mpiexec runs `python script` itself, as a user's own
    `mpirun -n N python script.py` would (no `-m mpi4py`).
    """
    env = dict(os.environ, HYPARFLOW_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    if plain:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        command = [mpiexec, "-n", str(n), "--oversubscribe", "-x", "HYPARFLOW_THREADS"]
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
        command += [sys.executable, os.path.join(HERE, script)]
    else:
        command = [LAUNCHER, "-n", str(n), sys.executable, os.path.join(HERE, script)]
    command += [str(a) for a in args]
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(command)} did not finish within {timeout} s\n"
                             f"--- stdout ---\n{out}\n--- stderr ---\n{err[-5000:]}")
    return proc.returncode, out, err, time.monotonic() - start
