"""The launcher's command line: bundled mpiexec, root, oversubscription, threads, abort on error."""

import os
import re
import subprocess
import sys

import pytest

from hyparflow import quiet, run


def test_python_scripts_run_under_mpi4py_so_an_exception_aborts_the_job():
    assert run.rank_command(["python", "train.py", "--x", "1"]) == [
        "python", "-m", "mpi4py", "train.py", "--x", "1"]
    assert run.rank_command(["train.py"]) == [sys.executable, "-m", "mpi4py", "train.py"]
    assert run.rank_command(["./a.out", "b.py"]) == ["./a.out", "b.py"]


def test_open_mpi_command_line_and_thread_share(monkeypatch):
    monkeypatch.delenv("HYPARFLOW_THREADS", raising=False)
    monkeypatch.setattr(run.threads, "cores", lambda: 2)
    argv, env = run.build(4, ["python", "t.py"], mpiexec=run.find_mpiexec())
    assert argv[:3] == [run.find_mpiexec(), "-n", "4"]
    assert "--oversubscribe" in argv
    if os.geteuid() == 0:
        assert "--allow-run-as-root" in argv
    # each rank takes its node's share: 2 cores / 4 ranks on the node, at least 1; 2 nodes of
    # 2 ranks each (a host file): 1 each too, where 2 cores / 4 ranks in the job would say 0
    assert "HYPARFLOW_THREADS" not in env and "HYPARFLOW_THREADS" not in argv
    for local_size, share in (("4", 1), ("1", 2), ("2", 1)):
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", local_size)
        assert run.threads.share() == share
    monkeypatch.setenv("HYPARFLOW_THREADS", "2")  # set by the user: every node gets it
    argv, env = run.build(4, ["python", "t.py"], mpiexec=run.find_mpiexec())
    assert argv[argv.index("HYPARFLOW_THREADS") - 1] == "-x"
    argv, env = run.build(2, ["python", "t.py"], threads_per_rank=3, mpiexec=run.find_mpiexec())
    assert env["HYPARFLOW_THREADS"] == env["TF_NUM_INTRAOP_THREADS"] == "3"
    assert "TF_NUM_INTRAOP_THREADS" in argv


def test_bundled_mpiexec_is_found_in_the_virtual_environment():
    assert run.find_mpiexec() == os.path.join(os.path.dirname(sys.executable), "mpiexec")


