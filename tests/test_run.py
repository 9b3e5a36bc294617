"""The launcher's command line: bundled mpiexec, root, oversubscription, threads, abort on error."""

import os
import sys

from hyparflow import run


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
    assert "--oversubscribe" in argv and argv[argv.index("-x") + 1] == "HYPARFLOW_THREADS"
    if os.geteuid() == 0:
        assert "--allow-run-as-root" in argv
    assert env["HYPARFLOW_THREADS"] == "1"  # 2 cores / 4 ranks, at least 1
    argv, env = run.build(1, ["python", "t.py"], mpiexec=run.find_mpiexec())
    assert env["HYPARFLOW_THREADS"] == "2"
    argv, env = run.build(2, ["python", "t.py"], threads_per_rank=3, mpiexec=run.find_mpiexec())
    assert env["HYPARFLOW_THREADS"] == env["TF_NUM_INTRAOP_THREADS"] == "3"
    assert "TF_NUM_INTRAOP_THREADS" in argv


def test_bundled_mpiexec_is_found_in_the_virtual_environment():
    assert run.find_mpiexec() == os.path.join(os.path.dirname(sys.executable), "mpiexec")


def test_dry_run_prints_the_command(capsys):
    assert run.main(["-n", "2", "--dry-run", "--", "python", "t.py"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(run.find_mpiexec() + " -n 2 ")
    assert line.endswith("python -m mpi4py t.py")


def test_huge_pages_reach_every_rank_through_glibc_tunables(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    argv, env = run.build(2, ["python", "t.py"], mpiexec=run.find_mpiexec(), huge_pages=True)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert "GLIBC_TUNABLES" in argv
    monkeypatch.delenv("GLIBC_TUNABLES")
    argv, env = run.build(2, ["python", "t.py"], mpiexec=run.find_mpiexec())
    assert "GLIBC_TUNABLES" not in env
