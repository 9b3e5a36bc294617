"""Elastic jobs: the launcher's next launch after a lost node or rank, and the ranks' backups."""

import json
import os

import keras
import numpy as np
import pytest

import hyparflow as hf
from hyparflow import restart, run
from hyparflow.arguments import Call
from hyparflow.training import elastic

JOB = {"partitions": 2, "replicas": 2, "nodes": {"a": [0, 1], "b": [2, 3]}}


def _notices(text):
    notices = run.Notices()
    notices.scan(text)
    return notices


LOST_B = _notices(b"PRTE has lost communication with a remote daemon.\n  HNP daemon   : "
                  b"[prterun-a-1@0,0] on node a\n  Remote daemon: [prterun-a-1@0,1] on node b\n")
# (PRRTE cuts its notice where it likes)
KILLED_1 = _notices(b"-----\nprterun noticed that process rank 1 with PID 7259 on node a "
                    b"exited on\nsignal 9 (Killed).\n-----\n")


def _backup(folder, call, meta):
    os.makedirs(folder / f"fit-{call}")
    (folder / f"fit-{call}" / "training_metadata.json").write_text(json.dumps(meta))
    return str(folder / f"fit-{call}")


def test_a_rank_killed_is_read_from_mpiexecs_notice_however_it_is_cut():
    text = (b"prterun noticed that process rank 3 with PID 12 on node b7 exited on\n"
            b"signal 9 (Killed).\n")
    for cut in (1, 5, len(text)):
        notices = run.Notices()
        for i in range(0, len(text), cut):
            notices.scan(text[i:i + cut])
        assert notices.killed == (3, "b7", 9) and not notices.lost
    # a rank that raised: MPI_ABORT, not a death to recover from
    assert _notices(b'prterun has exited due to process rank 1 with PID 0 on node vm calling\n'
                    b'"abort".\n').killed is None


def test_a_lost_node_restarts_on_the_others_with_fewer_replicas(tmp_path):
    job = dict(JOB, backup=_backup(tmp_path, 0, {"epoch": 1, "batch": 1, "hyparflow_steps": 2}))
    nxt = restart.next_launch(4, ["--hostfile", "h", "--map-by", "ppr:2:node"], LOST_B, job,
                              str(tmp_path), attempt=1, restarts=3)
    assert nxt.n == 2
    hosts = nxt.extra[nxt.extra.index("--hostfile") + 1]
    assert "h" not in nxt.extra and "--map-by" in nxt.extra  # the user's placement kept
    assert open(hosts).read() == "a slots=2\n"
    assert nxt.line == ("hyparflow-run: elastic restart 1 of 3: node b was lost (world ranks "
                        "2-3); running again on 2 ranks (2 × 1, node a), from the backup after "
                        "epoch 2, step 2.")
    # the host list given any other way is replaced alike
    for given in (["--host", "a:2,b:2"], ["-H", "a,b"], ["--machinefile", "m"],
                  ["--default-hostfile", "d"]):
        nxt = restart.next_launch(4, given + ["--bind-to", "none"], LOST_B, job, str(tmp_path),
                                  attempt=2, restarts=3)
        assert nxt.extra[:2] == ["--bind-to", "none"] and nxt.extra[2] == "--hostfile", \
            nxt.extra
        assert given[1] not in nxt.extra


def test_a_restart_keeps_a_rank_for_every_stage_or_says_why_not(tmp_path):
    job = dict(JOB, partitions=4, replicas=1)
    with pytest.raises(restart.Refused, match=r"node b was lost \(world ranks 2-3\): the model "
                       r"is cut into 4 stages, each needing a rank, and 2 ranks are left"):
        restart.next_launch(4, [], LOST_B, job, str(tmp_path), attempt=1, restarts=3)
    with pytest.raises(restart.Refused, match="before any hf.fit call of the job said where"):
        restart.next_launch(4, [], LOST_B, None, str(tmp_path), attempt=1, restarts=3)
    # three ranks left of P = 2: one pipeline runs, the odd rank stays out
    job = dict(JOB, nodes={"a": [0, 1, 2], "b": [3]})
    assert restart.next_launch(4, [], LOST_B, job, str(tmp_path), 1, 3).n == 2


