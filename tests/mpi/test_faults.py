"""Multi-rank tier: one fault on one rank ends the whole job quickly, and says what and where."""

import re
import time

import pytest

from mpi.launch import launch

RANK1 = "rank 1 (replica 0, stage 1)"
RANK0 = "rank 0 (replica 0, stage 0)"


def _seconds_after_fault(out, ended):
    """Seconds from the FAULT line the faulty rank printed to the end of the job."""
    match = re.search(r"^FAULT (\d+\.\d+)$", out, re.M)
    assert match, out
    return ended - float(match.group(1))


def _run(*args, timeout=180, plain=False):
    code, out, err, _ = launch(2, "faults.py", *args, timeout=timeout, plain=plain)
    return code, out, err, time.time()


@pytest.mark.parametrize("swallow, plain", [(False, False), (True, False), (False, True)])
def test_an_exception_on_one_rank_ends_the_job_with_one_traceback(swallow, plain):
    # plain: launched by a bare `mpiexec -n 2 python faults.py`, not hyparflow-run.
    code, out, err, ended = _run("--fault", "exception", "--rank", 1, "--step", 2,
                                 *(["--swallow"] if swallow else []), plain=plain)
    assert code != 0, out + err
    assert _seconds_after_fault(out, ended) < 30
    # The failing rank's traceback, once, every line prefixed with where it ran.
    assert err.count(f"[{RANK1}] Traceback (most recent call last):") == 1, err
    assert f"[{RANK1}] RuntimeError: injected failure on rank 1 at step 2" in err
    # The other rank: one line naming the failed rank.
    assert (f"hyparflow: {RANK1} failed: RuntimeError: injected failure on rank 1 at step 2 — "
            f"{RANK0} stops too.") in err, err
    # Inside a larger program that catches exceptions, fit still ends the job itself.
    assert "SWALLOWED" not in out and "STEPS" not in out


def test_the_other_ranks_notice_carries_the_root_cause_of_a_tensorflow_error():
    code, out, err, _ = _run("--fault", "label", "--step", 2)
    assert code != 0
    assert err.count("Traceback (most recent call last)") == 1, err
    assert (f"hyparflow: {RANK1} failed: InvalidArgumentError: Received a label value of 3 which "
            "is outside the valid range of [0, 3).") in err, err[-5000:]
    assert f"— {RANK0} stops too." in err


def test_an_exception_in_a_layer_while_tracing_ends_the_job():
    code, out, err, _ = _run("--fault", "layer", "--rank", 1)
    assert code != 0
    assert f"[{RANK1}] ValueError: " in err and "injected failure in a layer on rank 1" in err
    assert f"hyparflow: {RANK1} failed: ValueError:" in err


def test_a_rank_killed_mid_step_ends_the_job():
    code, out, err, ended = _run("--fault", "kill", "--rank", 1, "--step", 2)
    assert code != 0
    assert _seconds_after_fault(out, ended) < 60
    assert "STEPS" not in out


@pytest.mark.parametrize("graph", [[], ["--step-graph"]])
def test_a_mismatched_message_trips_the_watchdog_with_a_report(graph):
    # with the step graph, the wait and its report come from inside the graph
    code, out, err, ended = _run("--fault", "mismatch", "--rank", 0, "--step", 2,
                                 "--timeout", 3, *graph)
    assert code != 0
    assert _seconds_after_fault(out, ended) < 3 + 30
    assert f"hyparflow watchdog: {RANK1} waited " in err, err
    # rank 1 is the last stage: its forward and backward run as one action
    assert f"for the activations 'dense1' of micro-batch 0 (action 1FB0) from {RANK0}" in err
    assert "<-- waiting: 1FB0" in err  # the schedule grid with the waiting action marked
    assert f"hyparflow: {RANK1} failed: its watchdog timed out" in err


def test_terminate_on_nan_stops_every_rank_at_the_same_step():
    code, out, err, _ = _run("--fault", "nan", "--step", 3)
    assert code == 0, err[-3000:]
    steps = sorted(re.findall(r"^STEPS (\d) (\d+)", out, re.M))
    assert steps == [("0", "4"), ("1", "4")], out  # batches 0..3, stopped after the NaN
    assert (out + err).count("Batch 3: Invalid loss, terminating training") == 1, out + err


@pytest.mark.parametrize("fault, message", [
    # rank 1 drops 8 samples
    ("samples", "hf.fit got different numbers of samples on different ranks: 96 on ranks [0]; "
                "88 on ranks [1]."),
    # rank 1 passes partitions="auto", rank 0 a number: both fail before anyone plans
    ("auto", "hf.fit got different partitions, replicas, microbatches, batch_size or "
             "schedule on different ranks"),
])
def test_ranks_called_differently_fail_together_before_training(fault, message):
    code, out, err, _ = _run("--fault", fault, "--rank", 1)
    assert code != 0
    for r in (0, 1):
        assert f"rank {r} raised: {message}" in out + err, out + err


