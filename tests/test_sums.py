"""Sums over ranks (`hyparflow.mpi.sums`): every rank ends with the same bytes, the sum, and
no rank carries the whole array for the others — over the in-process communicator, the ranks
as threads (`local_comm`); the multi-rank tier trains through them under mpiexec."""

import threading

import numpy as np
import pytest
from mpi4py import MPI

import local_comm
from hyparflow.mpi import comm as comm_
from hyparflow.mpi import sums

SIZES = (0, 1, 2, 3, 7, 1000, 4099)


def _on_ranks(n, work, comm_class=None):
    """`work(comm)` on each of a job's n ranks (threads); their results, by rank."""
    job = local_comm.Job(n, timeout=30.0)
    comms = job.comms if comm_class is None else [comm_class(job, r) for r in range(n)]
    out, errors = [None] * n, []

    def run(r):
        try:
            out[r] = work(comms[r])
        except BaseException as exc:  # reported by the test, not lost in a thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    return out


def _arrays(rank, dtype):
    rng = np.random.default_rng(rank)
    return [(rng.standard_normal(n) * 1000).astype(dtype) for n in SIZES]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_every_rank_ends_with_the_same_bytes_of_the_sum_with_several_sums_in_flight(n, dtype):
    def work(comm):
        arrays = _arrays(comm.Get_rank(), dtype)
        started = [sums.start(a, comm) for a in arrays]  # all at once, as the buckets are
        type(started[0]).Waitall(started)
        return arrays

    results = _on_ranks(n, work)
    for k, size in enumerate(SIZES):
        first = results[0][k]
        for r in range(1, n):
            assert results[r][k].tobytes() == first.tobytes(), (size, r)
        exact = sum(_arrays(r, dtype)[k].astype(np.float64) for r in range(n))
        if dtype == np.int64:
            assert np.array_equal(first, exact.astype(np.int64))
        else:  # n − 1 float32 additions of values below ~5000: each rounds by ≤ 2⁻²⁴ of it
            np.testing.assert_allclose(first, exact, rtol=0, atol=n * 5000 * 2.0**-24 * 4)


class _Counting(local_comm.Comm):
    """The in-process communicator, counting the bytes each rank sends to each other rank."""

    sent = {}

    def Isend(self, buffer, dest, tag):
        key = (self.rank, dest)
        self.sent[key] = self.sent.get(key, 0) + np.asarray(buffer).nbytes
        return super().Isend(buffer, dest, tag)


@pytest.mark.parametrize("n", [2, 3])
def test_below_four_ranks_each_rank_sends_its_next_rank_2_p_minus_1_over_p_of_the_array(n):
    # MPI's nonblocking allreduce of Open MPI sums 2 or 3 ranks' arrays through rank 0: the
    # whole array up, then down (twice a ring's bytes at 2 ranks), which `sums` avoids
    _Counting.sent = {}
    nbytes = 4 * 6000

    def work(comm):
        array = np.full(6000, comm.Get_rank() + 1, np.float32)
        comm_.allreduce(array, comm, "sum")
        return array

    results = _on_ranks(n, work, _Counting)
    assert all(np.all(a == n * (n + 1) / 2) for a in results)
    for r in range(n):
        assert {k for k in _Counting.sent if k[0] == r} == {(r, (r + 1) % n)}
        sent = _Counting.sent[(r, (r + 1) % n)]
        assert sent == pytest.approx(2 * (n - 1) / n * nbytes, rel=0.01)


def test_the_rings_tags_are_above_every_boundary_tensors_and_differ_from_ring_to_ring():
    floor, bound = sums.reserved_tag_floor(), MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    comm = local_comm.Job(2).comms[0]
    tags = [sums._tag(comm) for _ in range(sums.TAGS + 1)]
    assert all(floor <= t <= bound for t in tags)
    assert len(set(tags[:sums.TAGS])) == sums.TAGS and tags[sums.TAGS] == tags[0]
    other = local_comm.Job(2).comms[0]  # another communicator counts its own rings
    assert sums._tag(other) == tags[0]


def test_a_sum_refuses_an_array_it_cannot_sum_in_place():
    comm = local_comm.Job(2).comms[0]
    with pytest.raises(ValueError, match="contiguous"):
        sums.start(np.zeros((4, 4), np.float32)[:, 1], comm)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_each_rank_keeps_its_share_of_the_sum_at_the_start_sent_by_a_ring(n):
    # ZeRO-1's reduce-scatter: Open MPI's sums the whole array into rank 0, then sends each
    # rank its share; the ring sends each rank's next rank every share but that rank's own
    counts = [(5 * r + 3) % 7 for r in range(n - 1)] + [0]  # unequal; the last keeps none
    total = sum(counts) + 2  # elements past the shares: summed by nobody, left as they are
    _Counting.sent = {}

    def work(comm):
        array = _arrays(comm.Get_rank(), np.int64)[-1][:total].copy()
        comm_.reduce_scatter_sum(array, counts, comm)
        return array

    results = _on_ranks(n, work, _Counting)
    exact = sum(_arrays(r, np.int64)[-1][:total] for r in range(n))
    for r in range(n):
        start = sum(counts[:r])
        assert np.array_equal(results[r][:counts[r]], exact[start:start + counts[r]]), r
        assert {k for k in _Counting.sent if k[0] == r} <= {(r, (r + 1) % n)}
        assert _Counting.sent.get((r, (r + 1) % n), 0) == 8 * (sum(counts) - counts[r])


def test_shares_that_do_not_fit_the_ranks_are_refused():
    comm = local_comm.Job(2).comms[0]
    with pytest.raises(ValueError, match="counts"):
        sums.start_scatter(np.zeros(4), [3, 3], comm)