def test_a_rank_killed_alone_restarts_the_job_at_its_size(tmp_path):
    job = dict(JOB, backup=_backup(tmp_path, 1, {"epoch": 3}))  # written at an epoch's end
    nxt = restart.next_launch(4, ["--hostfile", "h"], KILLED_1, job, str(tmp_path), 1, 2)
    assert (nxt.n, nxt.extra) == (4, ["--hostfile", "h"])
    assert nxt.line == ("hyparflow-run: elastic restart 1 of 2: world rank 1 (node a) was "
                        "killed by signal 9; running again on 4 ranks (2 × 2), from the backup "
                        "after epoch 3.")
    nxt = restart.next_launch(4, [], KILLED_1, None, str(tmp_path), 1, 2)
    assert nxt.n == 4 and nxt.line.endswith("running again on 4 ranks, from the start.")


def test_the_launcher_runs_mpiexec_for_the_ranks_of_an_elastic_job(capsys, tmp_path):
    assert run.main(["-n", "2", "--elastic", "--elastic-dir", str(tmp_path / "e"),
                     "--backup-every", "30", "--dry-run", "--", "python", "t.py"]) == 0
    line = capsys.readouterr().out
    for name in ("HYPARFLOW_ELASTIC", "HYPARFLOW_BACKUP_SECONDS"):
        assert f"-x {name}" in line, line
    # the bundled Open MPI 5 lets the ranks outlive one that dies: the job may go on in place
    assert " --with-ft ulfm " in line, line
    assert run.main(["-n", "2", "--dry-run", "--", "python", "t.py"]) == 0
    assert "--with-ft" not in capsys.readouterr().out  # (not elastic: as before)
    with pytest.raises(SystemExit):
        run.main(["-n", "2", "--restarts", "-1", "--elastic", "--", "python", "t.py"])
    assert "--restarts -1: " in capsys.readouterr().err


def test_a_job_restarted_on_fewer_ranks_trains_with_fewer_replicas(monkeypatch, tmp_path):
    call = Call(model=None, x=None, partitions=2, replicas=2)
    assert elastic.fitted(call, 2) is call  # not elastic: the usual error follows
    monkeypatch.setenv(elastic.ENV, str(tmp_path))
    monkeypatch.setattr(elastic, "_CALLS", [0])
    a = elastic.fitted(call, 2)
    assert (a.partitions, a.replicas) == (2, 1)
    backup, = a.callbacks
    assert isinstance(backup, keras.callbacks.BackupAndRestore)
    assert backup.backup_dir == str(tmp_path / "fit-0") and not backup.delete_checkpoint
    assert elastic.fitted(call, 4).replicas == 2  # the size asked: as asked
    assert elastic.fitted(call, 3).replicas == 2  # not a multiple of P: the usual error
    assert elastic.fitted(call, 8).replicas == 2  # more ranks than asked: the usual error
    # the next call of the script backs up on its own; the user's BackupAndRestore is theirs
    assert elastic.fitted(call, 2).callbacks[0].backup_dir == str(tmp_path / "fit-4")
    own = keras.callbacks.BackupAndRestore(str(tmp_path / "mine"))
    assert elastic.fitted(call.replace(callbacks=[own]), 2).callbacks == [own]
    monkeypatch.setenv(elastic.SECONDS_ENV, "soon")
    with pytest.raises(ValueError, match=r"\$HYPARFLOW_BACKUP_SECONDS='soon': use a number of "
                       "seconds ≥ 0 between two backups"):
        elastic.fitted(call, 2)


