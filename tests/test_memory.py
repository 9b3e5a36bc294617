"""A rank's share of its node's memory, read from a /proc and /sys laid out in a folder."""

import os

import pytest

from hyparflow.mpi import memory

GIB = 2**30


def _machine(root, cgroup, files, available_kib=16 * 2**20, resident_pages=1000):
    os.makedirs(root / "proc/self")
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/meminfo").write_text(f"MemTotal: 33554432 kB\nMemAvailable: {available_kib} kB\n")
    (root / "proc/self/statm").write_text(f"5000 {resident_pages} 300 1 0 2000 0\n")
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return str(root)


def test_the_tightest_cgroup_limit_on_the_way_to_the_root_is_shared_by_the_nodes_ranks(tmp_path):
    root = _machine(tmp_path, "0::/slurm/job7/step0\n", {
        "sys/fs/cgroup/slurm/job7/memory.max": str(8 * GIB),  # the job's
        "sys/fs/cgroup/slurm/job7/step0/memory.max": "max",
        "sys/fs/cgroup/slurm/memory.max": str(64 * GIB)})
    assert memory.cgroup_limit(root) == 8 * GIB
    assert memory.per_rank(4, {}, root) == (2 * GIB, "the job's memory limit (cgroup) shared "
                                                     "by 4 rank(s)")


def test_cgroup_v1_and_no_limit_leave_the_nodes_memory_and_what_its_ranks_hold(tmp_path):
    root = _machine(tmp_path, "4:memory:/user/1\n1:cpu:/\n", {
        "sys/fs/cgroup/memory/user/1/memory.limit_in_bytes": "9223372036854771712",  # none
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"})
    assert memory.cgroup_limit(root) is None
    held = 1000 * os.sysconf("SC_PAGE_SIZE")
    budget = memory.per_rank(2, {}, root)
    assert budget == ((16 * GIB + 2 * held) // 2, "the node's memory shared by 2 rank(s)")


def test_the_variable_sets_it_and_a_bad_value_is_refused_naming_it(tmp_path):
    root = _machine(tmp_path, "0::/\n", {"sys/fs/cgroup/memory.max": str(GIB)})
    assert memory.per_rank(8, {"HYPARFLOW_MEMORY_PER_RANK": "3.5"}, root) == (
        int(3.5 * GIB), "$HYPARFLOW_MEMORY_PER_RANK")
    for bad in ("0", "-2", "lots", "inf", "nan"):
        with pytest.raises(ValueError, match=rf"HYPARFLOW_MEMORY_PER_RANK='{bad}': give the "
                                             r"memory one rank may use in GiB"):
            memory.per_rank(8, {"HYPARFLOW_MEMORY_PER_RANK": bad}, root)
    assert memory.per_rank(2, {}, str(tmp_path / "nowhere")).bytes is None
