"""Gradient buckets' layout and $HYPARFLOW_BUCKET_MB (the reduction itself: tests/mpi)."""

import numpy as np
import pytest

from hyparflow.engine import buckets


def test_the_size_is_read_in_mib_and_a_bad_one_is_refused_naming_the_variable():
    assert buckets.cap({}) is None
    assert buckets.cap({"HYPARFLOW_BUCKET_MB": " "}) is None
    assert buckets.cap({"HYPARFLOW_BUCKET_MB": "0"}) == 0
    assert buckets.cap({"HYPARFLOW_BUCKET_MB": "2.5"}) == int(2.5 * 2**20)
    for bad in ("-1", "four", "inf", "nan"):
        with pytest.raises(ValueError, match=rf"HYPARFLOW_BUCKET_MB='{bad}': give the "
                                             r"gradient bucket size in MiB, a number ≥ 0"):
            buckets.cap({"HYPARFLOW_BUCKET_MB": bad})


def test_buckets_run_from_the_last_variable_back_within_the_limit_one_dtype_each():
    f32, f64 = np.dtype("float32"), np.dtype("float64")
    sizes = [100, 400, None, 300, 200, 50]
    dtypes = [f32, f32, None, f32, f64, f64]
    # the last variables first; the sparse one (None) in none; a new bucket at a new dtype
    assert buckets.layout(sizes, dtypes, limit=500) == [[5, 4], [3], [1, 0]]
    assert buckets.layout(sizes, dtypes, limit=10) == [[5], [4], [3], [1], [0]]
    # a variable larger than the limit has a bucket of its own
    assert buckets.layout([10, 5000, 10], [f32] * 3, limit=100) == [[2], [1], [0]]


@pytest.mark.parametrize("total_mib, expected", [(3, 1 << 20), (320, 10 << 20)])
def test_the_default_limit_is_a_mib_or_a_32nd_of_the_gradients(total_mib, expected):
    n = total_mib * 4  # variables of 256 KiB
    layout = buckets.layout([1 << 18] * n, [np.dtype("float32")] * n)
    assert max(len(b) for b in layout) * (1 << 18) == expected
    assert sorted(k for b in layout for k in b) == list(range(n))


def test_hf_fit_refuses_a_bad_bucket_size_before_training(monkeypatch):
    import keras

    import hyparflow as hf

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    monkeypatch.setenv("HYPARFLOW_BUCKET_MB", "lots")
    with pytest.raises(ValueError, match="HYPARFLOW_BUCKET_MB='lots'"):
        hf.fit(model, np.zeros((8, 3), "float32"), np.zeros((8, 2), "float32"), batch_size=4,
               verbose=0)
    for w, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, b)