def _model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def test_a_rerun_resumes_after_the_last_step_backed_up(monkeypatch, tmp_path):
    # One process, as the script a restarted job runs again: backups at every step
    # boundary ($HYPARFLOW_BACKUP_SECONDS=0); the first run dies after epoch 2's second
    # step, the rerun trains the rest (its order of the samples replayed: a shuffle seeded by
    # the script's seed), the same weights as a run never stopped.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4)).astype("float32"), rng.normal(size=(40, 2)).astype("float32")
    fit = dict(batch_size=8, epochs=3, verbose=0, shuffle=True)
    _model().fit(x, y, **fit)  # (the first fit of a process rounds differently)
    reference = _model()
    hf.fit(reference, x, y, **fit)
    monkeypatch.setenv(elastic.ENV, str(tmp_path))
    monkeypatch.setenv(elastic.SECONDS_ENV, "0")
    seen = []

    class Dies(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            seen.append((self.epoch, batch))
            if (self.epoch, batch) == (1, 1) and len(seen) == 7:  # the first run only
                raise RuntimeError("died")

    monkeypatch.setattr(elastic, "_CALLS", [0])
    with pytest.raises(RuntimeError, match="died"):
        hf.fit(_model(), x, y, callbacks=[Dies()], **fit)
    meta = json.loads((tmp_path / "fit-0" / "training_metadata.json").read_text())
    assert (meta["epoch"], meta["hyparflow_steps"]) == (1, 1)  # after epoch 2, step 1
    monkeypatch.setattr(elastic, "_CALLS", [0])  # the script from its start
    model = _model()
    hf.fit(model, x, y, callbacks=[Dies()], **fit)
    assert seen[7:] == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4)]
    for u, v in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(v, u, rtol=1e-6, atol=1e-7)
    # a finished call's backup stays (the launcher removes the folder when the job ends
    # well): the script run again passes over it, the model as it ended
    monkeypatch.setattr(elastic, "_CALLS", [0])
    again = _model()
    assert hf.fit(again, x, y, **fit).history == {}
    for u, v in zip(model.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(v, u)
    # and the script's next call, which has no backup yet, trains from its first epoch (not
    # from the epoch the last restored)
    assert len(hf.fit(again, x, y, **fit).history["loss"]) == 3


FAKE_MPIEXEC = """#!/bin/sh
# a stand-in for mpiexec: the first launch records a 2 x 2 job on nodes a and b, then loses b
# (notice on stdout, exit 255, as PRRTE does at times; a rank's stderr cut mid-line); the next
# one says how it was called
[ "$1" = "--version" ] && echo "mpiexec (Open MPI) 5.0" && exit 0
if [ ! -e "$HYPARFLOW_ELASTIC/job.json" ]; then
  mkdir -p "$HYPARFLOW_ELASTIC/fit-0"
  echo '{"partitions": 2, "replicas": 2, "nodes": {"a": [0, 1], "b": [2, 3]},' \
       '"backup": "'"$HYPARFLOW_ELASTIC/fit-0"'"}' > "$HYPARFLOW_ELASTIC/job.json"
  echo '{"epoch": 4, "batch": 2}' > "$HYPARFLOW_ELASTIC/fit-0/training_metadata.json"
  printf 'A daemon failed to report back after being spawned.\\n  Local host:    a\\n'
  printf '  Remote host:   b\\n'
  printf 'last words cut short\\0\\0' >&2
  exit 255
fi
echo "CALLED WITH $*"
"""


def _elastic_run(tmp_path, mpiexec, n, *options):
    """`hyparflow-run -n n --elastic ... python t.py` with the stand-in `mpiexec` (a shell
    script's text); returns its status and the elastic folder."""
    fake = tmp_path / "mpiexec"
    fake.write_text(mpiexec)
    fake.chmod(0o755)
    folder = tmp_path / "elastic"
    return run.main(["-n", str(n), "--mpiexec", str(fake), "--elastic", "--elastic-dir",
                     str(folder), *options, "--", "python", "t.py"]), folder


def test_the_launcher_runs_the_job_again_after_a_notice_on_either_stream(tmp_path, capfd):
    code, folder = _elastic_run(tmp_path, FAKE_MPIEXEC, 4, "--mpiexec-args", "--hostfile given")
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert ("\nhyparflow-run: elastic restart 1 of 3: node b was lost (world ranks 2-3); running "
            "again on 2 ranks (2 × 1, node a), from the backup after epoch 4.") in err, err
    assert "last words cut short\0\0\n" in err  # the launcher's line starts a line of its own
    called = out.split("CALLED WITH ", 1)[1]
    assert called.startswith("-n 2 ") and f"--hostfile {folder}/hosts-1 " in called, called
    assert "given" not in called
    assert not folder.exists()  # the job ended well


def test_a_backup_whose_weights_and_record_come_from_two_saves_is_refused(monkeypatch,
                                                                          tmp_path):
    # Keras writes a backup's weights, then its record: a job killed between the two leaves
    # the weights of one backup beside the record of the one before. Resuming would train
    # those steps twice (a wrong model, exit 0): one clear error instead.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4)).astype("float32"), rng.normal(size=(40, 2)).astype("float32")
    fit = dict(batch_size=8, epochs=2, verbose=0, shuffle=False)
    monkeypatch.setenv(elastic.ENV, str(tmp_path))
    monkeypatch.setenv(elastic.SECONDS_ENV, "0")
    records = []

    class Dies(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            path = tmp_path / "fit-0" / "training_metadata.json"
            if path.exists():
                records.append(path.read_text())
            if len(records) == 3:
                raise RuntimeError("died")

    monkeypatch.setattr(elastic, "_CALLS", [0])
    with pytest.raises(RuntimeError, match="died"):
        hf.fit(_model(), x, y, callbacks=[Dies()], **fit)
    path = tmp_path / "fit-0" / "training_metadata.json"
    assert json.loads(path.read_text())["hyparflow_iterations"] == 3
    path.write_text(records[1])  # the record of the backup before (after 2 steps)
    monkeypatch.setattr(elastic, "_CALLS", [0])
    with pytest.raises(ValueError, match=r"its weights hold 3 optimizer steps, but its record "
                       r"\(training_metadata.json\) was written after 2: the job was stopped "
                       "between the two writes of one backup"):
        hf.fit(_model(), x, y, **fit)


def test_a_job_that_keeps_losing_ranks_stops_after_its_restarts_with_one_line(tmp_path,
                                                                              capfd):
    # every launch loses a rank (killed by a signal): run again --restarts times, then the
    # launcher ends with the job's status, saying why, and keeps the backups
    code, folder = _elastic_run(
        tmp_path, '#!/bin/sh\n[ "$1" = "--version" ] && echo "Open MPI 5" && exit 0\n'
        'mkdir -p "$HYPARFLOW_ELASTIC/fit-0" && touch "$HYPARFLOW_ELASTIC/fit-0/x"\n'
        'echo "prterun noticed that process rank 1 with PID 7 on node a exited on" >&2\n'
        'echo "signal 9 (Killed)." >&2\nexit 137\n', 2, "--restarts", "1")
    err = capfd.readouterr().err
    assert code == 137
    assert err.count("hyparflow-run: elastic restart 1 of 1: world rank 1 (node a) was killed "
                     "by signal 9; running again on 2 ranks, from the start.") == 1, err
    assert ("hyparflow-run: the job lost a rank after 1 restart (--restarts 1): not run again."
            in err), err
    assert f"hyparflow-run: the elastic backups stay in {folder}: the same command resumes" in err
    assert (folder / "fit-0").exists()


def test_survivors_that_cannot_go_on_in_place_name_the_ranks_lost_and_the_job_runs_again(
        tmp_path, capfd):
    # Under --with-ft ulfm mpiexec says nothing of a rank that died: survivors that cannot go
    # on in place (P > 1 here) write lost.json and abort; Open MPI 5.0's mpiexec then exits 0
    # when the last rank left aborts: the launcher reads the abort's error code instead.
    code, folder = _elastic_run(
        tmp_path,
        '#!/bin/sh\n[ "$1" = "--version" ] && echo "mpiexec (Open MPI) 5.0.11" && exit 0\n'
        'echo "CALLED WITH $*"\n'
        'if [ ! -e "$HYPARFLOW_ELASTIC/../once" ]; then touch "$HYPARFLOW_ELASTIC/../once"\n'
        '  echo \'{"ranks": [1], "nodes": ["a"]}\' > "$HYPARFLOW_ELASTIC/lost.json"\n'
        '  printf "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\\n'
        '  Proc: [[1,1],0]\\n  Errorcode: 1\\n" >&2\n  exit 0\nfi\nexit 0\n', 2)
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert out.count("CALLED WITH") == 2 and out.count("--with-ft ulfm") == 2, out
    assert err.count("hyparflow-run: elastic restart") == 1 and (
        "hyparflow-run: elastic restart 1 of 3: world rank 1 (node a) failed; running again "
        "on 2 ranks, from the start.") in err, err
    assert not folder.exists()  # the job ended well: lost.json too is gone
    assert restart.read_lost(str(tmp_path)) is None


def test_a_loss_is_told_from_mpis_error_however_it_is_wrapped():
    from mpi4py import MPI

    from hyparflow.mpi import guard

    for error in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED):
        assert guard.lost_ranks(MPI.Exception(error))
    assert not guard.lost_ranks(MPI.Exception(MPI.ERR_TRUNCATE))
    assert not guard.lost_ranks(ValueError("no"))
    try:  # raised inside a TensorFlow op that sent messages: its text, or its cause
        try:
            raise MPI.Exception(MPI.ERR_REVOKED)
        except MPI.Exception as exc:
            raise RuntimeError("Graph execution error") from exc
    except RuntimeError as wrapped:
        assert guard.lost_ranks(wrapped)
    assert guard.lost_ranks(RuntimeError("in user code: MPI_ERR_PROC_FAILED: Process Failed"))


def test_a_job_on_a_fault_tolerant_mpi_goes_on_in_place_where_a_replica_is_left(monkeypatch,
                                                                                tmp_path):
    from types import SimpleNamespace

    from hyparflow import Topology

    def trainer(P, R, resumable=True, shard=None):
        return SimpleNamespace(topology=Topology(partitions=P, replicas=R, rank=0),
                               resumable=resumable, executor=SimpleNamespace(shard=shard))

    monkeypatch.delenv(elastic.ENV, raising=False)
    assert elastic.refusal(trainer(1, 2)).startswith("not an elastic job")
    monkeypatch.setenv(elastic.ENV, str(tmp_path))
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    assert "mpiexec --with-ft ulfm" in elastic.refusal(trainer(1, 2))
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")
    assert elastic.refusal(trainer(1, 2)) is None
    assert elastic.refusal(trainer(1, 2, resumable=None)) == (
        "the loss came before hf.fit began training")
    assert elastic.refusal(trainer(2, 2)) is None  # (the survivors' word decides: `holders`)
    assert elastic.refusal(trainer(2, 1)) == (
        "at partitions=2 the lost rank's stage has no copy left")
    assert "shard_optimizer=True" in elastic.refusal(trainer(1, 2, shard=object()))
    assert "not replayed from a step" in elastic.refusal(trainer(1, 2, resumable=False))


def test_the_history_of_a_call_that_went_on_in_place_holds_every_epoch():
    before, after = keras.callbacks.History(), keras.callbacks.History()
    before.epoch, before.history = [0, 1], {"loss": [3.0, 2.0], "val_loss": [2.5]}
    after.epoch, after.history = [2, 3], {"loss": [1.0, 0.5], "val_loss": [0.7]}
    whole = elastic.joined(before, after)
    assert whole is after and whole.epoch == [0, 1, 2, 3]
    assert whole.history == {"loss": [3.0, 2.0, 1.0, 0.5], "val_loss": [2.5, 0.7]}
    assert elastic.joined(None, after) is after


def test_a_job_that_exits_0_without_every_ranks_end_runs_again(tmp_path, capfd):
    # Under ULFM the others outlive a rank that dies outside any hf call (the user's own code
    # after hf.fit, say) and mpiexec exits 0: each rank marks its script's end, and a rank
    # with no mark, not gone on without in place, has the job run again.
    code, folder = _elastic_run(
        tmp_path,
        '#!/bin/sh\n[ "$1" = "--version" ] && echo "mpiexec (Open MPI) 5.0.11" && exit 0\n'
        'touch "$HYPARFLOW_ELASTIC/done-0"\n'
        'if [ -e "$HYPARFLOW_ELASTIC/../once" ]; then touch "$HYPARFLOW_ELASTIC/done-1"; fi\n'
        'touch "$HYPARFLOW_ELASTIC/../once"\nexit 0\n', 2)
    err = capfd.readouterr().err
    assert code == 0, err
    assert "hyparflow-run: the job exited 0, but world rank 1 did not end its script." in err
    assert ("hyparflow-run: elastic restart 1 of 3: world rank 1 (node not named) failed; "
            "running again on 2 ranks, from the start.") in err, err
    assert not folder.exists()
    # a rank the others went on without in place has no mark to leave
    folder.mkdir()
    for name in ("done-0", "done-2"):
        (folder / name).touch()
    assert restart.unfinished(str(folder), 3) == [1]
    (folder / elastic.GONE_FILE).write_text('{"ranks": [1]}')
    assert restart.unfinished(str(folder), 3) == []
    # nor has one that left the job (no stage for it) if it could not write its own
    (folder / elastic.GONE_FILE).write_text('{"ranks": [1], "left": [3]}')
    assert restart.unfinished(str(folder), 4) == []
    assert restart.unfinished(str(tmp_path / "none"), 3) == []  # no mark at all: no check


def test_going_on_in_place_takes_the_state_a_forward_changes_as_of_the_last_step_finished():
    # A survivor's model holds the weights of the last step it finished beside the statistics
    # (and dropout's counters) of the forward it began next: those are taken as they were.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.5)])
    kept = elastic.Kept([model])
    norm, drop = model.layers[1], model.layers[2]
    state = drop.seed_generator.state
    assert {id(v) for v in kept.variables} == {id(v) for v in norm.non_trainable_variables} | {
        id(state)}
    kept.take()
    before_mean, before_state = norm.moving_mean.numpy().copy(), state.numpy().copy()
    norm.moving_mean.assign(before_mean + 1.0)  # the next step's forward
    state.assign(before_state + np.array([0, 7], before_state.dtype))
    np.testing.assert_array_equal(kept.of(norm.moving_mean), before_mean)
    np.testing.assert_array_equal(kept.of(state), before_state)
    # a seed is this replica's while it trains (moved): its counter only is taken
    state.assign(before_state + np.array([1000, 7], before_state.dtype))
    np.testing.assert_array_equal(kept.of(state), before_state + np.array([1000, 0],
                                                                          before_state.dtype))
    kernel = model.layers[0].kernel  # not kept: as it is
    np.testing.assert_array_equal(kept.of(kernel), kernel.numpy())


def test_the_survivors_go_on_from_the_furthest_step_every_stage_finished():
    # Each survivor's word: its last finished step, its place in the pipeline, and whether its
    # replicas' state is one at that step. At 2 × 2 one rank lost: every stage has a survivor;
    # the step is the furthest one every stage reached, each stage's state from the first
    # survivor that finished it.
    def held(*words):
        return elastic.holders([(p, q, True) for p, q in words[:-1]], words[-1])

    assert held(((1, 2), 0), ((1, 2), 1), ((1, 2), 0), 2) == ((1, 2), [0, 1])
    # stage 0's update for step 3 came before the loss on one survivor: step 2, from the other
    assert held(((1, 3), 0), ((1, 2), 1), ((1, 2), 0), 2) == ((1, 2), [2, 1])
    assert held((None, 0), (None, 0), 1) == (None, [0])
    assert held(((0, 4), 0), ((0, 5), 0), ((0, 3), 0), 1) == ((0, 5), [1])
    with pytest.raises(elastic.NotInPlace, match="stage 1 of 2 has no copy left"):
        held(((1, 2), 0), ((1, 2), 0), 2)
    with pytest.raises(elastic.NotInPlace, match="no step is one every stage's survivors"):
        held(((1, 3), 0), ((1, 2), 1), 2)
    # the loss came while the replicas made their statistics one after a step: a survivor
    # that had not is no holder (its state that step lacks the lost replica's share)
    assert elastic.holders([((1, 3), 0, False), ((1, 3), 0, True)], 1) == ((1, 3), [1])
    with pytest.raises(elastic.NotInPlace, match="while stage 1's replicas made their state"):
        elastic.holders([((1, 3), 0, True), ((1, 3), 1, False)], 2)


def test_the_line_of_a_job_gone_on_in_place_names_the_ranks_lost_and_those_that_leave():
    from types import SimpleNamespace

    from hyparflow import Topology

    top = Topology(partitions=2, replicas=2, rank=0)
    world = SimpleNamespace(Get_size=lambda: 2)
    went = elastic.Went(world, [3], [2], (1, 1))
    assert elastic.went_on_line(went, top, 4) == (
        "hyparflow: elastic job: rank 3 (its node) lost; training goes on in place at 2 × 1 "
        "on 2 ranks from epoch 2, step 3 (the lost replicas' share of each batch taken by the "
        "others); rank 2 (its node) leaves the job (no stage for it).")
    assert elastic.went_on_line(elastic.Went(world, [3], [], None), top, 4).endswith(
        "from the call's start (the lost replicas' share of each batch taken by the others).")


def test_a_callback_that_followed_another_ranks_saves_writes_its_own_on_a_later_call(tmp_path):
    # A rank that did not write in one call (its saves joined the writer's) and writes in a
    # later one — after a loss, the survivors' first — saves as Keras does again; what the
    # user set on the callback stays.
    from types import SimpleNamespace

    from hyparflow import Topology
    from hyparflow.training import callbacks

    model = _model()
    trainer = SimpleNamespace(topology=Topology(partitions=1, replicas=2, rank=1),
                              executor=SimpleNamespace(shard=None))
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"), verbose=1)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "b"))
    backup.on_epoch_begin = mine = lambda epoch, logs=None: None  # the user's own

    def listed(writes):
        return callbacks.callback_list(model, [checkpoint, backup], 0, 1, 1, writes, None,
                                       trainer, None)

    listed(False)
    assert "_save_model" in vars(checkpoint) and checkpoint.verbose == 0
    assert "_save_model" in vars(backup) and "on_train_end" in vars(backup)
    listed(False)  # a second call that does not write: as before
    listed(True)
    assert "_save_model" not in vars(checkpoint) and checkpoint.verbose == 1
    assert "_save_model" not in vars(backup) and "on_train_end" not in vars(backup)
    assert backup.on_epoch_begin is mine
    listed(True)  # (nothing to give back)
    assert checkpoint.verbose == 1


def test_the_survivors_agreed_word_on_the_ranks_lost_is_never_overwritten(monkeypatch, tmp_path):
    monkeypatch.setenv(elastic.ENV, str(tmp_path))
    elastic._tell_launcher([3], replace=True)  # the survivors' first, after they agreed
    elastic._tell_launcher([2, 3])  # another, on its own: a word only where none is
    assert restart.read_lost(str(tmp_path))["ranks"] == [3]
    assert sorted(os.listdir(tmp_path)) == ["lost.json"]  # no temporary file left
    os.remove(tmp_path / "lost.json")
    elastic._tell_launcher([2])
    assert restart.read_lost(str(tmp_path))["ranks"] == [2]


def test_survivors_that_agreed_on_a_loss_each_exit_instead_of_aborting(tmp_path):
    # Every survivor took part in the agreement and ends on it: each exits 1 by itself. (Under
    # ULFM, MPI_Abort after all of a node's ranks died was seen to hang mpiexec on the box.)
    import subprocess
    import sys

    script = tmp_path / "ends.py"
    script.write_text(
        "import sys\n"
        "from types import SimpleNamespace\n"
        "from mpi4py import MPI  # noqa: F401\n"
        "from hyparflow.mpi import guard\n"
        "guard.abort = lambda code=1: print('ABORTED', flush=True) or sys.exit(9)\n"
        "g = guard.Guard(None, 'rank 0')\n"
        "g.world = SimpleNamespace(Get_size=lambda: 2, Get_rank=lambda: 0)\n"
        "told = guard.RanksLost('hyparflow: rank 1 (a) of the job failed; the job ends.')\n"
        "told.speaks, told.agreed = True, sys.argv[1] == 'agreed'\n"
        "g.fail(told)\n")
    for how, code, aborted in (("agreed", 1, False), ("alone", 9, True)):
        done = subprocess.run([sys.executable, str(script), how], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == code and ("ABORTED" in done.stdout) == aborted, done
        assert done.stderr.count("rank 1 (a) of the job failed") == 1, done.stderr
