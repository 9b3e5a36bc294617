"""Preemption in one process: a signal during hf.fit checkpoints at the step boundary, exits 75,
and a rerun resumes at the next step."""

import json
import os
import signal

import keras
import numpy as np
import pytest

import hyparflow as hf

SAMPLES, BATCH, EPOCHS = 80, 16, 3  # 5 steps an epoch


def _model():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(SAMPLES, 4)).astype("float32"), rng.integers(0, 3, size=SAMPLES)


def _signal_at(epoch, step, signum=signal.SIGUSR1):
    """A callback that signals this process after `step` of `epoch`, as a batch system would."""
    now = [None]
    return keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: now.__setitem__(0, e),
        on_train_batch_end=lambda b, logs: os.kill(os.getpid(), signum)
        if (now[0], b) == (epoch, step) else None)


def _state(model):
    return model.get_weights() + [v.numpy() for v in model.optimizer.variables]


def _same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(v, u, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_mid_epoch_saves_the_backup_and_a_rerun_resumes_at_the_next_step(
        tmp_path, capsys, signum):
    x, y = _data()
    reference = _model()
    hf.fit(reference, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)

    backup = str(tmp_path / "backup")
    model = _model()
    before = signal.getsignal(signum)
    with pytest.raises(hf.Preempted) as caught:
        hf.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
               callbacks=[keras.callbacks.BackupAndRestore(backup), _signal_at(1, 2, signum)])
    assert caught.value.code == 75 and isinstance(caught.value, SystemExit)
    name = signal.Signals(signum).name
    message = (f"hyparflow: {name} on rank 0 (replica 0, stage 0): stopped after epoch 2, step 3 "
               f"of 5; saved the training state through BackupAndRestore({backup!r}): run the "
               "same script again to resume at the next step. Exit code 75.")
    assert str(caught.value) == message
    assert capsys.readouterr().err.strip() == message
    assert signal.getsignal(signum) is before  # hf.fit's handler is gone
    with open(os.path.join(backup, "training_metadata.json")) as f:
        assert json.load(f) == {"epoch": 1, "batch": 2, "hyparflow_steps": 3,
                                "hyparflow_iterations": 8}

    rerun = _model()  # the script run again: a fresh model, the same callbacks
    history = hf.fit(rerun, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                     callbacks=[keras.callbacks.BackupAndRestore(backup)])
    _same(_state(reference), _state(rerun))
    assert len(history.history["loss"]) == 2  # the rest of epoch 2, and epoch 3
    assert not os.path.exists(backup)  # removed at the end, as BackupAndRestore does


def test_without_a_backup_a_model_checkpoint_is_written_and_without_either_it_says_so(
        tmp_path, capsys):
    x, y = _data()
    path = str(tmp_path / "ckpt-{epoch}.keras")
    model = _model()
    with pytest.raises(hf.Preempted):
        hf.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
               callbacks=[keras.callbacks.ModelCheckpoint(path), _signal_at(0, 1)])
    saved = str(tmp_path / "ckpt-1.keras")
    assert os.path.exists(saved)
    assert keras.models.load_model(saved).optimizer.iterations.numpy() == 2
    assert (f"stopped after epoch 1, step 2 of 5; saved through ModelCheckpoint({saved!r}) (add a "
            "BackupAndRestore callback to resume where it stopped)") in capsys.readouterr().err

    with pytest.raises(hf.Preempted) as caught:
        hf.fit(_model(), x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
               callbacks=[_signal_at(0, 0, signal.SIGTERM)])
    assert ("stopped after epoch 1, step 1 of 5; nothing was saved: add "
            "keras.callbacks.BackupAndRestore(backup_dir) to hf.fit's callbacks to resume where "
            "it stopped. Exit code 75.") in str(caught.value)


def test_a_signal_outside_a_step_boundary_is_delivered_when_fit_returns():
    x, y = _data()
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        # after the last step's boundary: too late to stop, so it reaches the process's handler
        # once hf.fit returns
        seen = []
        hf.fit(_model(), x, y, batch_size=BATCH, epochs=1, verbose=0,
               callbacks=[keras.callbacks.LambdaCallback(
                   on_epoch_end=lambda e, logs: os.kill(os.getpid(), signal.SIGUSR1),
                   on_train_end=lambda logs: seen.append(list(got)))])
        assert seen == [[]] and got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_process_forked_during_fit_dies_of_sigterm_as_before():
    # A PyDataset's worker processes are forked while hf.fit runs, and Pool.terminate() ends
    # them with SIGTERM: with hf.fit's handler inherited they lived on, and fit hung.
    x, y = _data()
    forked = []

    def fork(batch, logs):
        if not forked:
            pid = os.fork()
            if pid == 0:  # the child: waits to be terminated
                signal.pause()
                os._exit(0)
            forked.append(pid)

    hf.fit(_model(), x, y, batch_size=BATCH, epochs=1, verbose=0,
           callbacks=[keras.callbacks.LambdaCallback(
               on_train_batch_end=lambda b, logs: fork(b, logs))])
    os.kill(forked[0], signal.SIGTERM)
    _, status = os.waitpid(forked[0], 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


def test_a_second_signal_takes_its_usual_course():
    x, y = _data()
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        def twice(batch, logs):
            if batch == 0:
                os.kill(os.getpid(), signal.SIGUSR1)  # noted: stop at this boundary
                os.kill(os.getpid(), signal.SIGUSR1)  # insisting: the process's own handler
        with pytest.raises(hf.Preempted):
            hf.fit(_model(), x, y, batch_size=BATCH, epochs=1, verbose=0,
                   callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=twice)])
        assert got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
