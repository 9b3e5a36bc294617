"""The executor in one process: the P × R ranks of a job as threads, each driving its stages of a
real model over an in-process communicator (`local_comm`), trained as `model.fit` trains.

Each rank builds its `Executor` as `trainer.make` does and feeds it its share of each global
batch (`data.Share`); the replicas' models start from the same weights as the single-process
Keras model the steps are compared with (SGD with momentum: equal up to summation order).
"""

import os
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

import local_comm
import models
from hyparflow.data import batches
from hyparflow.engine import schedule as schedule_
from hyparflow.engine.executor import Executor
from hyparflow.keras import keras_private
from hyparflow.keras import optimizers as optimizers_
from hyparflow.mpi import threads as threads_
from hyparflow.mpi.guard import FIRST_STEP_FACTOR, Guard, WatchdogTimeout
from hyparflow.mpi.topology import Topology
from hyparflow.partitioner import partition

BATCH = 12
STEPS = 3
# Float32 sums in another order (per micro-batch, per replica): a few ulps of the values,
# carried through STEPS momentum updates of weights of order 1.
RTOL, ATOL = 1e-5, 1e-6


def _compiled(make, weights=None):
    model = make()
    if weights is not None:
        model.set_weights(weights)
    logits = getattr(model.layers[-1], "activation", None) is not keras.activations.softmax
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=logits))
    return model


def _data(model, seed=0):
    rng = np.random.default_rng(seed)
    shape = (BATCH * STEPS,) + tuple(7 if d is None else d for d in model.inputs[0].shape[1:])
    if model.inputs[0].dtype.startswith("int"):  # token ids, 0 the padding a mask hides
        x = rng.integers(0, 40, shape).astype("int32")
    else:
        x = rng.normal(size=shape).astype("float32")
    return x, rng.integers(0, 3, BATCH * STEPS).astype("int32")


def _keras(make, weights, x, y):
    """Model.fit's steps, one global batch each: the losses and the weights after them."""
    keras.utils.set_random_seed(0)
    warm = _compiled(make, weights)  # the first fit of a process rounds otherwise
    warm.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    model = _compiled(make, weights)
    losses = [float(model.train_on_batch(x[k:k + BATCH], y[k:k + BATCH]))
              for k in range(0, len(x), BATCH)]
    return losses, model.get_weights()


def _ranks(target, n, timeout):
    """Run target(k) for every rank k on a thread of its own; the first error, re-raised."""
    errors = [None] * n

    def run(k):
        try:
            target(k)
        except BaseException as exc:  # (reported to the test)
            errors[k] = exc

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout * FIRST_STEP_FACTOR + 60  # past every watchdog
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a rank's thread never ended"
    return errors


def train(make, P, R, schedule="1f1b", m=2, step_graph=False, recompute=False,
          bucket_bytes=None, timeout=30.0, skip=None):
    """Train STEPS global batches on P × R thread ranks; returns (Keras' losses and weights,
    the ranks' summed losses per step, every replica's weights, the ranks' errors).

    `skip`: a rank that builds its executor but never steps (its peers must not hang)."""
    chunks = 2 if schedule == "interleaved" else 1
    inter = threads_.in_use("inter")
    assert not step_graph or inter == 0 or inter >= P * R, f"{inter} inter-op threads"
    keras.utils.set_random_seed(0)
    probe = make()
    weights = probe.get_weights()
    x, y = _data(probe)
    expected = _keras(make, weights, x, y)
    replicas = [_compiled(make, weights) for _ in range(R)]
    parts = []
    for model in replicas:
        keras_private.symbolic_build(model, x[:1], y[:1])
        parts.append(partition(model, P * chunks, balance="layers", microbatch_size=BATCH // R // m,
                               microbatches=m, schedule=schedule, chunks=chunks,
                               step_graph=step_graph))
    grid = local_comm.grid(P, R, timeout)
    world = local_comm.Job(P * R, timeout)
    losses = np.zeros((P * R, STEPS))

    def rank(k):
        topology = Topology(partitions=P, replicas=R, rank=k, chunks=chunks)
        model, part = replicas[topology.replica], parts[topology.replica]
        pipeline, stage_group = grid[k]
        held = [w for s in topology.stages for w in part.stages[s].model.trainable_variables]
        optimizer = model.optimizer if P == 1 else optimizers_.stage_copy(
            model.optimizer, held, clip_here=False)
        if P == 1:
            optimizer.build(model.trainable_variables)
        guard = Guard(world.comms[k], topology.where(), timeout, notices=False)
        executor = Executor(part, topology, pipeline if P > 1 else None,
                            stage_group if R > 1 else None, model, optimizer, guard,
                            structures=(batches.Structure("single"),) * 2 + (
                                batches.Structure("none"),),
                            labelled=[True], bucket_bytes=bucket_bytes)
        executor.configure(schedule_.by_name(schedule), recompute, step_graph)
        if k == skip:
            return
        share = batches.Share(R, m, topology.replica, executor.reads, topology.is_last_stage, P)
        data = batches.ArrayData([x], [y], None, BATCH, share)
        for step, batch in enumerate(data.batches(0)):
            sizes, xs, ys, sws = batch.parts()
            losses[k, step] = executor.train_step(sizes, xs, ys, batch.size, sws)

    errors = _ranks(rank, P * R, timeout)
    return expected, losses.sum(axis=0), [model.get_weights() for model in replicas], errors


