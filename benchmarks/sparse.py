"""An Embedding's gradient kept sparse against densified: peak memory per rank and step time.

The script is its own driver: it runs a 2-rank `hyparflow-run` job (P = 1, R = 2
by default) training a large Embedding (1,000,000 × 64) with Adam, once with
this tree's hyparflow (IndexedSlices kept across micro-batches and replicas,
applied with Keras' sparse update) and once with a baseline tree given by
``--baseline`` (a checkout of an earlier commit, which densified the gradient:
a dense sum per micro-batch, a dense allreduce, a dense Adam update),
alternating, ``--reps`` times. Each rank reports its resident set before the
first fit, its peak (``ru_maxrss``) and the median time of the measured steps
(after one warm-up call); the driver prints the medians over repetitions::

    git worktree add /tmp/dense <commit before sparse gradients>
    .venv/bin/python benchmarks/sparse.py --baseline /tmp/dense
"""

import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.append(ROOT)  # after PYTHONPATH: the worker imports the hyparflow of the tree tested

from benchmarks import harness  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", help="a tree whose hyparflow densifies (the dense run)")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--length", type=int, default=20, help="tokens per sample")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--output", default=os.path.join(HERE, "results", "sparse.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args):
    import keras
    import numpy as np
    from mpi4py import MPI

    import hyparflow as hf

    keras.utils.set_random_seed(0)
    tokens = keras.Input((args.length,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(args.rows, args.dim, name="table")(tokens)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    h = keras.layers.Dense(64, activation="relu", name="d")(h)
    model = keras.Model(tokens, keras.layers.Dense(10, activation="softmax", name="probs")(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    n = args.batch_size * args.steps
    x = rng.integers(0, args.rows, size=(n, args.length)).astype("int32")
    y = rng.integers(0, 10, size=n)
    kw = dict(partitions=args.partitions, replicas=args.replicas, batch_size=args.batch_size,
              microbatches=args.microbatches, shuffle=False, verbose=0)
    before = harness.current_rss()
    hf.fit(model, x[:2 * args.batch_size], y[:2 * args.batch_size], **kw)  # warm-up: traces
    times = []
    stamp = [0.0]
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda b, logs: stamp.__setitem__(0, time.perf_counter()),
        on_train_batch_end=lambda b, logs: times.append(time.perf_counter() - stamp[0]))
    hf.fit(model, x, y, callbacks=[cb], **kw)
    mine = {"rss_before_kib": before,
            "peak_kib": harness.maxrss(),
            "step_s": statistics.median(times), "hyparflow": os.path.dirname(hf.__file__)}
    everyone = MPI.COMM_WORLD.gather(mine, root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        harness.print_result(everyone)


def drive(args):
    trees = [("sparse (this tree)", ROOT)]
    if args.baseline:
        trees.insert(0, ("dense (baseline)", os.path.abspath(args.baseline)))
    child = [a for a in sys.argv[1:] if a != "--baseline" and a != args.baseline]
    runs = {name: [] for name, _ in trees}
    for rep in range(args.reps):
        for name, tree in trees:  # interleaved: the machine drifts
            command = harness.hyparflow_run() + ["-n", str(args.partitions * args.replicas),
                                                 sys.executable, os.path.abspath(__file__),
                                                 "--worker", *child]
            saved = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = tree
            try:
                result, error = harness.launch(command, args.timeout)
            finally:
                if saved is None:
                    del os.environ["PYTHONPATH"]
                else:
                    os.environ["PYTHONPATH"] = saved
            if error:
                print(f"{name}, rep {rep}: {error}", file=sys.stderr)
                continue
            runs[name].append(result)
            print(f"{name}, rep {rep}: " + ", ".join(
                f"rank {r}: {v['step_s'] * 1000:.0f} ms/step, peak {v['peak_kib'] / 1024:.0f} MiB"
                for r, v in enumerate(result)), file=sys.stderr, flush=True)
    rows = ["| run | step (median of reps, ms) | peak RSS per rank (MiB, max over ranks) | "
            "growth over RSS before fit (MiB) |", "| --- | --- | --- | --- |"]
    for name, results in runs.items():
        if not results:
            continue
        step = statistics.median(max(r["step_s"] for r in res) for res in results)
        peak = statistics.median(max(r["peak_kib"] for r in res) for res in results) / 1024
        growth = statistics.median(max(r["peak_kib"] - r["rss_before_kib"] for r in res)
                                   for res in results) / 1024
        rows.append(f"| {name} | {step * 1000:.0f} | {peak:.0f} | {growth:.0f} |")
    print("\n".join(rows))
    harness.write_report({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                          "machine": harness.machine(), "args": vars(args), "runs": runs,
                          "table": rows}, args.output)


def main(argv=None):
    return harness.dispatch(parse_args(argv), worker, drive)


if __name__ == "__main__":
    sys.exit(main())