def test_mpiexec_args_reach_mpiexec_before_the_rank_command(capsys):
    assert run.main(["-n", "4", "--mpiexec-args", "--hostfile 'my hosts' --map-by ppr:2:node",
                     "--dry-run", "--", "python", "t.py"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith(" --hostfile my hosts --map-by ppr:2:node python -m mpi4py t.py"), line
    with pytest.raises(SystemExit):  # one clear usage error, naming the value
        run.main(["-n", "2", "--mpiexec-args", "--hostfile 'h", "--", "python", "t.py"])
    assert "--mpiexec-args \"--hostfile 'h\": No closing quotation" in capsys.readouterr().err


def test_a_node_lost_is_read_from_mpiexec_notices_however_they_are_cut():
    # PRRTE ends the job with one of these and, after the first, may exit 0
    lost = (b"-----\nPRTE has lost communication with a remote daemon.\n\n  HNP daemon   : "
            b"[prterun-a-1@0,0] on node a\n  Remote daemon: [prterun-a-1@0,1] on node b7\n\n"
            b"This is usually due to either a failure of the TCP network\n")
    spawned = (b"A daemon failed to report back after being spawned. This could\n"
               b"  Local host:    a\n  Remote host:   b8\n")
    for text, node in ((lost, "b7"), (spawned, "b8")):
        for cut in (1, 7, len(text)):
            watch = run.Notices()
            for i in range(0, len(text), cut):
                watch.scan(text[i:i + cut])
            assert (watch.lost, watch.node) == (True, node)
    watch = run.Notices()
    watch.scan(b"Remote host: b9\nTraceback (most recent call last):\n")
    assert not watch.lost and watch.node is None


def test_dry_run_prints_the_command(capsys):
    assert run.main(["-n", "2", "--dry-run", "--", "python", "t.py"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(run.find_mpiexec() + " -n 2 ")
    assert line.endswith("python -m mpi4py t.py")
    # what --huge-pages sets travels with the printed command
    assert run.main(["-n", "2", "--huge-pages", "--dry-run", "--", "python", "t.py"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("GLIBC_TUNABLES=") and "glibc.malloc.hugetlb=1" in line.split()[0]


@pytest.mark.parametrize("program", [["--m", "1"], ["--mpi", "x"], ["-n", "5", "--threads", "3"],
                                     ["--dry-run"], ["--", "--grace", "2"]])
def test_everything_after_the_program_belongs_to_the_program(capsys, program):
    # `--m 1` exited 2 ("ambiguous option: --m could match --mpiexec, --mpiexec-args"):
    # the launcher read its own options, abbreviated, among the program's
    command = ["python", "t.py", *program]
    assert run.main(["-n", "2", "--dry-run", *command]) == 0
    assert capsys.readouterr().out.strip().endswith(" ".join(["python -m mpi4py t.py",
                                                               *program]))


def test_the_launchers_own_options_are_never_abbreviated(capsys):
    with pytest.raises(SystemExit) as e:
        run.main(["-n", "2", "--thr", "1", "--dry-run", "python", "t.py"])
    assert e.value.code == 2 and "--thr" in capsys.readouterr().err


def test_huge_pages_reach_every_rank_through_glibc_tunables(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    argv, env = run.build(2, ["python", "t.py"], mpiexec=run.find_mpiexec(), huge_pages=True)
    assert env["GLIBC_TUNABLES"] == ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432"
                                     ":glibc.malloc.arena_max=1")
    assert "GLIBC_TUNABLES" in argv
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=2048")
    argv, env = run.build(2, ["python", "t.py"], mpiexec=run.find_mpiexec(), huge_pages=True)
    assert env["GLIBC_TUNABLES"].startswith("glibc.rtld.optional_static_tls=2048:glibc.malloc.")
    for given in ("", "::", "glibc.malloc.arena_max=4::"):  # nothing empty, nothing twice
        monkeypatch.setenv("GLIBC_TUNABLES", given)
        _, env = run.build(2, ["python", "t.py"], mpiexec=run.find_mpiexec(), huge_pages=True)
        assert env["GLIBC_TUNABLES"] == ":".join(run.HUGE_PAGES)
    # huge pages reserved by the administrator (hugetlb=2) are kept
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=2")
    _, env = run.build(2, ["python", "t.py"], mpiexec=run.find_mpiexec(), huge_pages=True)
    assert env["GLIBC_TUNABLES"] == ("glibc.malloc.hugetlb=2:glibc.malloc.mmap_threshold=33554432"
                                     ":glibc.malloc.arena_max=1")
    monkeypatch.delenv("GLIBC_TUNABLES")
    argv, env = run.build(2, ["python", "t.py"], mpiexec=run.find_mpiexec())
    assert "GLIBC_TUNABLES" not in env


# Where TensorFlow puts boundary-tensor-sized tensors (512 KiB outputs of an op, as a stage's
# outputs are): for each, whether the memory mapping holding it has at least that much in
# huge pages (AnonHugePages in /proc/self/smaps, in kB).
_HUGE_PAGE_PROBE = """
import hyparflow, numpy as np, tensorflow as tf
from hyparflow.engine.stage import to_numpy
rng = np.random.default_rng(0)
tensors = [tf.nn.relu(tf.constant(rng.random((8, 32, 32, 16), dtype=np.float32) - 0.5))
           for _ in range(4)]
huge = []
for t in tensors:
    address = to_numpy(t).ctypes.data
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif head == "AnonHugePages:" and inside:
                huge.append(int(line.split()[1]) * 1024 >= t.numpy().nbytes)
print(huge)
"""


def _transparent_huge_pages():
    """This kernel's THP mode ("always", "madvise", "never") or None, and glibc's version."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        mode = None
    try:
        glibc = tuple(int(v) for v in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split("."))
    except (ValueError, OSError, IndexError, AttributeError):
        glibc = None
    return mode, glibc


def test_huge_pages_put_boundary_tensors_in_huge_pages():
    """--huge-pages is for the tensors MPI sends: look where TensorFlow puts them, with and without.

    (With glibc's huge pages alone, glibc.malloc.hugetlb=1, three of four such tensors got
    mappings of their own, too small for a huge page.)
    """
    mode, glibc = _transparent_huge_pages()
    if mode not in ("always", "madvise") or glibc is None or glibc < (2, 35):
        pytest.skip(f"needs transparent huge pages (kernel: {mode}) and glibc >= 2.35 "
                    f"(here: {glibc}), which --huge-pages relies on")
    seen = {}
    for huge in (False, True):
        _, env = run.build(1, ["python", "t.py"], mpiexec=run.find_mpiexec(), huge_pages=huge)
        if not huge:
            env.pop("GLIBC_TUNABLES", None)
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        out = subprocess.run([sys.executable, "-c", _HUGE_PAGE_PROBE], env=env, timeout=120,
                             capture_output=True, text=True, check=True).stdout
        seen[huge] = out.strip().splitlines()[-1]
    assert seen[True] == "[True, True, True, True]", seen
    if mode == "madvise":  # under "always" the kernel may give huge pages without being asked
        assert seen[False] != seen[True], seen


_TF_START = "import hyparflow, tensorflow as tf; tf.constant(1.0) + 1; print('RAN')"


def test_each_rank_of_the_launcher_takes_its_share_of_the_cores_not_the_launchers():
    # The launcher imports hyparflow too, which gives its own process every core: that must
    # not reach the ranks (2 ranks here: cores / 2 each, as a plain mpiexec gives them).
    launcher = os.path.join(os.path.dirname(sys.executable), "hyparflow-run")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HYPARFLOW_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")}
    probe = ("import os, hyparflow; print('THREADS', os.environ['TF_NUM_INTRAOP_THREADS'], "
             "os.environ['TF_NUM_INTEROP_THREADS'])")
    done = subprocess.run([launcher, "-n", "2", sys.executable, "-c", probe], env=env,
                          timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    share = str(max(1, run.threads.cores() // 2))
    assert sorted(re.findall(r"^THREADS (\d+) (\d+)$", done.stdout, re.M)) == [
        (share, share)] * 2, done.stdout


def test_tensorflow_start_up_lines_are_left_out_unless_asked_for():
    # two or three lines per rank that look like errors (absl's notice, oneDNN's banner), under
    # hyparflow-run (the launcher filters) and under a plain mpiexec (each rank filters)
    launcher = os.path.join(os.path.dirname(sys.executable), "hyparflow-run")
    mpiexec = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "1",
               *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
    env = dict(os.environ)
    env.pop(quiet.KEEP_ENV, None)
    seen = {}
    for how in ("launcher", "plain"):
        for keep in (False, True):
            if how == "launcher":
                command = [launcher, "-n", "1", *(["--tf-logs"] if keep else [])]
                env.pop(quiet.KEEP_ENV, None)
            else:
                command = mpiexec
                env[quiet.KEEP_ENV] = "1" if keep else "0"
            done = subprocess.run([*command, sys.executable, "-c", _TF_START], env=env,
                                  timeout=120, capture_output=True, text=True)
            assert done.returncode == 0 and "RAN" in done.stdout, done.stderr
            seen[how, keep] = done.stderr
    for how in ("launcher", "plain"):
        assert "oneDNN custom operations are on" in seen[how, True], seen[how, True]
        assert "absl::InitializeLog" not in seen[how, False], seen[how, False]
        assert "oneDNN" not in seen[how, False], seen[how, False]
    # the filter leaves every other line alone
    for line in ("E0000 00:00:1.2  7 other.cc:1] a real error", "Traceback (most recent call "
                 "last):", "hyparflow: rank 1 failed"):
        assert not quiet.NOISE.match(line.encode()), line


_BANNER = (b"I0000 00:00:1795606766.616503   10232 port.cc:153] oneDNN custom operations are "
           b"on. You may see slightly different numerical results.\n")


def _filtered(chunks):
    """What `quiet.copy` writes for `chunks`, as a list of writes, each after the chunk read."""
    chunks, writes = list(chunks), []
    quiet.copy(lambda n: chunks.pop(0) if chunks else b"", writes.append)
    return writes


def test_the_filter_passes_unfinished_lines_at_once_and_holds_only_what_may_be_noise():
    # a progress bar on stderr (no newline) is written as it comes, not when its line ends
    assert _filtered([b"epoch 1 ", b"50%\r", b"100%\n"]) == [b"epoch 1 ", b"50%\r", b"100%\n"]
    # a banner split over reads is held until it is known, then dropped
    assert _filtered([_BANNER[:5], _BANNER[5:30], _BANNER[30:] + b"real\n"]) == [b"real\n"]
    # a line that starts like one and is not: written whole once its end shows it
    assert _filtered([b"E0000 00:00:", b"1.2  7 other.cc:1] a real error\n"]) == [
        b"E0000 00:00:1.2  7 other.cc:1] a real error\n"]
    # the last words of a process that ended mid-line are not lost
    assert _filtered([b"Traceback", b" (most"]) == [b"Traceback", b" (most"]
    assert _filtered([b"E0000 00:00:1.2 boom"]) == [b"E0000 00:00:1.2 boom"]
    assert _filtered([b"ok\n" + _BANNER + b"WARNING: All log messages before "
                      b"absl::InitializeLog() is called are written to STDERR\nok\n"]) == [
        b"ok\nok\n"]


def test_the_filter_leaves_out_open_mpis_report_of_each_collective_a_lost_rank_ended():
    # (ULFM: the survivors of an elastic job go on without it, and say so once themselves)
    nbc = (b"NBC_Progress: an error 75 was found during schedule 0x5592eb3c7080 at row-offset "
           b"106 - aborting the schedule\n")
    assert b"".join(_filtered([b"step\n" + nbc[:20], nbc[20:] + b"\n", b"\nnext\n"])) == \
        b"step\n\nnext\n"  # the empty line after it goes with it; the next is the job's
    assert b"".join(_filtered([b"NBC_Progress: our own words\n"])) == \
        b"NBC_Progress: our own words\n"
