"""The defaults' weighing, measured: hf.fit's two choices without speed arguments, their first
call and their steps, and the steps that repay the long choice's longer first call.

hf.fit with no schedule runs a call over arrays that plans fewer than
`hyparflow.defaults.LONG_JOB_STEPS` steps on the executor (1F1B, cut by FLOPs), and a longer
one in the step graph cut by measured time (interleaved, or 1F1B where a layer is called at
several places). Per model, each arm is one 2-rank job (P = 2, one thread a rank) that calls
hf.fit once with no speed arguments over the same --steps batches: "short" plans those steps,
"long" plans LONG_JOB_STEPS or more and is stopped after the same steps (a callback sets
``model.stop_training``). Each records the first step (from the call's start: partitioning,
rank 0's timing, tracing, compiling), the median later step (every rank's, the slowest), and
the choice hf.fit made. The arms run in --rounds rounds, their order reversed every other
round; every round is kept. The payback is (long's first step − short's) ÷ (short's step −
long's), per round::

    .venv/bin/python benchmarks/defaults.py                       # ResNet-110, GPT-2, BERT
    .venv/bin/python benchmarks/defaults.py --models gpt2 --rounds 1

Writes benchmarks/results/defaults.md and .json (--output: another stem).
"""

import argparse
import datetime
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402

# model → (what it is, global batch size)
MODELS = {
    "resnet110": ("ResNet-110 v1, random 32×32 images, 10 classes", 64),
    "gpt2": ("keras-hub GPT2CausalLM from config (12 layers, width 128, 4 heads, vocabulary "
             "4096; its token embedding tied to the head), 128 tokens a sample", 16),
    "bert": ("keras-hub BertTextClassifier from config (12 layers, width 128, 4 heads, "
             "vocabulary 4096), 128 tokens a sample, 2 classes", 16),
}
ARMS = ("short", "long")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--steps", type=int, default=20, help="steps each job trains")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    harness.driver_options(p, 1800.0, "defaults", roles=("hf",))
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)  # a child's
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # a child's
    args = p.parse_args(argv)
    harness.at_least_one(p, args, "steps", "rounds")
    return args


