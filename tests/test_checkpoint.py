"""hf.save writes one standard Keras file atomically;
optimizer slots are matched to their variables."""

import keras
import numpy as np
import pytest

import hyparflow as hf
import models


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


def test_a_save_during_training_takes_keras_options_or_refuses_them_clearly(tmp_path):
    # include_optimizer=False (which Keras honours in the legacy .h5 format) is written as
    # Keras writes it (it was dropped: the optimizer's slots were saved); an unzipped folder
    # and sharded weights are several files, which a save during training cannot publish in
    # one rename: refused at each epoch's end, and training goes on.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 5)), rng.normal(size=(32, 3))
    model = models.chain()
    # (a loss object: Keras' legacy .h5 loader cannot read the string "mse" back)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.MeanSquaredError())
    refused = []

    def save(epoch, logs):
        model.save(tmp_path / "bare.h5", include_optimizer=False)
        model.save(tmp_path / "full.h5")
        for call, name, option in ((model.save, "folder.keras", dict(zipped=False)),
                                   (model.save_weights, "shards.weights.json",
                                    dict(max_shard_size=1))):
            try:
                call(tmp_path / name, **option)
            except ValueError as exc:
                refused.append(str(exc))

    hf.fit(model, x, y, batch_size=8, epochs=2, verbose=0,
           callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=save)])
    model.save(tmp_path / "theirs.h5", include_optimizer=False)  # Keras' own, after
    bare, full, theirs = (keras.models.load_model(tmp_path / f"{t}.h5")
                          for t in ("bare", "full", "theirs"))
    slots = lambda m: len(getattr(m, "optimizer", None) and m.optimizer.variables or [])  # noqa: E731
    assert slots(bare) == slots(theirs) == 0 < slots(full)
    for u, v in zip(bare.weights, theirs.weights):
        np.testing.assert_array_equal(u.numpy(), v.numpy())
    assert [e.split(" during hf.fit")[0] for e in refused] == [
        f"model.save({str(tmp_path / 'folder.keras')!r}, zipped=False)",
        f"model.save_weights({str(tmp_path / 'shards.weights.json')!r}, max_shard_size=1)"] * 2
    assert all("several files" in e and "out while training" in e for e in refused), refused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.h5", "full.h5", "theirs.h5"]


def test_each_stage_gives_back_its_own_slots_also_where_one_slot_name_starts_like_another():
    from hyparflow.keras import optimizers

    x = keras.Input((3,))
    a = keras.layers.Dense(2, name="dense")(x)
    b = keras.layers.Dense(2, name="dense_kernel")(a)  # its slots start like dense/kernel's
    model = keras.Model(x, b)
    first, second = model.layers[1].trainable_variables, model.layers[2].trainable_variables
    stages = [optimizers.stage_copy(keras.optimizers.Adam(), vs) for vs in (first, second)]
    for k, opt in enumerate(stages):
        for v in opt.variables:
            v.assign(np.full(v.shape, 10.0 * (k + 1) + (v.name == "iteration"), v.dtype))
    user = keras.optimizers.Adam()
    optimizers.give_state(user, model.trainable_variables,
                          [optimizers.stage_state(o) for o in stages], own=1)
    assert user.built and len(user._trainable_variables) == 4
    want = {"iteration": 21.0, "learning_rate": 20.0}  # scalars: the own stage's
    for k, vs in enumerate((first, second)):
        for w in vs:
            for slot in ("momentum", "velocity"):
                want[w.path.replace("/", "_") + "_" + slot] = 10.0 * (k + 1)
    assert sorted(want) == sorted(v.name for v in user.variables)
    for v in user.variables:
        np.testing.assert_array_equal(v.numpy(), np.full(v.shape, want[v.name]), err_msg=v.name)


def test_save_creates_missing_folders_and_names_the_user_s_path_when_it_cannot_write(tmp_path):
    model = _trained()
    hf.save(model, tmp_path / "new" / "deeper" / "m.keras")  # as model.save does
    keras.models.load_model(tmp_path / "new" / "deeper" / "m.keras")
    (tmp_path / "afile").write_text("")
    target = str(tmp_path / "afile" / "m.keras")  # a file where the folder should be
    with pytest.raises(OSError) as caught:
        hf.save(model, target)
    assert repr(target) in str(caught.value) and ".tmp-" not in str(caught.value)


def test_a_save_removes_what_a_writer_killed_mid_save_left_behind(tmp_path):
    from hyparflow.training.checkpoint import _HOST

    model = _trained()
    dead = tmp_path / f".tmp-{_HOST}-999999999-m.keras"  # no such process on this host
    dead.write_text("half a file")
    other = tmp_path / f".tmp-{_HOST}-999999999-other.keras"  # another target's: not ours
    other.write_text("")
    # another host's writer (a rank elsewhere on a shared file system): it may be writing
    elsewhere = tmp_path / ".tmp-elsewhere-999999999-m.keras"
    elsewhere.write_text("")
    hf.save(model, tmp_path / "m.keras")
    assert not dead.exists() and other.exists() and elsewhere.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        other.name, elsewhere.name, "m.keras"])


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_training(tmp_path):
    (tmp_path / "afile").write_text("")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 5)), rng.normal(size=(32, 3))
    model = models.chain()
    model.compile(optimizer="sgd", loss="mse")
    bad = str(tmp_path / "afile" / "ckpt-{epoch}.keras")
    with pytest.raises(ValueError) as caught:
        hf.fit(model, x, y, epochs=1, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(bad)])
    assert str(caught.value) == (
        f"ModelCheckpoint(filepath={bad!r}): {str(tmp_path / 'afile')!r} is not a folder, so "
        "nothing could be saved there. Choose a folder this job can write (on a shared file "
        "system, seen by every rank).")
    assert model.optimizer.iterations.numpy() == 0  # nothing trained
    with pytest.raises(ValueError, match=r"BackupAndRestore\(backup_dir="):
        hf.fit(model, x, y, epochs=1, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(str(tmp_path / "afile" / "backup"))])
    # a folder that does not exist yet is fine: Keras creates it when it saves
    hf.fit(model, x, y, epochs=1, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(str(tmp_path / "new" / "{epoch}" / "c.keras"))])
    assert (tmp_path / "new" / "1" / "c.keras").exists()
