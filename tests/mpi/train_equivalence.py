"""Run under mpiexec: hf.fit at (P, R) must match single-process Keras step by step.

Every rank trains with hf.fit; rank 0 also trains the same model with model.fit
in-process and compares per-step losses and the final weights of every rank's
model. Exits non-zero (aborting the job) on a mismatch. Several runs share one launch
when their arguments are separated by `--then` (launches cost more than these runs).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import hyparflow as hf


def build(name, seed, weight_decay=None):
    """The test model `name`, compiled per output: softmax → cross-entropy, else MSE; SGD with
    momentum (and `weight_decay`)."""
    import keras

    import models

    keras.utils.set_random_seed(seed)
    if name in models.HUB:  # logits: cross-entropy from logits, accuracy weighted
        model = models.HUB[name]()
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=["sparse_categorical_accuracy"])
        return model
    model = {**models.BUILDERS, **models.MORE}[name]()
    sgd = lambda: keras.optimizers.SGD(  # noqa: E731
        learning_rate=0.05, momentum=0.9, weight_decay=weight_decay)
    losses, metrics = {}, {}
    for out in model.output_names:
        softmax = getattr(model.get_layer(out), "activation", None) is keras.activations.softmax
        losses[out] = "sparse_categorical_crossentropy" if softmax else "mse"
        metrics[out] = ["accuracy"] if softmax else ["mae"]
    if len(losses) == 1:
        model.compile(optimizer=sgd(), loss=losses[out], metrics=metrics[out])
    else:
        model.compile(optimizer=sgd(), loss=losses, metrics=metrics,
                      loss_weights={o: 1.0 / (j + 1) for j, o in enumerate(losses)})
    return model


def data(model, n, seed):
    """Random inputs (strings of words for a string input) and targets, dicts keyed by name
    when the model has several."""
    import keras

    import models

    rng = np.random.default_rng(seed)
    if any(t.name == "padding_mask" for t in model.inputs):  # keras-hub: token ids of 8
        tokens = rng.integers(1, 40, size=(n, 8)).astype("int32")
        mask = (np.arange(8) < rng.integers(3, 9, size=(n, 1))).astype("int32")
        x = {"token_ids": tokens * mask, "padding_mask": mask}
        if any(t.name == "segment_ids" for t in model.inputs):
            x["segment_ids"] = np.zeros_like(tokens)
        y = np.roll(tokens * mask, -1, axis=1) if "CausalLM" in type(model).__name__ \
            else rng.integers(0, 3, size=n)  # the next tokens, or a class
        return x, y
    x = {t.name: np.array([" ".join(rng.choice(models.WORDS, rng.integers(1, 6)))
                           for _ in range(n)], dtype=object) if t.dtype == "string"
         else rng.normal(size=(n,) + tuple(t.shape[1:])).astype("float32")
         for t in model.inputs}
    y = {}
    for name, t in zip(model.output_names, model.outputs):
        if getattr(model.get_layer(name), "activation", None) is keras.activations.softmax:
            y[name] = rng.integers(0, t.shape[-1], size=n)
        else:
            y[name] = rng.normal(size=(n,) + tuple(t.shape[1:])).astype("float32")
    if len(x) == 1:
        x = next(iter(x.values()))
    if len(y) == 1:
        y = next(iter(y.values()))
    return x, y


def token_batches(n, batch_size, seed, vocab=40, classes=3):
    """n samples of token ids (1 …, then padding 0), the longest of each batch 3 to 12
    tokens, as batches each padded to its own longest sequence, and their labels."""
    rng = np.random.default_rng(seed)
    longest = [3 + 7 * b % 10 for b in range(-(-n // batch_size))]
    sequences = [rng.integers(1, vocab, size=longest[k // batch_size] if k % batch_size == 0
                              else rng.integers(1, longest[k // batch_size] + 1))
                 for k in range(n)]
    labels = rng.integers(0, classes, size=n)
    batches = []
    for start in range(0, n, batch_size):
        rows = sequences[start:start + batch_size]
        x = np.zeros((len(rows), max(len(r) for r in rows)), "int32")
        for k, r in enumerate(rows):
            x[k, :len(r)] = r
        batches.append((x, labels[start:start + batch_size]))
    return sequences, labels, batches


def varlen_inputs(kind, sequences, labels, batches, batch_size):
    """A new generator of the padded batches, or a tf.data padded_batch of the same."""
    if kind == "generator":
        return (b for b in batches)
    import tensorflow as tf

    tokens = tf.data.Dataset.from_tensor_slices(tf.ragged.constant(sequences, dtype=tf.int32))
    return tf.data.Dataset.zip((tokens, tf.data.Dataset.from_tensor_slices(labels))).map(
        lambda t, y: (t, y)).padded_batch(batch_size)


def traces(model):
    """{stage function: how many times it traced} on this rank (hf.fit's trainer)."""
    (trainer,) = model._hyparflow_trainers.values()
    out = {}
    for c in trainer.executor.chunks:
        for name in ("_forward", "_fused", "_recompute"):
            out[f"stage {c.index} {name}"] = getattr(
                c.worker, name).experimental_get_tracing_count()
    graph = trainer.executor.step_graph
    for k, function in enumerate(graph._functions.values() if graph is not None else ()):
        out[f"step graph {k}"] = function.experimental_get_tracing_count()
    if trainer.executor.whole is not None:  # one stage, each step one function
        out["whole step"] = trainer.executor.whole._function.experimental_get_tracing_count()
    return out


class Losses:
    def __init__(self, stop_after=None):
        import keras

        self.values = []

        def ended(batch, logs):
            self.values.append(logs["loss"])
            if stop_after is not None and len(self.values) >= stop_after:
                self.callback.model.stop_training = True

        self.callback = keras.callbacks.LambdaCallback(on_train_batch_end=ended)


def check_buckets(args, build, x, y, weights):
    """The same training with one allreduce after the backward gives the same weights, bit
    for bit; the trace shows each step's buckets, the first started before the backward
    ended (on every rank)."""
    import json

    from mpi4py import MPI

    os.environ["HYPARFLOW_BUCKET_MB"] = "0"
    try:
        plain = build(args.model, seed=7, weight_decay=args.weight_decay)
        hf.fit(plain, x, y, partitions=args.partitions, replicas=args.replicas,
               microbatches=args.microbatches, batch_size=args.batch_size, epochs=args.epochs,
               shuffle=False, verbose=0, balance=args.balance, schedule=args.schedule)
    finally:
        del os.environ["HYPARFLOW_BUCKET_MB"]
    for w, v, u in zip(weights, plain.get_weights(), plain.weights):
        assert np.array_equal(w, v), f"{u.path}: bucketed and plain allreduces differ"
    if args.trace is None or MPI.COMM_WORLD.Get_rank() != 0:
        return
    from hyparflow import trace

    document = json.loads(open(args.trace).read())
    spans = trace.spans_of(document)
    for rank in range(args.partitions * args.replicas):
        for step in range(args.steps * args.epochs):
            mine = [s for s in spans if s[0] == rank and s[3] == step]
            buckets = sorted(s[4] for s in mine if s[1] == "bucket")
            backward = max(s[4] + s[5] for s in mine if s[1] in trace.COMPUTE)
            assert len(buckets) > 1, f"rank {rank} step {step}: buckets {buckets}"
            assert buckets[0] < backward, (
                f"rank {rank} step {step}: the first bucket's allreduce started at "
                f"{buckets[0]:.4f} s, after the backward ended at {backward:.4f} s")
            # the wait for the buckets' sums is the allreduce's time, not compute's (at
            # P = 1 a span inside the whole step's, which holds the update too)
            _, compute = trace.step_shares(document, step, trace.COMPUTE)
            assert any(s[1] == "allreduce" for s in mine) and compute[rank] < 1, (
                f"rank {rank} step {step}: the wait for the buckets has no span of its own")
    print(f"BUCKETS OVERLAP THE BACKWARD AND SUM AS ONE ALLREDUCE "
          f"({len(buckets)} buckets)", flush=True)


def between_one_and_two_stages(model, batch_size):
    """Bytes halfway between the least a rank is predicted to need holding `model` whole and
    cut in two on two ranks (the planner's memory terms; this process's memory as the base)."""
    from hyparflow import planner
    from hyparflow.mpi import memory
    from hyparflow.partitioner.graph import LayerGraph

    graph = LayerGraph(model)
    profile = planner.Profile.for_memory(graph, memory.resident())
    least = {P: min(planner.predict(graph, profile, P, 2 // P, m, batch_size).memory_bytes
                    for m in (1, 2, 4, 8) if batch_size // (2 // P * m) >= 1) for P in (1, 2)}
    assert least[2] < least[1], least
    return (least[1] + least[2]) / 2


def parser():
    p = argparse.ArgumentParser()
    whole_or_auto = lambda v: v if v == "auto" else int(v)  # noqa: E731
    p.add_argument("--partitions", type=whole_or_auto, required=True)
    p.add_argument("--replicas", type=whole_or_auto, required=True)
    p.add_argument("--model", default="conv_residual")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--balance", default="layers",
                   help="a method, or comma-separated layer counts per stage")
    p.add_argument("--tail", type=int, default=0, help="extra samples: a smaller last batch")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--step-graph", action="store_true", default=None,
                   help="hf.Schedule(step_graph=True); else left out (hyparflow's choice)")
    p.add_argument("--defaults", action="store_true",
                   help="leave schedule and balance out (hyparflow's defaults for the job); "
                        "rank 0 prints its choice")
    p.add_argument("--stop-after", type=int, default=None,
                   help="a callback stops training after this many steps (model.stop_training), "
                        "in hf.fit and model.fit alike: the call still plans all its steps")
    p.add_argument("--trace", default=None, help="write hf.fit's timeline here (hf.Trace)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--weight-decay", type=float, default=None,
                   help="the SGD optimizer's weight_decay (both models)")
    p.add_argument("--weighted", action="store_true", help="train with sample weights")
    p.add_argument("--validation", action="store_true",
                   help="validation_data (weighted too with --weighted) after every epoch")
    p.add_argument("--dataset", action="store_true",
                   help="feed x, y (and weights) as a tf.data.Dataset of batches, shuffled with "
                        "a seed; validation data too")
    p.add_argument("--varlen", choices=["generator", "dataset"], default=None,
                   help="token batches each padded to its own length (the text model), from "
                        "a generator or a tf.data padded_batch; also checks that no stage "
                        "function retraces for a new length more often than Keras' train step")
    p.add_argument("--buckets", action="store_true",
                   help="also train with $HYPARFLOW_BUCKET_MB=0 (one allreduce after the "
                        "backward): the weights must be the same bit for bit; with --trace, "
                        "every step's buckets must be reduced, one starting inside the backward")
    p.add_argument("--report", action="store_true",
                   help="print hf.fit's placement report (verbose=2)")
    p.add_argument("--memory-cut", action="store_true",
                   help="set $HYPARFLOW_MEMORY_PER_RANK between what a rank is predicted to "
                        "need holding the model whole and holding half of it (this rank's "
                        "memory now as the base), and print the P × R hf.fit chose")
    p.add_argument("--label", default=None,
                   help="printed before EQUIVALENT, to tell the runs of one launch apart")
    p.add_argument("--nodes", type=int, default=None,
                   help="pretend the ranks were dealt round-robin onto this many nodes "
                        "($HYPARFLOW_NODE), and print hf.fit's placement report")
    return p


def main():
    """Each run given, one after the other, each with a fresh model (built on every rank, so
    that Keras' automatic names stay alike)."""
    groups, group = [], []
    for word in sys.argv[1:]:
        if word == "--then":
            groups.append(group)
            group = []
        else:
            group.append(word)
    for number, words in enumerate(groups + [group]):
        args = parser().parse_args(words)
        assert not args.nodes or number == 0, "--nodes works in the first run only"
        run(args)


def run(args):
    if args.nodes:  # before hyparflow's first collective call reads it
        os.environ["HYPARFLOW_NODE"] = f"node{int(os.environ['OMPI_COMM_WORLD_RANK']) % args.nodes}"
    if "," in args.balance:
        args.balance = [int(b) for b in args.balance.split(",")]
    from keras.src import tree
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    model = build(args.model, seed=7, weight_decay=args.weight_decay)
    n = args.steps * args.batch_size + args.tail
    if args.varlen:
        sequences, labels, batches = token_batches(n, args.batch_size, seed=3)
        assert len({b[0].shape[1] for b in batches}) > 2, "the lengths should vary"
        x, y = batches[0]
    else:
        x, y = data(model, n, seed=3)
    rng = np.random.default_rng(5)
    extra = {}
    if args.weighted:
        extra["sample_weight"] = rng.uniform(0.2, 2.0, n).astype("float32")
    if args.validation:
        xv, yv = data(model, 2 * args.batch_size, seed=4)
        extra["validation_data"] = (xv, yv, rng.uniform(0.2, 2.0, 2 * args.batch_size)) \
            if args.weighted else (xv, yv)
        extra["validation_batch_size"] = args.batch_size // 2
    def inputs():
        """fit's data arguments: arrays, or a new dataset (every rank and Keras alike)."""
        if args.varlen:
            return (varlen_inputs(args.varlen, sequences, labels, batches, args.batch_size),), {}
        if not args.dataset:
            return (x, y), dict(extra, batch_size=args.batch_size)
        import tensorflow as tf

        parts = (x, y, extra["sample_weight"]) if args.weighted else (x, y)
        train = tf.data.Dataset.from_tensor_slices(parts).shuffle(n, seed=11).batch(
            args.batch_size)
        more = {}
        if args.validation:
            val = tf.data.Dataset.from_tensor_slices(extra["validation_data"])
            more["validation_data"] = val.batch(extra["validation_batch_size"])
        return (train,), more

    ours = Losses(args.stop_after)
    data_args, data_kwargs = inputs()
    if args.memory_cut:
        os.environ["HYPARFLOW_MEMORY_PER_RANK"] = str(between_one_and_two_stages(
            model, args.batch_size) / 2**30)
    history = hf.fit(model, *data_args, partitions=args.partitions, replicas=args.replicas,
                     microbatches=args.microbatches, epochs=args.epochs, shuffle=False,
                     verbose=2 if args.nodes or args.report or args.partitions == "auto"
                     or args.defaults else 0,
                     callbacks=[ours.callback] + ([hf.Trace(args.trace)] if args.trace else []),
                     **({} if args.defaults else dict(balance=args.balance, schedule=hf.Schedule(
                         args.schedule, step_graph=args.step_graph))),
                     recompute=args.recompute, **data_kwargs)
    if args.defaults:  # evaluate and predict reuse fit's cut, as a user leaving balance out
        args.balance, args.schedule = None, "(defaults)"
    weights = model.get_weights()
    if args.memory_cut:
        del os.environ["HYPARFLOW_MEMORY_PER_RANK"]
        top = model._hyparflow_fit.topology
        if rank == 0:
            print(f"[{args.label}] CHOSE P={top.partitions} R={top.replicas}", flush=True)
    if args.buckets:
        check_buckets(args, build, x, y, weights)
    traced = traces(model) if args.varlen else {}
    # Then evaluate and predict pipelined over the same ranks, reusing the stages.
    if args.varlen:  # the same batches again
        evaluated = hf.evaluate(model, inputs()[0][0], partitions=args.partitions,
                                replicas=args.replicas, verbose=0, return_dict=True,
                                balance=args.balance)
        predicted = hf.predict(model, inputs()[0][0], partitions=args.partitions,
                               replicas=args.replicas, verbose=0, balance=args.balance)
    else:
        evaluated = hf.evaluate(model, x, y, partitions=args.partitions,
                                replicas=args.replicas, batch_size=args.batch_size, verbose=0,
                                return_dict=True, balance=args.balance)
        predicted = hf.predict(model, x, partitions=args.partitions, replicas=args.replicas,
                               batch_size=args.batch_size, verbose=0, balance=args.balance)
    assert len(model._hyparflow_trainers) == 1, "evaluate/predict split the model again"
    all_evaluated = MPI.COMM_WORLD.gather(evaluated, root=0)
    all_predicted = MPI.COMM_WORLD.gather(predicted, root=0)
    all_weights = MPI.COMM_WORLD.gather(weights, root=0)
    all_losses = MPI.COMM_WORLD.gather(ours.values, root=0)
    all_traced = MPI.COMM_WORLD.gather(traced, root=0)
    reference = build(args.model, seed=7, weight_decay=args.weight_decay)
    if rank != 0:
        return
    theirs = Losses(args.stop_after)
    data_args, data_kwargs = inputs()
    keras_traces = [0]
    step = reference.train_step

    def counted(data):  # a compiled train step calls this once per trace
        keras_traces[0] += 1
        return step(data)
    reference.train_step = counted
    ref_history = reference.fit(*data_args, epochs=args.epochs, shuffle=False, verbose=0,
                                callbacks=[theirs.callback], **data_kwargs)
    steps = args.stop_after or (args.steps + (1 if args.tail else 0)) * args.epochs
    assert len(theirs.values) == steps, theirs.values
    for r, losses in enumerate(all_losses):
        np.testing.assert_allclose(losses, theirs.values, rtol=1e-4, atol=1e-5,
                                   err_msg=f"per-step losses differ on rank {r}")
    for r, ws in enumerate(all_weights):
        for w, ref, v in zip(ws, reference.get_weights(), reference.weights):
            np.testing.assert_allclose(w, ref, rtol=1e-4, atol=1e-5,
                                       err_msg=f"weight {v.path} differs on rank {r}")
    assert sorted(history.history) == sorted(ref_history.history), (
        history.history, ref_history.history)
    for key, values in ref_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-4, atol=1e-5,
                                   err_msg=f"History[{key!r}] differs")
    for r, counts in enumerate(all_traced):  # a new length retraces no stage
        for name, count in counts.items():
            assert count <= keras_traces[0], (
                f"rank {r}: {name} traced {count} times over batches of "
                f"{len({b[0].shape[1] for b in batches})} lengths; Keras' train step "
                f"{keras_traces[0]}")
    if args.varlen:
        ref_evaluated = reference.evaluate(inputs()[0][0], verbose=0, return_dict=True)
        ref_predicted = reference.predict(inputs()[0][0], verbose=0)
    else:
        ref_evaluated = reference.evaluate(x, y, batch_size=args.batch_size, verbose=0,
                                           return_dict=True)
        ref_predicted = reference.predict(x, batch_size=args.batch_size, verbose=0)
    for r, (ev, pr) in enumerate(zip(all_evaluated, all_predicted)):
        assert sorted(ev) == sorted(ref_evaluated), (ev, ref_evaluated)
        for key, value in ref_evaluated.items():
            if args.tail and key.endswith("_loss"):
                continue  # a smaller last batch: Keras' per-output losses are unweighted means
            np.testing.assert_allclose(ev[key], value, rtol=1e-4, atol=1e-5,
                                       err_msg=f"evaluate()[{key!r}] differs on rank {r}")
        for a, b in zip(tree.flatten(pr), tree.flatten(ref_predicted)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5,
                                       err_msg=f"predict() differs on rank {r}")
    label = f"[{args.label}] " if args.label else ""
    print(f"{label}EQUIVALENT P={args.partitions} R={args.replicas} steps={steps} "
          f"schedule={args.schedule} recompute={args.recompute} "
          f"losses={np.round(theirs.values, 5).tolist()}", flush=True)


if __name__ == "__main__":
    main()
