"""Leaves TensorFlow's start-up lines out of a job's stderr, in the launcher or in each rank.

TensorFlow prints two or three lines per rank that look like errors and are
not: absl's notice that logging has not started, the oneDNN and CPU-instruction
banners (C++ logging before absl starts: no environment variable silences
them), oneDNN's fallback for bool tensors, Grappler declining a graph. Under
`hyparflow-run` the launcher copies the job's stderr without them; under a plain
`mpirun python train.py`, `import hyparflow` (before TensorFlow) hands the
rank's stderr to a small filter process (`install`). The filter passes every
other byte on at once, even a line not yet finished (a progress bar), unless it
may still become one of those lines; it lives until the last writer of the
stream is gone, so nothing a dying rank wrote is lost.

Run as a script (`python -I -S quiet.py`), it is that filter: standard input to
standard error. It imports nothing of hyparflow, so it starts in milliseconds.
"""

import os
import re
import signal
import sys

NOISE = re.compile(
    rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    rb"STDERR"
    rb"|[IWE]0000 00:00:\S+ +\d+ (port\.cc:\d+\] oneDNN custom operations are on"
    rb"|cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized"
    rb"|util\.cc:\d+\] oneDNN supports DT_BOOL only"
    rb"|tfg_optimizer_hook\.cc:\d+\] tfg_optimizer)"
    rb"|To enable the following instructions: .* rebuild TensorFlow with the appropriate "
    rb"compiler flags\."
    rb"|\twhen importing GraphDef to MLIR module in GrapplerHook"
    # Open MPI's collectives report each one a lost process ended (ULFM: `hyparflow-run
    # --elastic` goes on without it, and says so), then an empty line
    rb"|NBC_Progress: an error \d+ was found during schedule \S+ at row-offset \d+ - aborting "
    rb"the schedule)")
_AFTER = b"aborting the schedule"  # (NOISE whose next line, if empty, is left out too)
# Every line NOISE matches starts with one of these: an unfinished line that
# cannot is passed on without waiting for its end.
_STARTS = (b"WARNING: All log messages before absl", b"I0000 00:00:", b"W0000 00:00:",
           b"E0000 00:00:", b"To enable the following instructions:",
           b"\twhen importing GraphDef", b"NBC_Progress: an error")
_LONGEST = 4096  # an unfinished line held longer than this is passed on: it is no banner
KEEP_ENV = "HYPARFLOW_TF_LOGS"  # set (not "0"): keep the lines
FILTERED_ENV = "HYPARFLOW_STDERR_FILTERED"  # set by hyparflow-run, which filters itself
_IGNORED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGQUIT")


def keep():
    """Whether the user asked to see TensorFlow's start-up lines."""
    return os.environ.get(KEEP_ENV, "") not in ("", "0")


def _may_be_noise(start):
    return any(s.startswith(start) or start.startswith(s) for s in _STARTS)


def copy(read, write, drop=True):
    """Copy `read(n)` to `write(data)` until `read` returns b"", leaving out the NOISE lines
    (all of it, as it comes, unless `drop`)."""
    if not drop:
        for chunk in iter(lambda: read(65536), b""):
            write(chunk)
        return
    held = b""  # the start of a line that may still become noise
    passing = False  # inside a line already (partly) passed on
    empty_too = False  # the line left out asks for the next, if empty, to go too
    while True:
        chunk = read(65536)
        if not chunk:
            break
        out = []
        for piece in chunk.splitlines(keepends=True):
            if passing:
                out.append(piece)
                passing = not piece.endswith((b"\n", b"\r"))
                continue
            line, held = held + piece, b""
            if line.endswith((b"\n", b"\r")):
                if empty_too and not line.strip():
                    empty_too = False
                elif not NOISE.match(line):
                    out.append(line)
                    empty_too = False
                else:
                    empty_too = line.rstrip().endswith(_AFTER)
            elif _may_be_noise(line) and len(line) <= _LONGEST:
                held = line
            else:
                out.append(line)
                passing = True
        if out:
            write(b"".join(out))
    if held and not NOISE.match(held):
        write(held)


def install():
    """Route this rank's stderr through the filter, unless the lines are wanted or filtered."""
    if keep() or os.environ.get(FILTERED_ENV) or not hasattr(os, "posix_spawn"):
        return
    read, write = os.pipe()
    try:
        os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", os.path.abspath(__file__)],
                       os.environ, setsid=True,
                       file_actions=[(os.POSIX_SPAWN_DUP2, read, 0),
                                     (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)])
    except (OSError, NotImplementedError):  # no filter: the lines stay
        os.close(write)
        return
    finally:
        os.close(read)
    sys.stderr.flush()
    os.dup2(write, 2)
    os.close(write)


def _write_all(data):
    view = memoryview(data)
    while view:
        view = view[os.write(2, view):]


def main():
    """The filter process: standard input to standard error, until the last writer is gone."""
    for name in _IGNORED:  # it ends with its input, so that a dying rank's last words get out
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    try:
        copy(lambda n: os.read(0, n), _write_all)
    except OSError:  # standard error closed: nothing left to do
        pass


if __name__ == "__main__":
    main()
