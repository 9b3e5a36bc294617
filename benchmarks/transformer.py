"""A GPT-2-shaped decoder at P = 2 on batches of variable length: hf.fit's schedules against
one process's model.fit, interleaved in rounds.

The model is keras-hub's GPT2CausalLM built from config (12 layers; width, heads, vocabulary
and lengths below; the token embedding tied to the output head, so the first and the last
stage hold it), trained with SGD on next-token targets weighted by the padding mask. Each
pass reads the same batches, each padded to its own longest sequence (lengths drawn once
from a seed), through a `keras.utils.PyDataset`. Each arm is a child process with one
TensorFlow thread a rank: one warm-up pass (tracing, compiling), then --reps timed passes;
its rate is padded tokens a second over the median pass. The arms run in --rounds rounds,
their order rotated each round; every round is kept::

    .venv/bin/python benchmarks/transformer.py                    # hyparflow's arms
    .venv/bin/python benchmarks/transformer.py --torch            # and PyTorch's (make peers)
    .venv/bin/python benchmarks/transformer.py --layers 2 --steps 2 --reps 1 --rounds 1

PyTorch's arms (peers/torch_decoder.py) train the same layers on the same batches; its
pipelining takes one shape, so there every batch is padded to the longest length.

Writes benchmarks/results/<machine>-transformer.md and .json.
"""

import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402

