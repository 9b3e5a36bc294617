"""Multi-rank tier: Keras checkpoints from hf.fit are standard files, survive a kill, and resume."""

import glob
import re
import signal

import numpy as np

from mpi.launch import Streaming, launch


def _load(path):
    import keras

    model = keras.models.load_model(path)
    return model.get_weights(), [v.numpy() for v in model.optimizer.variables]


def _assert_same_model(a, b):
    (wa, oa), (wb, ob) = _load(a), _load(b)
    assert len(wa) == len(wb) and len(oa) == len(ob)
    for u, v in zip(wa + oa, wb + ob):
        np.testing.assert_allclose(v, u, rtol=1e-4, atol=1e-5)


def test_a_kill_while_saving_keeps_the_last_checkpoint_and_training_resumes_anywhere(tmp_path):
    def run(n, P, R, mode, *more):
        return launch(n, "checkpoint_resume.py", tmp_path, "--partitions", P, "--replicas", R,
                      "--mode", mode, *more, timeout=240)

    code, out, err, _ = run(4, 2, 2, "full")
    assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
    for r in range(4):
        assert f"SAVED full.keras ON RANK {r}" in out
        assert f"CSV ON RANK {r}: 5 lines" in out, out
    # One rank wrote the log: one header and four epochs, not interleaved copies.
    log = (tmp_path / "log-full.csv").read_text().splitlines()
    assert log[0].startswith("epoch,") and [line.split(",")[0] for line in log[1:]] == [
        "0", "1", "2", "3"]
    assert not (tmp_path / "backup").exists()  # BackupAndRestore removes it at the end
    full_ckpt = tmp_path / "ckpt.keras"
    _assert_same_model(full_ckpt, tmp_path / "full.keras")
    full_ckpt.rename(tmp_path / "ckpt-full.keras")

    # An elastic job (hyparflow-run --elastic, a backup at every step boundary): its last
    # rank killed after epoch 2's second step. At 2 × 1 its stage has no other copy: the
    # survivor says so, and the launcher runs the job again, which resumes after the last
    # step backed up: the same model as never stopping.
    folder = tmp_path / "elastic"

    def elastic(P, R, *more):
        (tmp_path / "elastic-died").unlink(missing_ok=True)
        return launch(P * R, "checkpoint_resume.py", tmp_path, "--partitions", P, "--replicas",
                      R, "--mode", "elastic", *more, timeout=240,
                      launcher=["--elastic", "--elastic-dir", folder, "--backup-every", 0])

    code, out, err, _ = elastic(2, 1)
    assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
    assert out.count("KILLING RANK 1") == 1, out
    assert err.count("training cannot go on in place") == 1 and re.search(
        r"^hyparflow: rank 1 \(\S+\) of the job failed; training cannot go on in place: at "
        r"partitions=2 the lost rank's stage has no copy left\. The job ends\. hyparflow-run "
        r"--elastic runs it again from its backup\.$", err, re.MULTILINE), err[-5000:]
    restarts = re.findall(r"^hyparflow-run: elastic restart .*$", err, re.MULTILINE)
    assert len(restarts) == 1 and re.fullmatch(
        r"hyparflow-run: elastic restart 1 of 3: world rank 1 \(node \S+\) failed; running "
        r"again on 2 ranks \(2 × 1\), from the backup after epoch 2, step 1\.", restarts[0]), \
        err[-5000:]
    _assert_same_model(tmp_path / "ckpt-full.keras", tmp_path / "elastic.keras")
    assert not folder.exists(), "the job ended well: its backups are removed"
    def in_place(P, R, killed, after, saved):
        """The job loses rank `killed` and goes on in place (no restart) at P × R'; the line
        ends with `after` (a pattern); the ranks `saved` end the script; the same model as
        never stopping."""
        (tmp_path / "elastic.keras").unlink()
        code, out, err, _ = elastic(P, R, "--kill-rank", killed)
        assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
        assert out.count(f"KILLING RANK {killed}") == 1 and "elastic restart" not in err, \
            out + err[-5000:]
        went = re.findall(r"^hyparflow: elastic job: .*$", err, re.MULTILINE)
        left = P * ((P * R - 1) // P)
        assert len(went) == 1 and re.fullmatch(
            rf"hyparflow: elastic job: rank {killed} \(\S+\) lost; training goes on in place at "
            rf"{P} × {left // P} on {left} ranks from epoch 2, step 3 \(the lost replicas' share "
            rf"of each batch taken by the others\){after}", went[0]), err[-5000:]
        assert "NBC_Progress" not in err and "Traceback" not in err, err[-5000:]
        assert [r for r in range(P * R) if f"SAVED elastic.keras ON RANK {r}" in out] == saved, out
        _assert_same_model(tmp_path / "ckpt-full.keras", tmp_path / "elastic.keras")
        assert not folder.exists()

    # Data parallel 1 × 3 losing rank 0 (the one that writes): the other two go on in place
    # at 1 × 2 from the step they reached (no restart), the same model as never stopping.
    in_place(1, 3, 0, r"\.", [1, 2])
    # Hybrid 2 × 2 losing rank 1 (stage 1 of replica 0): every stage keeps a copy, so the
    # survivors go on in place at 2 × 1 — rank 2 now holding stage 1, from rank 3's copy —
    # and rank 3, with no stage left for it, leaves the job (its script ends there, exit 0).
    in_place(2, 2, 1, r"; rank 3 \(\S+\) leaves the job \(no stage for it\)\.", [0, 2])

    # Killed inside the save after epoch 3: the job ends, the epoch-2 checkpoint stays.
    code, out, err, seconds = run(4, 2, 2, "killed")
    assert code != 0, out + err
    assert "KILLED WHILE SAVING" in out and seconds < 90
    import keras

    kept = keras.models.load_model(tmp_path / "ckpt.keras")  # intact, loadable by plain Keras
    assert int(kept.optimizer.iterations.numpy()) == 2 * 3
    assert glob.glob(str(tmp_path / ".tmp-*-ckpt.keras")), "the unfinished save is apart"

    # Resume from it at other P × R: same weights and optimizer state as never stopping.
    code, out, err, _ = run(2, 2, 1, "resume")
    assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
    assert "RESUMING AT EPOCH 2" in out
    _assert_same_model(tmp_path / "ckpt-full.keras", tmp_path / "resumed.keras")
    assert not glob.glob(str(tmp_path / ".tmp-*-ckpt.keras")), "the next save removes it"

    # Keras' own BackupAndRestore: a fresh model picks up where the killed run stopped,
    # pipelined (its optimizer state goes into every stage's optimizer).
    code, out, err, _ = run(2, 2, 1, "restore")
    assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
    _assert_same_model(tmp_path / "ckpt-full.keras", tmp_path / "restored.keras")

    # Preempted: rank 3 is signalled (SIGUSR1) after the first step of epoch 2; every rank
    # stops after the next, BackupAndRestore writes the steps done, the job exits 75. From
    # here on Adam's state is sharded over the replicas (shard_optimizer=True): saved whole,
    # restored into the shares, the same model at the end as the unsharded run's.
    code, out, err, _ = run(4, 2, 2, "preempted", "--shard")
    assert code == 75, f"exit {code}\n{out}\n{err[-5000:]}"
    backup = tmp_path / "backup"
    assert err.count("hyparflow: SIGUSR1 on") == 1, err[-5000:]
    assert (f"hyparflow: SIGUSR1 on rank 3 (replica 1, stage 1): stopped after epoch 2, step 2 "
            f"of 3; saved the training state through BackupAndRestore({str(backup)!r}): run "
            "the same script again to resume at the next step. Exit code 75.") in err, err
    for r in range(4):  # every rank stopped after the same step, and saved nothing else
        assert f"STEP 1 1 ON RANK {r}" in out and f"STEP 1 2 ON RANK {r}" not in out, out
    assert "SAVED" not in out and "Traceback" not in err
    assert "MPI_ABORT" not in err, "every rank agreed to stop: MPI ends normally"
    assert not glob.glob(str(backup / ".tmp-*")), "no temporary file left"
    # Run again, and stop it from outside: SIGTERM to hyparflow-run (scancel, a workflow
    # tool) reaches every rank as SIGTERM; it resumes at the next step, stops again.
    job = Streaming(4, "checkpoint_resume.py", tmp_path, "--partitions", 2, "--replicas", 2,
                    "--mode", "signalled", "--shard")
    job.read_until("STEP 2 0 ON RANK 0", timeout=180)
    job.proc.send_signal(signal.SIGTERM)
    code, lines, err, _ = job.finish(timeout=120)
    assert code == 75, f"exit {code}\n{lines}\n{err[-5000:]}"
    assert "STEP 1 2 ON RANK 0" in lines and "STEP 1 1 ON RANK 0" not in lines, lines
    assert "STEP 2 1 ON RANK 0" in lines and "STEP 2 2 ON RANK 0" not in lines, lines
    assert ("hyparflow: SIGTERM on rank 3 (replica 1, stage 1): stopped after epoch 3, step 2 "
            "of 3; saved the training state through BackupAndRestore(") in err, err[-5000:]
    # Run again, at another P × R: it resumes at the next step, as if never stopped.
    (tmp_path / "restored.keras").unlink()
    code, out, err, _ = run(2, 1, 2, "restore", "--shard")
    assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
    _assert_same_model(tmp_path / "ckpt-full.keras", tmp_path / "restored.keras")
