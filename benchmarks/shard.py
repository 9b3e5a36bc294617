"""`shard_optimizer=True` against the unsharded step: Adam's state per rank, resident memory
while training, step time, and the weights (data parallel, P = 1, R = 2).

The script is its own driver, like `memory.py`: each round launches a 2-rank
`hyparflow-run` job unsharded and one sharded (the order reverses every round),
each training a wide MLP (`--width`, four Dense layers: 4 × width² parameters)
with Adam, one TensorFlow thread per rank, a warm-up call then `--reps` timed
calls of `--steps` steps. Each rank reports:

* ``slot_bytes``: the bytes of the optimizer variables that train on this rank
  (read at the end of the last epoch, while `model.optimizer` is the stage's);
* ``rss_kib``: its resident set at that moment (before hf.fit gathers the whole
  state back into `model.optimizer`);
* ``step_s``: seconds per step of each timed call;
* ``checksum``: a hash of the trained weights (the two runs must agree bit for bit:
  at R = 2 a sum of two gradients does not depend on the order).

Writes ``results/<machine>-shard.json`` and ``.md``::

    .venv/bin/python benchmarks/shard.py                 # width 2048, 3 rounds
    .venv/bin/python benchmarks/shard.py --quick         # width 512, 1 round
"""

import argparse
import datetime
import hashlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402

RANKS = 2


def worker(args):
    """One job: train, report every rank's readings on rank 0."""
    harness.one_thread_per_rank()
    import hyparflow as hf  # isort: skip  (before keras, which loads TensorFlow)
    import keras
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rng = np.random.default_rng(args.seed)
    n = args.steps * args.batch_size
    x = rng.normal(size=(n, args.width)).astype("float32")
    y = rng.integers(0, 10, size=n)
    keras.utils.set_random_seed(args.seed)
    inputs = keras.Input((args.width,))
    h = inputs
    for k in range(4):
        h = keras.layers.Dense(args.width, activation="relu", name=f"wide{k}")(h)
    model = keras.Model(inputs, keras.layers.Dense(10, name="out")(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    readings = {}

    def at_epoch_end(epoch, logs):
        optimizer = model.optimizer  # the stage's while training
        readings["slot_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in optimizer.variables)
        readings["rss_kib"] = harness.current_rss()

    probe = keras.callbacks.LambdaCallback(on_epoch_end=at_epoch_end)
    shard = bool(args.shard)
    seconds = []
    for call in range(args.reps + 1):  # the first: tracing, warm-up
        world.Barrier()
        start = time.perf_counter()
        hf.fit(model, x, y, replicas=RANKS, batch_size=args.batch_size, epochs=1,
               shuffle=False, verbose=0, shard_optimizer=shard, callbacks=[probe])
        if call:
            seconds.append((time.perf_counter() - start) / args.steps)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()
    rows = world.gather(dict(readings, rank=world.Get_rank(), step_s=seconds,
                             checksum=digest[:16]), root=0)
    if world.Get_rank() == 0:
        harness.print_result({"shard": shard, "width": args.width, "ranks": rows})


def drive(args):
    started = datetime.datetime.now(datetime.timezone.utc)
    jobs = []
    for r in range(args.rounds):
        for shard in ((0, 1) if r % 2 == 0 else (1, 0)):
            cmd = harness.on_ranks(RANKS, __file__, "--worker", "--shard", str(shard),
                                   *common(args))
            load = os.getloadavg()[0]
            result, error = harness.launch(cmd, args.timeout)
            jobs.append({"round": r, "shard": shard, "result": result, "error": error,
                         "load_before": load})
            if error:
                print(f"  shard={shard}: FAILED: {error}", file=sys.stderr, flush=True)
            else:
                step = statistics.median(result["ranks"][0]["step_s"])
                print(f"  shard={shard}: {step * 1e3:.1f} ms per step", file=sys.stderr,
                      flush=True)
    report = {"benchmark": "shard", "machine": harness.machine(),
              "started": started.isoformat(timespec="seconds"),
              "settings": vars(args), "jobs": jobs}
    name = harness.machine_name(report["machine"]) + ("-quick" if args.quick else "") + "-shard"
    stem = os.path.join(args.output_dir, name)
    harness.publish(report, stem, markdown(report))
    return 1 if any(j["error"] for j in jobs) else 0


def summary(report, shard):
    """Medians over rounds and ranks of one mode: slot bytes, RSS, step time; checksums."""
    done = [j["result"] for j in report["jobs"] if j["shard"] == shard and j["result"]]
    ranks = [row for res in done for row in res["ranks"]]
    if not ranks:
        return None
    return {"slot_mib": [max(row["slot_bytes"] for row in res["ranks"]) / 2**20
                         for res in done],
            "rss_mib": statistics.median(row["rss_kib"] / 1024 for row in ranks),
            "step_ms": statistics.median(s * 1e3 for row in ranks for s in row["step_s"]),
            "checksums": sorted({row["checksum"] for row in ranks})}


def markdown(report):
    s = report["settings"]
    plain, sharded = summary(report, 0), summary(report, 1)
    lines = [f"# shard_optimizer=True, data parallel R = {RANKS}, wide MLP (width {s['width']}, "
             f"Adam)", "",
             f"Started {report['started']}; {s['rounds']} round(s), each a 2-rank job per mode "
             f"(order reversed every round); {s['reps']} timed calls of {s['steps']} steps of "
             f"batch {s['batch_size']} after a warm-up call; one TensorFlow thread per rank.",
             ""]
    if plain is None or sharded is None:
        lines.append("A mode failed: see the JSON file.")
        return "\n".join(lines) + "\n"
    lines += ["| | unsharded | sharded | sharded / unsharded |", "| --- | ---: | ---: | ---: |",
              f"| Adam state per rank, largest rank (MiB) | {max(plain['slot_mib']):.1f} "
              f"| {max(sharded['slot_mib']):.1f} "
              f"| {max(sharded['slot_mib']) / max(plain['slot_mib']):.3f} |",
              f"| resident set at the last epoch's end (MiB, median) | {plain['rss_mib']:.0f} "
              f"| {sharded['rss_mib']:.0f} | {sharded['rss_mib'] / plain['rss_mib']:.3f} |",
              f"| step (ms, median) | {plain['step_ms']:.1f} | {sharded['step_ms']:.1f} "
              f"| {sharded['step_ms'] / plain['step_ms']:.3f} |", "",
              "Weights after training: " + ("the same bit for bit in both modes"
                                            if plain["checksums"] == sharded["checksums"]
                                            and len(plain["checksums"]) == 1
                                            else f"DIFFER: {plain['checksums']} against "
                                                 f"{sharded['checksums']}") + "."]
    return "\n".join(lines) + "\n"


def common(args):
    return ["--width", str(args.width), "--batch-size", str(args.batch_size), "--steps",
            str(args.steps), "--reps", str(args.reps), "--seed", str(args.seed)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--quick", action="store_true", help="width 512, 1 round")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--output-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.width is None:
        args.width = 512 if args.quick else 2048
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    return harness.dispatch(args, worker, drive)


if __name__ == "__main__":
    sys.exit(main())