# arm name → hf.fit's speed arguments (None: one process, model.fit)
ARMS = {
    "one process": None,
    "defaults (1f1b)": {},
    "1f1b, step graph, m=4": {"schedule": "1f1b", "step_graph": True, "microbatches": 4},
    "zb-h1, step graph, m=4": {"schedule": "zb-h1", "step_graph": True, "microbatches": 4},
    "interleaved, step graph, m=4": {"schedule": "interleaved", "step_graph": True,
                                     "microbatches": 4},
}
# PyTorch's arms (peers/torch_decoder.py, with .venv-torch): name → its arguments; each is
# compared with PyTorch's own one process
TORCH = {
    "torch one process": ["--mode", "single"],
    "torch 1f1b, m=4": ["--mode", "pipeline", "--schedule", "1f1b", "--microbatches", "4"],
    "torch interleaved, m=4": ["--mode", "pipeline", "--schedule", "interleaved",
                               "--microbatches", "4"],
    "torch zero-bubble, m=4": ["--mode", "pipeline", "--schedule", "zero-bubble",
                               "--microbatches", "4"],
}
TORCH_PYTHON = os.path.join(os.path.dirname(HERE), ".venv-torch", "bin", "python")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocabulary", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lengths", default="32,128", help="shortest,longest padded batch")
    p.add_argument("--steps", type=int, default=8, help="batches a pass")
    p.add_argument("--reps", type=int, default=3, help="timed passes an arm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS) + list(TORCH))
    p.add_argument("--torch", action="store_true", help="PyTorch's arms too (make peers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds an arm may take")
    p.add_argument("--out", default=None, help="results stem (default: results/<machine>-"
                                               "transformer)")
    p.add_argument("--_arm", default=None, help=argparse.SUPPRESS)  # a child's arm
    return p.parse_args(argv)


def batches(args):
    """The pass's batches: ({token_ids, padding_mask}, next tokens, mask as weights), each
    padded to its own longest sequence; and their padded tokens."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    shortest, longest = (int(v) for v in args.lengths.split(","))
    out = []
    for _ in range(args.steps):
        length = int(rng.integers(shortest, longest + 1))
        real = rng.integers(max(1, length // 4), length + 1, size=args.batch_size)
        real[0] = length
        mask = (np.arange(length) < real[:, None]).astype("int32")
        tokens = rng.integers(1, args.vocabulary, size=(args.batch_size, length)) * mask
        out.append(({"token_ids": tokens.astype("int32"), "padding_mask": mask},
                    np.roll(tokens, -1, axis=1).astype("int32"), mask.astype("float32")))
    return out, sum(b[1].size for b in out)


def model(args):
    import keras
    import keras_hub

    keras.utils.set_random_seed(args.seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=args.vocabulary, num_layers=args.layers, num_heads=args.heads,
        hidden_dim=args.width, intermediate_dim=4 * args.width,
        max_sequence_length=int(args.lengths.split(",")[1]), dropout=0.0)
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    lm.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return lm


def worker(args):
    """One arm: a warm-up pass, then --reps timed passes; prints the result line (rank 0)."""
    import keras

    data, tokens = batches(args)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, k):
            return data[k]

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)

    lm = model(args)
    speed = ARMS[args._arm]
    clock = Clock()
    start = time.perf_counter()
    if speed is None:
        # keras-hub's PipelineModel.fit would run its preprocessor (None here): keras.Model's
        keras.Model.fit(lm, Batches(), epochs=1, verbose=0, shuffle=False)
        first = time.perf_counter() - start
        keras.Model.fit(lm, Batches(), epochs=args.reps, verbose=0, shuffle=False,
                        callbacks=[clock])
        rank = 0
    else:
        from mpi4py import MPI

        import hyparflow as hf

        hf.fit(lm, Batches(), partitions=2, replicas=1, epochs=1, verbose=0, shuffle=False,
               **speed)
        first = time.perf_counter() - start
        hf.fit(lm, Batches(), partitions=2, replicas=1, epochs=args.reps, verbose=0,
               shuffle=False, callbacks=[clock], **speed)
        rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        rates = [tokens / s for s in clock.seconds]
        harness.print_result({
            "arm": args._arm, "seconds": clock.seconds, "tokens_per_s": rates,
            "median_tokens_per_s": statistics.median(rates), "first_call_s": first})


def command(args, arm):
    shared = [w for name in ("layers", "width", "heads", "vocabulary", "batch_size", "lengths",
                             "steps", "reps", "seed")
              for w in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    if arm in TORCH:
        return [TORCH_PYTHON, os.path.join(HERE, "peers", "torch_decoder.py")] + TORCH[arm] + \
            shared
    words = [os.path.abspath(__file__), "--_arm", arm] + shared
    if ARMS[arm] is None:
        return [sys.executable] + words
    return harness.hyparflow_run() + ["-n", "2", sys.executable] + words


def table(report):
    rows = ["| arm | tokens/s, each round | median over one process of its library (each "
            "round) |",
            "| --- | --- | --- |"]
    rounds = report["rounds"]
    for arm in report["settings"]["arms"]:
        rates, ratios = [], []
        for r in rounds:
            got, base = r.get(arm), r.get("torch one process" if arm in TORCH else
                                          "one process")
            rates.append(f"{got['median_tokens_per_s']:.0f}" if got else "failed")
            if got and base:
                ratios.append(got["median_tokens_per_s"] / base["median_tokens_per_s"])
        cell = f"**{statistics.median(ratios):.2f}×** ({', '.join(f'{x:.2f}' for x in ratios)})" \
            if ratios else "-"
        rows.append(f"| {arm} | {', '.join(rates)} | {cell} |")
    s = report["settings"]
    head = (f"GPT-2-shaped decoder ({s['layers']} layers, width {s['width']}, {s['heads']} "
            f"heads, vocabulary {s['vocabulary']}), batches of {s['batch_size']} padded to "
            f"their own length ({s['lengths']}), P = 2, one thread a rank; "
            f"{report['machine']['cpu']}; {report['date']}, commit {report['commit']}.\n\n")
    return head + "\n".join(rows) + "\n"


def drive(args):
    import subprocess

    report = {"machine": harness.machine(), "date": datetime.date.today().isoformat(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                       capture_output=True, text=True).stdout.strip(),
              "command": " ".join(sys.argv), "settings": vars(args), "rounds": []}
    arms = list(args.arms) + [a for a in TORCH if args.torch and a not in args.arms]
    args.arms = arms
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]  # rotated each round
        got = {}
        for arm in order:
            result, error = harness.launch(command(args, arm), args.timeout)
            got[arm] = result
            print(f"round {r + 1} {arm}: " + (
                f"{result['median_tokens_per_s']:.0f} tokens/s (first call "
                f"{result['first_call_s']:.0f} s)" if result else f"FAILED {error}"),
                file=sys.stderr, flush=True)
        report["rounds"].append(got)
    stem = args.out or os.path.join(HERE, "results",
                                    f"{harness.machine_name(report['machine'])}-transformer")
    harness.publish(report, stem, table(report))


def main(argv=None):
    args = parse_args(argv)
    if args._arm is not None:
        worker(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
