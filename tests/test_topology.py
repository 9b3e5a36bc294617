"""Rank ↔ (replica, stage) arithmetic."""

import pytest

from hyparflow.mpi.topology import Topology


def test_ranks_are_laid_out_pipeline_by_pipeline():
    cells = [(Topology(4, 2, r).replica, Topology(4, 2, r).stage) for r in range(8)]
    assert cells == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    t = Topology(4, 2, 6)
    assert t.rank_of(t.replica, t.stage) == 6
    assert t.logging_rank == 3
    assert not t.is_last_stage and Topology(4, 2, 7).is_last_stage


def test_printable():
    t = Topology(partitions=2, replicas=2, rank=3)
    assert str(t) == "Topology(partitions=2, replicas=2): rank 3 (replica 1, stage 1)"
    assert t.grid().splitlines()[2:] == ["              0 |    0    1",
                                         "              1 |    2    3"]


def test_a_rank_holding_several_stages():
    # interleaved: the model cut into P × chunks stages, stage c·P + p on rank p
    t = Topology(partitions=2, replicas=2, rank=3, chunks=2)
    assert (t.replica, t.stage, t.stages) == (1, 1, (1, 3))
    assert [t.rank_of(1, s) for s in range(4)] == [2, 3, 2, 3]
    assert t.is_last_stage and t.logging_rank == 1
    assert t.where() == "rank 3 (replica 1, stages 1, 3)"
    assert Topology(2, 1, 0).stages == (0,)


@pytest.mark.parametrize("kwargs, message", [
    (dict(partitions=0, replicas=1), "partitions=0"),
    (dict(partitions=2, replicas=1, chunks=0), "chunks=0"),
    (dict(partitions=2, replicas=1.5), "replicas=1.5"),
    (dict(partitions=2, replicas=2, rank=4), "rank=4 is outside 0..3"),
])
def test_bad_topology(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Topology(**kwargs)
