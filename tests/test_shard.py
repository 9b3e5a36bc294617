"""shard_optimizer's bookkeeping: who owns which variable (the messages: tests/mpi/numerics.py)."""

import numpy as np
import pytest

from hyparflow.engine import shard


@pytest.mark.parametrize("sizes, replicas", [
    ([400, 100, 300, 200], 2), ([7] * 10, 3), ([1000, 1, 1, 1], 2), ([5, 5], 4),
    (list(np.random.default_rng(0).integers(1, 10**6, 50)), 7)])
def test_owners_balance_whole_variables(sizes, replicas):
    owners = shard.owners(sizes, replicas)
    assert len(owners) == len(sizes) and set(owners) <= set(range(replicas))
    load = [sum(s for s, r in zip(sizes, owners) if r == k) for k in range(replicas)]
    # largest first to the least loaded: no replica above its fair share by more than one
    # variable
    assert max(load) <= sum(sizes) / replicas + max(sizes)
    assert owners == shard.owners(list(sizes), replicas)  # the same on every rank


def test_more_replicas_than_variables_leaves_some_without_a_share():
    assert shard.owners([5, 5], 4) == [0, 1]