def job(name, samples, seed):
    """(x, y, sample_weight or None, compiled model) of `samples` samples."""
    import keras
    import numpy as np

    rng = np.random.default_rng(seed)
    if name == "resnet110":
        from benchmarks.models import resnet_v1

        x, y, model = harness.cifar_job(resnet_v1, 110, samples, seed)
        return x, y, None, model
    import keras_hub

    length, vocabulary = 128, 4096
    real = rng.integers(length // 4, length + 1, size=samples)
    mask = (np.arange(length) < real[:, None]).astype("int32")
    tokens = (rng.integers(1, vocabulary, size=(samples, length)) * mask).astype("int32")
    x = {"token_ids": tokens, "padding_mask": mask}
    keras.utils.set_random_seed(seed)
    shape = dict(vocabulary_size=vocabulary, num_layers=12, num_heads=4, hidden_dim=128,
                 intermediate_dim=512, max_sequence_length=length, dropout=0.0)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    if name == "gpt2":
        model = keras_hub.models.GPT2CausalLM(
            backbone=keras_hub.models.GPT2Backbone(**shape), preprocessor=None)
        y, weights = np.roll(tokens, -1, axis=1), mask.astype("float32")
    else:
        x["segment_ids"] = np.zeros_like(tokens)
        model = keras_hub.models.BertTextClassifier(
            backbone=keras_hub.models.BertBackbone(**shape), num_classes=2,
            preprocessor=None)
        y, weights = rng.integers(0, 2, size=samples).astype("int32"), None
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, weights, model


def worker(args):
    """One arm's job: hf.fit once, no speed arguments; prints the result line (rank 0)."""
    harness.one_thread_per_rank(1)
    import hyparflow as hf  # isort: skip  (before TensorFlow)
    import keras
    from mpi4py import MPI

    from hyparflow import defaults

    comm = MPI.COMM_WORLD
    batch = MODELS[args.model][1]
    x, y, weights, model = job(args.model, args.steps * batch, args.seed)
    # the long arm plans at least LONG_JOB_STEPS steps, as epochs of the same batches
    epochs = 1 if args.arm == "short" else math.ceil(defaults.LONG_JOB_STEPS / args.steps)
    ends = []

    def ended(batch_index, logs):
        ends.append(time.perf_counter())
        if len(ends) == args.steps:
            model.stop_training = True

    clock = keras.callbacks.LambdaCallback(on_train_batch_end=ended)
    clock.batch_hooks_read_weights = False  # (it reads no weight)
    comm.Barrier()
    start = time.perf_counter()
    hf.fit(model, x, y, sample_weight=weights, partitions=2, batch_size=batch, epochs=epochs,
           verbose=0, shuffle=False, callbacks=[clock])
    later = [b - a for a, b in zip(ends, ends[1:])]
    mine = {"first_step_s": ends[0] - start, "step_s": statistics.median(later)}
    records = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return
    trainer = model.__dict__["_hyparflow_fit"]
    harness.print_result({
        "model": args.model, "arm": args.arm, "planned_steps": epochs * args.steps,
        "trained_steps": len(ends),
        "first_step_s": max(r["first_step_s"] for r in records),
        "step_s": max(r["step_s"] for r in records),
        "schedule": trainer.executor.schedule.title,
        "step_graph": trainer.executor.step_graph is not None,
        "balance": trainer.partition.method,
        "stage_calls": [len(s.calls) for s in trainer.partition.stages]})


def command(args, model, arm):
    return harness.on_ranks(2, __file__, "--worker", "hf", "--model", model, "--arm", arm,
                            "--steps", str(args.steps), "--seed", str(args.seed))


def drive(args):
    started = datetime.datetime.now().isoformat(timespec="seconds")
    rounds = []
    for r in range(args.rounds):
        got = {}
        for model in args.models:
            order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                result, error = harness.launch(command(args, model, arm), args.timeout)
                got[f"{model} {arm}"] = result if result is not None else {"error": error}
                print(f"round {r + 1}: {model} {arm}: {result or error}", file=sys.stderr,
                      flush=True)
        rounds.append(got)
    record = harness.report("defaults", __doc__, started, settings={
        "models": {m: MODELS[m][0] for m in args.models}, "steps": args.steps,
        "rounds": args.rounds, "batch": {m: MODELS[m][1] for m in args.models}},
        rounds=rounds)
    harness.publish(record, args.output, table(record))
    return 0


def payback(short, long):
    """Steps after which the long arm's longer first step is repaid (None: never)."""
    saved = short["step_s"] - long["step_s"]
    extra = long["first_step_s"] - short["first_step_s"]
    return extra / saved if saved > 0 else None


def table(record):
    rows = ["| model | round | short: first step, step (s) | long: first step, step (s) | "
            "long's choice | a step, short ÷ long | payback (steps) |",
            "| --- | --- | --- | --- | --- | ---: | ---: |"]
    for model in record["settings"]["models"]:
        paybacks, speedups = [], []
        for r, got in enumerate(record["rounds"], 1):
            short, long = got.get(f"{model} short"), got.get(f"{model} long")
            if not short or not long or "error" in short or "error" in long:
                rows.append(f"| {model} | {r} | failed | failed | | | |")
                continue
            back = payback(short, long)
            speedups.append(short["step_s"] / long["step_s"])
            paybacks.append(back if back is not None else math.inf)
            where = "step graph" if long["step_graph"] else "executor"
            rows.append(
                f"| {model} | {r} | {short['first_step_s']:.1f}, {short['step_s']:.3f} | "
                f"{long['first_step_s']:.1f}, {long['step_s']:.3f} | {long['schedule']}, "
                f"{where}, {long['balance']!r}, cut {'|'.join(map(str, long['stage_calls']))} "
                f"| {speedups[-1]:.2f} | {'never' if back is None else f'{back:.0f}'} |")
        if paybacks:
            rows.append(f"| {model} | **median** | | | | **{statistics.median(speedups):.2f}** "
                        f"| **{statistics.median(paybacks):.0f}** |")
    m = record["machine"]
    head = (f"hf.fit at P = 2 with no speed arguments, one thread a rank; "
            f"{m['cpu']}; {record['started']}, commit {record['commit']}; "
            f"{record['settings']['steps']} steps a job. Models: " + "; ".join(
                f"{k}: {v} (batch {record['settings']['batch'][k]})"
                for k, v in record["settings"]["models"].items()) + ".\n\n")
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(harness.dispatch(parse_args(), worker, drive))
