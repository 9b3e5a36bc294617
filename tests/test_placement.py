"""Placement without MPI: the node-grouped rank order, the report, one GPU per rank."""

import pytest

from hyparflow.mpi import placement


@pytest.mark.parametrize("nodes, order", [
    (["a", "a", "b", "b"], [0, 1, 2, 3]),          # by slot: kept
    (["a", "b", "a", "b"], [0, 2, 1, 3]),          # round-robin over two nodes
    (["a", "b", "c", "a", "b", "c"], [0, 3, 1, 4, 2, 5]),
    (["b", "a", "a", "b"], [0, 3, 1, 2]),          # nodes in the order of their first rank
])
def test_node_order_makes_each_nodes_ranks_consecutive(nodes, order):
    assert placement.node_order(nodes) == order


def test_report_one_line_per_node_and_pipelines_within_a_node():
    entries = [{"node": n, "world_rank": w, "gpu": g} for n, w, g in
               [("a", 0, 0), ("a", 2, 1), ("a", 4, 2), ("b", 1, 0), ("b", 3, 1), ("b", 5, 2)]]
    lines = placement.report(entries, partitions=2, replicas=3)
    assert lines == [
        "node a: world ranks 0, 2, 4 → replica 0 stages 0-1; replica 1 stage 0 (GPU 0-2)",
        "node b: world ranks 1, 3, 5 → replica 1 stage 1; replica 2 stages 0-1 (GPU 0-2)",
        "2 nodes, 6 ranks; 2 of 3 pipelines within one node"]


def test_pin_gpu_by_local_rank(tmp_path, monkeypatch):
    driver = tmp_path / "gpus"
    driver.mkdir()
    for bus in ("0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0"):
        (driver / bus).mkdir()
    for name in placement._LOCAL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "5")
    env = {}
    assert placement.pin_gpu(env, str(driver)) == "1"
    assert env == {"CUDA_VISIBLE_DEVICES": "1"}
    # one device, or none, chosen by the user or Slurm: left as it is
    for value in ("", "3"):
        env = {"CUDA_VISIBLE_DEVICES": value}
        assert placement.pin_gpu(env, str(driver)) is None
        assert env == {"CUDA_VISIBLE_DEVICES": value}
    # every GPU of the node listed (Slurm's --gpus-per-node): one of them per rank
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert placement.pin_gpu(env, str(driver)) == "1" and env == {"CUDA_VISIBLE_DEVICES": "1"}
    env = {"CUDA_VISIBLE_DEVICES": "4, 6"}
    assert placement.pin_gpu(env, str(driver)) == "6"
    # no GPUs, or no local rank: nothing
    assert placement.pin_gpu({}, str(tmp_path / "none")) is None
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK")
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert placement.local_rank() == 2
    monkeypatch.delenv("SLURM_LOCALID")
    env = {}
    assert placement.pin_gpu(env, str(driver)) is None and env == {}


def test_ranks_per_node_is_the_fullest_node():
    assert placement.ranks_per_node(["a", "b", "a", "b", "a"]) == 3
    assert placement.ranks_per_node([]) is None


@pytest.mark.parametrize("environ, on", [
    # Open MPI, ranks on two nodes: its TCP progress thread moves a pipeline's messages
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, True),
    # one node: shared memory, nothing to ask for
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, False),
    # the user's own choice stands
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
      "OMPI_MCA_btl_tcp_progress_thread": "0"}, False),
    # another MPI: not Open MPI's parameter
    ({"PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"}, False),
])
def test_open_mpi_progresses_tcp_messages_when_the_job_spans_nodes(environ, on):
    from hyparflow.mpi import comm

    given = dict(environ)
    assert comm.progress_between_nodes(given) is on
    # set only where asked for; a value the user gave is never changed
    assert given.get(comm.TCP_PROGRESS) == ("1" if on else environ.get(comm.TCP_PROGRESS))
