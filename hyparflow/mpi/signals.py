"""Signals through the launcher:
SIGTERM and SIGHUP carried past mpiexec, and turned back in each rank.

Open MPI's mpiexec forwards SIGUSR1 and SIGUSR2 to every rank, but on SIGTERM
or SIGHUP it kills the job at once (and it cannot forward them): a rank gets no
chance to checkpoint. So `hyparflow-run` sends mpiexec a real-time signal of its
own for each (the carrier, forwarded with ``--forward-signals``) and tells the
ranks which carrier stands for which signal in ``$HYPARFLOW_SIGNALS``;
``import hyparflow`` then installs, in each rank, a handler that raises the
original signal in the process. The rank sees SIGTERM (or SIGHUP) as if it had
been sent to it directly, with whatever handler it has: hf.fit's checkpoints
and stops, a plain script's default ends it. A program that does not import
hyparflow dies of the carrier's default action, which also ends the job.
"""

import os
import signal

ENV = "HYPARFLOW_SIGNALS"  # "36:15,37:1": carrier number → the signal it stands for

# The signals hyparflow-run passes on to the job, and those it must carry.
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
CARRIED = (signal.SIGTERM, signal.SIGHUP)


def carriers():
    """{signal: its carrier}: real-time signals mpiexec forwards untouched."""
    base = int(signal.SIGRTMIN) + 2  # glibc keeps the first two for itself
    return {s: base + i for i, s in enumerate(CARRIED)}


def encode(mapping):
    """{signal: carrier} → the value of $HYPARFLOW_SIGNALS."""
    return ",".join(f"{int(c)}:{int(s)}" for s, c in mapping.items())


def decode(value):
    """The value of $HYPARFLOW_SIGNALS → {carrier: signal}; ValueError names what is wrong."""
    mapping = {}
    for item in filter(None, (value or "").split(",")):
        carrier, _, original = item.partition(":")
        if not (carrier.isdigit() and original.isdigit()):
            raise ValueError(f"{ENV}={value!r}: expected carrier:signal numbers, e.g. 36:15")
        mapping[int(carrier)] = int(original)
    return mapping


def die_with_parent(sig):
    """Receive `sig` when the parent process dies, even of SIGKILL (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def install_carriers(environ=None):
    """In a rank started by hyparflow-run: make each carrier raise the signal it stands for.

    Does nothing outside the main thread or without $HYPARFLOW_SIGNALS. Returns
    the {carrier: signal} mapping installed.
    """
    import threading

    environ = os.environ if environ is None else environ
    mapping = decode(environ.get(ENV, ""))
    if not mapping or threading.current_thread() is not threading.main_thread():
        return {}

    def turn_back(carrier, frame):
        signal.raise_signal(mapping[carrier])

    for carrier in mapping:
        signal.signal(carrier, turn_back)
    # a rank whose mpiexec (or Open MPI daemon) is gone, killed with the launcher, goes too
    die_with_parent(signal.SIGKILL)
    return mapping
