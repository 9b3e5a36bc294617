"""Multi-rank tier: hf.fit under the real mpiexec
matches single-process Keras, and fails cleanly."""

import re

import pytest

from mpi.launch import launch


def _run(label, P, R, *more, steps=5, batch_size=16):
    return ["--label", label, "--partitions", P, "--replicas", R, "--steps", steps,
            "--batch-size", batch_size, *more]


# The runs of train_equivalence.py, one launch per job size (a launch costs more than a run;
# each run trains a fresh model and checks it against model.fit). "{folder}": a temporary
# folder of the test module.
SHARED = {
    1: [_run("plain", 1, 1), _run("text", 1, 1, "--model", "text", "--varlen", "generator",
                                   batch_size=8)],
    2: [_run("plain", 2, 1), _run("gpipe", 2, 1, "--schedule", "gpipe"),
        _run("text", 2, 1, "--model", "text", "--varlen", "dataset", "--step-graph",
             batch_size=8),
        _run("bert", 2, 1, "--model", "bert", "--balance", "flops", steps=3, batch_size=8),
        # no schedule or balance given: a short call and a long one (300 steps planned, a
        # callback stopping it after 5, as it stops model.fit's)
        _run("defaults short", 2, 1, "--defaults"),
        _run("defaults long", 2, 1, "--defaults", "--stop-after", 5, steps=300)],
    3: [_run("multi_io", 3, 1, "--model", "multi_io", "--balance", "3,3,2", steps=4),
        _run("densenet", 3, 1, "--model", "densenet", "--balance", "params", steps=4),
        *(_run(f"trace {s}", 3, 1, "--microbatches", 4, "--schedule", s, "--trace",
               f"{{folder}}/{s}.json", "--epochs", 2, "--validation", steps=2)
          for s in ("1f1b", "gpipe"))],
    4: [  # the first run pretends the ranks were dealt round-robin onto two nodes: every
          # later run of the launch trains on the regrouped ranks too
        _run("nodes", 2, 2, "--nodes", 2, steps=3),
        _run("plain", 2, 2), _run("plain", 4, 1),
        _run("gpipe recompute", 2, 2, "--schedule", "gpipe", "--recompute"),
        _run("recompute", 4, 1, "--recompute"),
        _run("multi_io", 2, 2, "--model", "multi_io", "--balance", "3,5", steps=4),
        _run("densenet", 2, 2, "--model", "densenet", "--balance", "time", steps=4),
        _run("weighted", 2, 2, "--model", "multi_io", "--balance", "3,5", "--epochs", 2,
             "--weighted", "--validation", "--tail", 5, steps=3),
        _run("zb-h1", 2, 2, "--schedule", "zb-h1", "--step-graph", "--microbatches", 4,
             "--model", "densenet", "--balance", "params", "--tail", 5, steps=3),
        _run("dataset", 2, 2, "--tail", 5, "--epochs", 2, "--dataset", "--weighted",
             "--validation", "--model", "branch_merge", "--balance", "params", steps=3),
        _run("uneven", 2, 2, "--microbatches", 3, "--tail", 5, "--model", "branch_merge",
             "--balance", "params", steps=3),
        # token batches each padded to its own length; the 4-stage cut falls between the
        # masking embedding and the attention that reads its mask
        _run("text", 2, 2, "--model", "text", "--varlen", "generator", "--microbatches", 2,
             batch_size=8),
        _run("text", 4, 1, "--model", "text", "--varlen", "dataset", "--recompute",
             batch_size=8),
        # (the zero-bubble schedule brings its step graph without being told)
        _run("text zb-h1", 2, 2, "--model", "text", "--varlen", "dataset", "--schedule",
             "zb-h1", "--microbatches", 2, "--tail", 3, batch_size=8),
        # a nested functional model called on the masked embedding, cut through: the masks
        # Keras passes inside it at run time only cross the cuts too
        _run("masked encoder", 4, 1, "--model", "masked_encoder", "--varlen", "generator",
             batch_size=8),
        _run("words", 2, 2, "--model", "words", "--balance", "time", steps=3),
        # keras-hub task models cut through their backbones; GPT-2's and Gemma's token
        # embedding is tied across the first and the last stage
        _run("gpt2", 2, 2, "--model", "gpt2", "--balance", "flops", steps=3, batch_size=8),
        _run("gemma", 4, 1, "--model", "gemma", "--balance", "flops", "--step-graph", steps=3,
             batch_size=8),
        _run("tied", 4, 1, "--model", "tied", "--schedule", "zb-h1", "--step-graph",
             steps=4)],
    8: [_run("plain", 4, 2), _run("gpipe", 4, 2, "--schedule", "gpipe")],
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """`shared(ranks)`: the output of the one launch that makes SHARED[ranks]'s runs, and
    its folder; the launch fails every test that reads it."""
    folder = tmp_path_factory.mktemp("shared")
    done = {}

    def output(ranks):
        if ranks not in done:
            words = []
            for run in SHARED[ranks]:
                words += (["--then"] if words else []) + [
                    str(w).format(folder=folder) for w in run]
            done[ranks] = launch(ranks, "train_equivalence.py", *words,
                                 timeout=120 + 60 * len(SHARED[ranks]))
        code, out, err, _ = done[ranks]
        assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
        return out, folder

    return output


@pytest.mark.parametrize("P, R", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_matches_single_process_keras(shared, P, R):
    out, _ = shared(P * R)
    assert f"[plain] EQUIVALENT P={P} R={R} steps=5 schedule=1f1b recompute=False" in out


def test_the_defaults_weigh_the_step_graphs_first_call_against_the_steps_it_runs(shared):
    # A call of a few steps runs 1F1B on the executor, cut by FLOPs (nothing to compile
    # beyond tracing); one planning 300 steps the interleaved schedule in the step graph, cut
    # by measured time, the longer first call repaid. Both train as model.fit does (the long
    # one stopped by a callback after 5 steps, as model.fit is); rank 0 says once, in one
    # line, what it chose and why.
    out, _ = shared(2)
    short = re.findall(r"^hyparflow: 2 stages × 1 replica, 1F1B on the executor, m = 2, cut "
                       r"\d+\|\d+ calls by 'flops' \(the defaults for 5 steps: the step graph "
                       r"and a measured cut repay their longer first call after ~300\)$", out,
                       re.MULTILINE)
    assert len(short) == 1, out
    assert "[defaults short] EQUIVALENT P=2 R=1 steps=5 schedule=(defaults)" in out
    long = re.findall(r"^hyparflow: 2 stages × 1 replica, interleaved 1F1B \(2 stages a "
                      r"rank\) in the step graph, m = 2, cut \d+\|\d+\|\d+\|\d+ calls by 'time' "
                      r"\(the defaults for 300 steps: ", out, re.MULTILINE)
    assert len(long) == 1, out
    assert "[defaults long] EQUIVALENT P=2 R=1 steps=5 schedule=(defaults)" in out


@pytest.fixture(scope="module")
def two_interop(tmp_path_factory):
    """One 2-rank launch with two TensorFlow inter-op threads per rank (a gradient bucket's
    hand-over op runs beside the backward): hf.fit("auto") on two pretended nodes, then a
    data-parallel run with its gradient buckets traced, then two stages with the step graph
    and the schedule and micro-batches "auto" chose. Its output, or the test fails."""
    trace = tmp_path_factory.mktemp("buckets") / "run.json"
    code, out, err, _ = launch(2, "train_equivalence.py",
                               *_run("auto", "auto", "auto", "--nodes", 2, "--weight-decay",
                                     0.05, steps=3),
                               "--then", *_run("buckets", 1, 2, "--model", "wide_mlp",
                                               "--buckets", "--trace", trace, steps=4,
                                               batch_size=64),
                               "--then", *_run("auto_step_graph", 2, "auto", "--step-graph",
                                               "--schedule", "auto", steps=3),
                               "--then", *_run("auto_memory", "auto", "auto", "--model",
                                               "wider_mlp", "--memory-cut", "--microbatches",
                                               2, steps=2),
                               env={"TF_NUM_INTEROP_THREADS": "2"}, timeout=240)
    assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
    return out


def test_data_parallel_reduces_gradient_buckets_during_the_backward_exactly(two_interop):
    # 1 × 2 (data parallel) matches Keras; its gradients are summed in buckets, each
    # started as the last backward hands it over (two inter-op threads let TensorFlow run
    # the hand-over ops beside the backward): the trace shows a bucket's allreduce
    # starting before the backward ends, and the same training with one allreduce after
    # the backward ($HYPARFLOW_BUCKET_MB=0) ends with the same weights, bit for bit.
    assert "[buckets] EQUIVALENT P=1 R=2 steps=4" in two_interop
    assert "BUCKETS OVERLAP THE BACKWARD AND SUM AS ONE ALLREDUCE" in two_interop


@pytest.mark.parametrize("P, R, schedule, recompute", [
    (2, 1, "gpipe", False), (4, 2, "gpipe", False), (2, 2, "gpipe", True), (4, 1, "1f1b", True)])
def test_every_schedule_with_and_without_recompute_matches_keras(shared, P, R, schedule,
                                                                 recompute):
    out, _ = shared(P * R)
    label = " ".join([schedule] * (schedule == "gpipe") + ["recompute"] * recompute)
    assert (f"[{label}] EQUIVALENT P={P} R={R} steps=5 schedule={schedule} "
            f"recompute={recompute}") in out


@pytest.mark.parametrize("model, P, R", [
    ("multi_io", 3, 1), ("multi_io", 2, 2), ("densenet", 3, 1), ("densenet", 2, 2)])
def test_multi_input_output_and_densenet_match_keras(shared, model, P, R):
    # multi_io: two inputs (one read only by a later stage), two outputs with their own
    # losses, loss_weights and metrics, one produced on stage 0 and sent to the last;
    # densenet: many tensors cross each cut (split by layers given, params, measured time).
    out, _ = shared(P * R)
    assert f"[{model}] EQUIVALENT P={P} R={R} steps=4" in out


def test_sample_weights_and_validation_data_match_keras(shared):
    # Two epochs of a two-input/two-output model at 2 × 2 with per-sample weights and a
    # smaller last batch (each output's loss in the logs counts it as one step, as
    # Model.fit does), each followed by a pipelined validation on weighted data with its
    # own batch size.
    out, _ = shared(4)
    assert "[weighted] EQUIVALENT P=2 R=2 steps=8" in out


def test_the_zero_bubble_schedule_matches_keras(shared):
    # ZB-H1 with the step graph at 2 × 2: every backward split in B (partial errors) and W
    # (weight gradients, later), a DenseNet's concatenations and BatchNormalization across
    # the cut, buckets reduced over the replicas from the last W, a smaller last batch
    out, _ = shared(4)
    assert "[zb-h1] EQUIVALENT P=2 R=2 steps=4 schedule=zb-h1" in out


def test_a_shuffled_weighted_dataset_with_a_smaller_last_batch_matches_keras(shared):
    # tf.data batches of 16 (the last of 5), shuffled with a seed and reshuffled every
    # epoch, with sample weights; validation from a dataset too. Each rank keeps only
    # its replica's share of what its stage reads.
    out, _ = shared(4)
    assert "[dataset] EQUIVALENT P=2 R=2 steps=8" in out


@pytest.mark.parametrize("P, R, label", [(1, 1, "text"), (2, 1, "text"), (2, 2, "text"),
                                         (4, 1, "text"), (2, 2, "text zb-h1"),
                                         (4, 1, "masked encoder")])
def test_variable_length_token_batches_match_keras_without_retracing_per_length(shared, P, R,
                                                                              label):
    # A masked embedding, attention and pooling over (batch, length, width) tensors, each
    # batch padded to its own length (3 to 12) from a generator or a tf.data padded_batch:
    # tensors of unknown length cross every cut with their shapes, masks travel with the
    # tensors they belong to, and no stage function (nor step graph) traces more often
    # than Keras' train step (checked in the run); evaluate and predict on the same batches.
    out, _ = shared(P * R)
    assert re.search(rf"\[{label}\] EQUIVALENT P={P} R={R} steps=\d+ ", out), out[-3000:]


@pytest.mark.parametrize("P, R, label", [(2, 1, "bert"), (2, 2, "gpt2"), (4, 1, "gemma"),
                                         (4, 1, "tied")])
def test_keras_hub_transformers_and_tied_weights_pipeline_as_model_fit(shared, P, R, label):
    # GPT2CausalLM, BertTextClassifier and GemmaCausalLM built from config: their backbones
    # (functional subclasses taking a dict with a padding mask) are cut through, the
    # transformer layers spread over the stages; a token embedding called again, reversed,
    # as the output head is held by the first and the last stage and its gradients summed
    # over them (a plain Keras Dense called at both ends of a model likewise)
    out, _ = shared(P * R)
    assert re.search(rf"\[{label}\] EQUIVALENT P={P} R={R} steps=\d+ ", out), out[-3000:]


def test_raw_strings_feed_the_models_text_layer_on_every_replica(shared):
    # TextVectorization inside the model reads the sentences (numpy object arrays), split
    # over the replicas like any input; only its token ids and what follows cross the cut,
    # which "time" places after timing pieces fed with strings
    out, _ = shared(4)
    assert "[words] EQUIVALENT P=2 R=2 steps=3 " in out


def test_recompute_and_a_measured_split_keep_batchnorm_and_dropout_exact():
    code, out, err, _ = launch(2, "recompute_same.py", timeout=180)
    assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
    assert "RECOMPUTE MATCHES" in out


def test_uneven_microbatches_and_a_smaller_last_batch_match_keras(shared):
    # 16 samples per step over 2 replicas → 8 each, cut into 3 micro-batches (3, 3, 2);
    # then a last batch of 5 samples: replicas get 3 and 2, micro-batches of 1.
    out, _ = shared(4)
    assert "[uneven] EQUIVALENT P=2 R=2 steps=4 schedule=1f1b" in out


def test_ranks_dealt_round_robin_onto_nodes_are_regrouped_so_pipelines_stay_on_a_node(shared):
    # World ranks 0, 2 on node0 and 1, 3 on node1 (as `mpirun --map-by node` places
    # them): numbered as launched, both pipelines would cross nodes on every micro-batch.
    out, _ = shared(4)
    assert "hyparflow placement: node node0: world ranks 0, 2 → replica 0 stages 0-1\n" in out
    assert "hyparflow placement: node node1: world ranks 1, 3 → replica 1 stages 0-1\n" in out
    assert "hyparflow placement: 2 nodes, 4 ranks; 2 of 2 pipelines within one node" in out
    assert "[nodes] EQUIVALENT P=2 R=2 steps=3" in out


def test_auto_partitions_and_replicas_match_keras_whatever_the_planner_picks(two_interop):
    # rank 0 measures the model alone, both time it at once (contention), every rank
    # follows the same choice of P × R and m; on two (pretended) nodes the link between
    # them is measured and priced. The optimizer decays its weights: timing its update
    # must not move rank 0's weights, which every rank takes
    out = two_interop
    assert re.search(r"hf\.plan: between nodes \d+\.\d µs one way, \d+ MB/s, an allreduce "
                     r"\d+ MB/s \(measured\)", out), out
    assert out.count("hf.plan: fastest predicted") == 2  # rank 0 reports, here and in the
    # memory run below (the step graph's plans at verbose=0)
    assert "[auto] EQUIVALENT P=auto R=auto steps=3" in out
    # the planner priced the step graph (no hand-off) and chose among 1F1B, GPipe and the
    # interleaved schedule, and its choice trains as Keras does
    assert "[auto_step_graph] EQUIVALENT P=2 R=auto steps=3" in out


def test_auto_cuts_a_model_too_big_for_one_rank_without_being_told(two_interop):
    # a rank may use less than the model needs whole, more than half of it
    # ($HYPARFLOW_MEMORY_PER_RANK): the planner keeps only what fits, and hf.fit("auto")
    # cuts the model in two where data parallelism would be fastest; trained as Keras does
    out = two_interop
    assert re.search(r"hf\.plan: \d+ configurations left out, predicted above the \d+\.\d\d GiB "
                     r"a rank may use \(\$HYPARFLOW_MEMORY_PER_RANK\)", out), out
    assert "[auto_memory] CHOSE P=2 R=1" in out
    # rank 0 says what it chose, once, in one line
    chose = re.findall(r"^hyparflow: 2 stages × 1 replica, 1F1B on the executor, m = 2, cut "
                       r"\d+\|\d+ calls by '\w+'; predicted \d+\.\d\d× one process$", out,
                       re.MULTILINE)
    assert len(chose) == 1, out
    assert "[auto_memory] EQUIVALENT P=auto R=auto steps=2" in out


def test_wrong_world_size_fails_on_every_rank_before_training():
    code, out, err, _ = launch(3, "bad_world.py", timeout=120)
    assert code != 0
    for rank in range(3):
        assert (f"rank {rank} raised: partitions=2 × replicas=2 = 4, but the job has 3 MPI "
                f"ranks. Launch with -n 4, or choose partitions × replicas = 3.") in out


def test_every_rank_holds_the_same_trained_model_including_batchnorm_statistics(tmp_path):
    code, out, err, _ = launch(4, "same_weights_everywhere.py", tmp_path, timeout=180)
    assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
    assert "SAME WEIGHTS ON ALL RANKS" in out
    # TensorBoard wrote from one rank: one event file for training, one for validation;
    # with embeddings_freq=1 the model's weights at each epoch's end (the job aborted: the
    # save was collective, made on the writing rank only)
    events = sorted(p.parent.name for p in tmp_path.rglob("events.out.tfevents.*"))
    assert events == ["train", "validation"], events
    epochs = int(re.search(r"^EPOCHS (\d+)", out, re.M).group(1))
    saved = sorted(p.name for p in (tmp_path / "train").glob("keras_embedding.ckpt-*"))
    assert saved == sorted(f"keras_embedding.ckpt-{e}.weights.h5" for e in range(epochs)), saved


def _order(document, rank, step):
    """The actions a rank ran in one step, from its trace, as "1F0"-style names."""
    spans = sorted((e["ts"], e["cat"], e["args"]["microbatch"]) for e in document["traceEvents"]
                   if e.get("ph") == "X" and e["tid"] == rank and e["args"]["step"] == step)
    names = []
    for _, kind, i in spans:
        stage = rank % document["otherData"]["partitions"]
        if kind in ("forward", "forward+backward"):
            names.append(f"{stage}F{i}")
        if kind in ("backward", "forward+backward"):
            names.append(f"{stage}B{i}")
    return names


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_trace_shows_every_rank_running_its_schedule(shared, tmp_path, schedule):
    import json

    from hyparflow import trace
    from hyparflow.engine import schedule as S

    # 2 epochs of 2 steps, validation after each: a trace's steps are the 4 training steps
    out, folder = shared(3)
    assert f"[trace {schedule}] EQUIVALENT P=3 R=1 steps=4" in out
    path = folder / f"{schedule}.json"
    document = json.loads(path.read_text())
    assert document["otherData"] == {"partitions": 3, "replicas": 1, "microbatches": 4,
                                     "schedule": schedule}
    expected = S.build(schedule, 3, 4)
    for rank in range(3):
        for step in range(4):
            assert _order(document, rank, step) == [str(a) for a in expected[rank]]
    assert {e["args"]["step"] for e in document["traceEvents"] if e.get("ph") == "X"} == {
        0, 1, 2, 3}
    kinds = {e["cat"] for e in document["traceEvents"] if e.get("ph") == "X"}
    assert {"forward", "backward", "forward+backward", "recv wait", "optimizer"} <= kinds
    measured, ideal = trace.bubble(document, step=1)
    assert ideal == pytest.approx(2 / 6) and 0 < measured < 1
    trace.draw(document, tmp_path / "run.png")
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
