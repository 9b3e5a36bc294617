"""hf.save writes one standard Keras file atomically; optimizer slots are matched to their variables."""

import keras
import numpy as np
import pytest

import hyparflow as hf
import models
from hyparflow import checkpoint


def _trained():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 5)), rng.normal(size=(32, 3))
    keras.utils.set_random_seed(1)
    model = models.chain()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    hf.fit(model, x, y, batch_size=8, epochs=2, verbose=0)
    return model


def test_save_writes_what_model_save_writes(tmp_path):
    model = _trained()
    hf.save(model, tmp_path / "ours.keras")
    model.save(tmp_path / "theirs.keras")
    hf.save(model, tmp_path / "ours.weights.h5")
    ours, theirs = (keras.models.load_model(tmp_path / f"{t}.keras") for t in ("ours", "theirs"))
    for u, v in zip(ours.weights + ours.optimizer.variables,
                    theirs.weights + theirs.optimizer.variables):
        np.testing.assert_array_equal(u.numpy(), v.numpy())
    assert int(ours.optimizer.iterations.numpy()) == 8
    fresh = models.chain()
    fresh.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(tmp_path / "ours.weights.h5")
    for u, v in zip(fresh.weights + fresh.optimizer.variables,
                    theirs.weights + theirs.optimizer.variables):
        np.testing.assert_array_equal(u.numpy(), v.numpy())


def test_a_failed_save_leaves_the_previous_file_and_no_debris(tmp_path, monkeypatch):
    model = _trained()
    path = tmp_path / "model.keras"
    hf.save(model, path)
    before = path.read_bytes()

    def broken(*args, **kwargs):
        with open(args[0], "wb") as f:  # half a file under the temporary name
            f.write(b"PK\x03\x04 half")
        raise OSError("disk full")

    monkeypatch.setattr(model, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        hf.save(model, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.keras"]


def test_save_refuses_names_keras_cannot_read(tmp_path):
    with pytest.raises(ValueError, match=r"filepath=.*model.pkl.*: use a name ending in .keras"):
        hf.save(_trained(), tmp_path / "model.pkl")
    (tmp_path / "m.keras").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"exists and overwrite=False"):
        hf.save(_trained(), tmp_path / "m.keras", overwrite=False)


def test_optimizer_slots_belong_to_the_longest_matching_variable():
    x = keras.Input((3,))
    a = keras.layers.Dense(2, name="dense")(x)
    b = keras.layers.Dense(2, name="dense_kernel")(a)  # its slots start like dense/kernel's
    model = keras.Model(x, b)
    opt = keras.optimizers.Adam()
    opt.build(model.trainable_variables)
    owners = checkpoint._owners([v.name for v in opt.variables], model.trainable_variables)
    for v in opt.variables:
        owner = owners[v.name]
        if v.name in ("iteration", "learning_rate"):
            assert owner is None
        else:
            assert v.name in (owner.path.replace("/", "_") + "_momentum",
                              owner.path.replace("/", "_") + "_velocity")
