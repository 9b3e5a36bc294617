"""Global batch → replica share → micro-batches."""

import numpy as np
import pytest

from hyparflow.data import batches as data


def test_full_batch_splits_over_replicas_then_microbatches():
    batch = np.arange(16)
    assert [m.tolist() for m in data.shard(batch, 2, 4, 0)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [m.tolist() for m in data.shard(batch, 2, 4, 1)] == [[8, 9], [10, 11], [12, 13],
                                                                 [14, 15]]


def test_uneven_batch_uses_every_sample_once_and_drops_empty_microbatches():
    batch = np.arange(5)  # a last batch smaller than replicas × microbatches
    shards = [data.shard(batch, 2, 4, r) for r in range(2)]
    assert [[m.tolist() for m in s] for s in shards] == [[[0], [1], [2]], [[3], [4]]]
    assert sorted(i for s in shards for m in s for i in m) == list(range(5))


def test_even_sizes():
    assert data.even_sizes(10, 4) == [3, 3, 2, 2]
    assert data.even_sizes(2, 3) == [1, 1, 0]


def test_batches_keep_a_smaller_last_batch():
    assert [b.tolist() for b in data.batches(np.arange(7), 3)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_epoch_order_is_the_same_everywhere_and_changes_per_epoch():
    a = data.epoch_order(50, True, seed=3, epoch=0)
    assert a.tolist() == data.epoch_order(50, True, seed=3, epoch=0).tolist()
    assert a.tolist() != data.epoch_order(50, True, seed=3, epoch=1).tolist()
    assert sorted(a.tolist()) == list(range(50))
    assert data.epoch_order(5, False, seed=3, epoch=0).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("P, share, m", [
    (1, 64, 1),     # no pipeline: no micro-batches
    (2, 64, 4),     # micro-batches of 16 samples
    (2, 512, 8),    # capped at 4P
    (4, 64, 4),     # at least P, even if smaller than 16 samples
    (4, 3, 3),      # never more than the share
    (3, 1000, 12),
])
def test_default_microbatches(P, share, m):
    assert data.default_microbatches(P, share) == m


def test_as_arrays_accepts_array_list_and_dict_and_casts_floats():
    class T:
        shape = (None, 2)

    out = data.as_arrays(np.zeros((3, 2), np.float64), [T()], ["x"], "x")
    assert out[0].dtype == np.float32
    out = data.as_arrays({"b": np.ones((3, 1)), "a": np.zeros((3, 2), np.int64)},
                         [T(), T()], ["a", "b"], "x")
    assert out[0].dtype == np.int64 and out[1].shape == (3, 1)
    with pytest.raises(ValueError, match=r"model's inputs are named \['a', 'c'\]; add \['c'\]"):
        data.as_arrays({"a": np.zeros(3)}, [T(), T()], ["a", "c"], "x")
    with pytest.raises(ValueError, match="x has 1 arrays, but the model has 2 inputs"):
        data.as_arrays([np.zeros(3)], [T(), T()], ["a", "c"], "x")


def test_num_samples_names_the_disagreement():
    with pytest.raises(ValueError, match=r"x \[10\], y \[9\]"):
        data.num_samples([np.zeros(10)], [np.zeros(9)])