def _assert_trains_as_keras(result, what):
    (losses, weights), ours, replicas, errors = result
    for k, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"{what}: rank {k} failed: {e!r}") from e
    np.testing.assert_allclose(ours, losses, rtol=RTOL, err_msg=f"{what}: losses")
    for r, got in enumerate(replicas):
        for a, b in zip(got, weights):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{what}: replica {r}'s weights")


def _schedule_case(schedule, step_graph, recompute):
    what = f"P=2 {schedule}{' step graph' if step_graph else ''}{' recompute' if recompute else ''}"
    _assert_trains_as_keras(train(models.residual, 2, 1, schedule, m=3, step_graph=step_graph,
                                  recompute=recompute), what)


@pytest.mark.parametrize("schedule, step_graph, recompute", [
    ("gpipe", False, False), ("1f1b", False, False), ("1f1b", True, False),
    ("1f1b", False, True), ("interleaved", False, False), ("zb-h1", True, False)])
def test_every_schedule_over_two_stages_trains_as_model_fit(schedule, step_graph, recompute):
    inter = threads_.in_use("inter")
    if not step_graph or inter == 0 or inter >= 2:
        _schedule_case(schedule, step_graph, recompute)
        return
    # Each rank's step graph holds one of TensorFlow's inter-op threads while it waits for a
    # message (a Python op), and the tests' processes have one: a child process with two.
    env = dict(os.environ, TF_NUM_INTEROP_THREADS="2")
    child = ("import hyparflow, sys; sys.path.insert(0, sys.argv[1]); import test_executor; "
             "test_executor._schedule_case(sys.argv[2], True, False)")  # (hyparflow first)
    done = subprocess.run([sys.executable, "-c", child, os.path.dirname(__file__), schedule],
                          env=env, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_replicas_of_pipelines_reduce_their_gradients_in_buckets_as_model_fit():
    # 2 × 2: gradient buckets of 256 bytes (several per stage) overlap the last backward
    _assert_trains_as_keras(train(models.residual, 2, 2, bucket_bytes=256), "2x2 buckets")


@pytest.mark.parametrize("P", [1, 2])
def test_replicas_exchange_an_embeddings_sparse_rows_and_stages_masked_sequences(P):
    # the embedding's gradient rows are gathered over the replicas, not summed densely; at
    # P = 2 the sequences (their length left open by the model) cross the cut with their
    # shapes and their masks
    _assert_trains_as_keras(train(models.text, P, 2), f"{P}x2 text")


def test_a_rank_that_never_steps_stops_its_peers_watchdog_not_hangs_it():
    (_, _), _, _, errors = train(models.chain, 2, 1, timeout=3.0, skip=1)
    assert isinstance(errors[0], WatchdogTimeout), errors
    report = str(errors[0])
    assert report.startswith("hyparflow watchdog: rank 0 (replica 0, stage 0) waited 3 s"), report
    assert "for stage 1's" in report, report
    assert errors[1] is None


def test_the_local_communicator_matches_messages_in_order_and_refuses_mismatched_collectives():
    job = local_comm.Job(2, timeout=5.0)
    a, b = job.comms
    for value in (1, 2):  # same source and tag: received in the order sent
        a.Isend(np.array([value], np.int64), dest=1, tag=3)
    first, second = np.zeros(1, np.int64), np.zeros(1, np.int64)
    local_comm.Request.Waitall([b.Irecv(first, source=0, tag=3), b.Irecv(second, 0, 3)])
    assert (first[0], second[0]) == (1, 2)
    a.Ibarrier()
    with pytest.raises(local_comm.Mismatch, match="posted bcast from 0 as collective 0 where "
                                                  "another rank posted barrier"):
        b.Ibcast(np.zeros(1), root=0)
    a.Isend(np.zeros(4, np.int64), dest=1, tag=5)
    with pytest.raises(local_comm.Mismatch, match="32 bytes from rank 0 .* receive of 8 bytes"):
        b.Irecv(np.zeros(1, np.int64), source=0, tag=5)
