"""`hyparflow-run`: start a job with the bundled mpiexec and sensible defaults.

Usage::

    hyparflow-run -n 4 python train.py --epochs 3
    hyparflow-run -n 4 train.py              # a .py file runs with this Python
    python -m hyparflow.run -n 4 -- python train.py

What it adds to a plain ``mpiexec -n N COMMAND``:

* each rank gets its share of this machine's cores as TensorFlow threads
  (``HYPARFLOW_THREADS``, overridable with ``--threads`` or by setting it);
* a Python script runs under ``python -m mpi4py`` so that an unhandled exception
  on any rank aborts the whole job instead of leaving the others waiting;
* with Open MPI: works as root, and with more ranks than cores;
* with ``--huge-pages``: TensorFlow's tensors, whatever their size, live in
  memory backed by transparent huge pages, which lets MPI move boundary tensors
  between ranks 2.5-3.6x faster here (numpy asks for huge pages itself, TensorFlow
  does not); see benchmarks/README.md, ``transfer.py``.
"""

import argparse
import os
import shutil
import subprocess
import sys

from hyparflow import threads


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


def is_open_mpi(mpiexec):
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out or "OpenRTE" in out or "prte" in out.lower()


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


def build(n, command, threads_per_rank=None, mpiexec=None, extra=(), huge_pages=False):
    """The full mpiexec command line and environment for `n` ranks.

    Returns:
        (argv, env)
    """
    mpiexec = mpiexec or find_mpiexec()
    env = dict(os.environ)
    if threads_per_rank is None:
        threads_per_rank = int(env.get(threads.ENV) or max(1, threads.cores() // n))
    else:  # asked for explicitly: wins over TensorFlow's own variables too
        env["TF_NUM_INTRAOP_THREADS"] = env["TF_NUM_INTEROP_THREADS"] = str(threads_per_rank)
    env[threads.ENV] = str(threads_per_rank)
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
        argv += ["--oversubscribe", "-x", threads.ENV]
        for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "GLIBC_TUNABLES"):
            if name in env:
                argv += ["-x", name]
    argv += list(extra)
    return argv + rank_command(list(command)), env


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="hyparflow-run",
        description="Run COMMAND on N MPI ranks with the bundled mpiexec.",
    )
    parser.add_argument("-n", "--np", type=int, required=True, dest="n",
                        help="number of ranks (partitions × replicas)")
    parser.add_argument("--threads", type=int, default=None,
                        help="TensorFlow threads per rank (default: cores / N, at least 1)")
    parser.add_argument("--mpiexec", default=None, help="mpiexec to use (default: bundled)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="keep TensorFlow's tensors in transparent huge pages (glibc "
                             "tunables: one malloc arena, huge pages for what it maps): "
                             "faster transfers of boundary tensors")
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
    full, env = build(args.n, command, args.threads, args.mpiexec, huge_pages=args.huge_pages)
    if args.dry_run:
        tunables = env.get("GLIBC_TUNABLES")  # --huge-pages: it must travel with the command
        prefix = [f"GLIBC_TUNABLES={tunables}"] if tunables != os.environ.get("GLIBC_TUNABLES") \
            else []
        print(" ".join(prefix + full))
        return 0
    return subprocess.call(full, env=env)


if __name__ == "__main__":
    sys.exit(main())