def test_a_dataset_shuffled_differently_on_each_rank_is_caught_at_the_first_batch():
    code, out, err, _ = _run("--fault", "shuffle", "--replicas", 2, "--partitions", 1)
    assert code != 0
    assert ("the tf.data.Dataset gave different ranks different batches (batch 0 of this pass"
            in err), err[-3000:]
    assert "seed its shuffle (dataset.shuffle(n, seed=...))" in err
    assert "STEPS" not in out


@pytest.mark.parametrize("plain", [False, True])
def test_an_exception_after_fit_ends_the_job_while_the_others_wait_in_a_collective(plain):
    # Outside hf.fit no watchdog runs: the abort hook `import hyparflow` installs (or
    # hyparflow-run's `python -m mpi4py`) must end the job, also under a bare mpiexec.
    code, out, err, ended = _run("--fault", "after", "--rank", 1, plain=plain)
    assert code != 0
    assert _seconds_after_fault(out, ended) < 30
    assert "RuntimeError: injected failure after fit on rank 1" in err
    assert "SAVED" not in out


def test_a_save_called_on_one_rank_only_is_reported_by_the_watchdog():
    code, out, err, ended = _run("--fault", "save", "--rank", 0, "--timeout", 3)
    assert code != 0
    assert _seconds_after_fault(out, ended) < 3 + 30
    assert "waited 3 s (limit 3 s) for every rank to call hf.save" in err, err[-3000:]
    assert "call it on every rank, like hf.fit" in err
    assert "SAVED" not in out


def test_ranks_in_different_calls_get_one_error_at_once():
    # rank 0 saves alone (the Horovod habit), then every rank evaluates: the collectives of
    # the two calls matched each other and the job hung until the watchdog (600 s)
    code, out, err, ended = _run("--fault", "save-evaluate", "--rank", 0)
    assert code == 0, f"exit {code}\n{out}\n{err[-3000:]}"  # caught: the job stays healthy
    assert _seconds_after_fault(out, ended) < 10
    for rank in (0, 1):
        assert (f"CAUGHT {rank} the ranks are in different hyparflow calls: hf.save on ranks "
                "[0]; hf.evaluate on ranks [1]. Every rank must make the same hyparflow calls "
                "(hf.fit, hf.evaluate, hf.predict, hf.save) in the same order: call hf.save on "
                "every rank too") in out, out


def test_a_model_saved_by_a_callback_on_one_rank_only_is_one_clear_error_within_seconds():
    # at P = 2 each rank holds its stage's part: the save is collective (at P = 1 any rank
    # may save alone: the numerics tier's batch_callbacks scenario)
    code, out, err, ended = _run("--fault", "save-in-fit", "--rank", 0)
    assert code != 0, out + err
    assert _seconds_after_fault(out, ended) < 30
    assert (f"hyparflow: {RANK0} failed: ValueError: model.save(") in err, err[-3000:]
    assert "during hf.fit on this rank, but not on every rank" in err, err[-3000:]
    assert "Call it on every rank at the same step" in err, err[-3000:]


@pytest.mark.parametrize("fault, what", [
    ("leave-save", "every rank to call hf.save (a save is collective: call it on every rank, "
                   "like hf.fit, and hyparflow writes from one)"),
    ("leave-fit", "every rank to make its first hyparflow call (hf.fit, hf.evaluate, "
                  "hf.predict and hf.save are collective: call them on every rank)")])
def test_a_rank_that_ends_its_script_while_another_waits_for_it_is_reported_in_seconds(
        fault, what):
    # the default timeout (600 s): the rank that left says so as its script ends
    code, out, err, ended = _run("--fault", fault, "--rank", 0)
    assert code != 0
    assert _seconds_after_fault(out, ended) < 10
    assert (f"hyparflow: rank 1 finished its script (it is exiting) while rank 0 "
            f"{'(replica 0, stage 0) ' if fault == 'leave-save' else ''}waits for {what}. "
            "Every rank must make the same hyparflow calls (hf.fit, hf.evaluate, hf.predict, "
            "hf.save) in the same order") in err, err[-3000:]
    assert "SAVED" not in out and "Traceback" not in err


@pytest.mark.parametrize("plain", [False, True])
def test_a_failure_every_rank_shares_is_printed_once(plain):
    code, out, err, ended = _run("--fault", "unwritable", plain=plain)
    assert code != 0
    assert _seconds_after_fault(out, ended) < 30
    assert err.count("Traceback (most recent call last)") == 1, err
    why = "[Errno 20] a file stands where a folder should be (writing '"
    assert f"NotADirectoryError: {why}" in err, err  # rank 0's traceback
    assert f"hyparflow: rank 1 stops on the same NotADirectoryError as every rank: {why}" in err


def test_a_failure_of_what_rank_0_computes_for_all_is_raised_on_every_rank():
    # comm.from_root (the planner's and balance="time"'s measurements): the other
    # ranks must not wait forever for rank 0's result
    code, out, err, seconds = launch(3, "root_fails.py", timeout=120)
    assert code != 0, f"{out}\n{err[-3000:]}"
    for rank in range(3):
        assert (f"rank {rank} raised: profiling failed on rank 0: ValueError: no such layer"
                in out), f"{out}\n{err[-3000:]}"
    assert "did not raise" not in out

