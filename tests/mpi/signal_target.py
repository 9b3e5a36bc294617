"""Run under hyparflow-run: a rank that reports the signals it gets (no TensorFlow: it starts fast).

    signal_target.py MARK [--ignore-term]
        prints "UP <rank>", then waits up to 120 s; on SIGTERM, SIGHUP, SIGUSR1 or
        SIGUSR2 it prints "GOT <name> <rank>" and exits with 100 + the signal's number
        (with --ignore-term it only prints on SIGTERM and SIGHUP, and goes on).
        MARK only tags the processes, so that a test can find what is left of them.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# turns the launcher's carriers back into SIGTERM/SIGHUP
import hyparflow  # noqa: F401  # isort: skip
from mpi4py import MPI

RANK = MPI.COMM_WORLD.Get_rank()
IGNORE_TERM = "--ignore-term" in sys.argv


def report(signum, frame):
    print(f"GOT {signal.Signals(signum).name} {RANK}", flush=True)
    if not (IGNORE_TERM and signum in (signal.SIGTERM, signal.SIGHUP)):
        os._exit(100 + signum)


for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, report)
print(f"UP {RANK}", flush=True)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.05)
