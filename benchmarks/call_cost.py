"""What each hf.fit call does once besides its steps: the weights and optimizer state it moves.

Run on two ranks (P = 2), one TensorFlow thread each::

    .venv/bin/hyparflow-run -n 2 --threads 1 .venv/bin/python benchmarks/call_cost.py

After a warm-up hf.fit of ResNet-110 v1 (SGD with momentum), it times, `--reps` times each,
the moves a call makes: every rank taking rank 0's weights and optimizer state
(`checkpoint.start_from_rank0`), every rank getting every stage's weights
(`checkpoint.gather_weights`, twice a call: after the epoch and after training), the
optimizer state gathered into `model.optimizer` (`optimizers.gather_into_user`) and
taken back by the stage's optimizer (`optimizers.take_state`). Each time is the slower
rank's; the table gives medians and the per-call sum.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=110)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--output", default=None, help="JSON results file (default: none)")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    import hyparflow as hf  # isort: skip  (before TensorFlow)
    import keras
    import numpy as np
    from mpi4py import MPI

    from benchmarks import harness
    from benchmarks.models import resnet_v1
    from hyparflow.keras import optimizers
    from hyparflow.training import checkpoint

    world = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    x = rng.random((64, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)
    keras.utils.set_random_seed(0)
    model = resnet_v1(args.depth)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    hf.fit(model, x, y, partitions=world.Get_size(), microbatches=2, batch_size=64, verbose=0)
    trainer = model.__dict__["_hyparflow_fit"]
    moves = {
        "rank 0's weights and optimizer state to every rank":
            lambda: checkpoint.start_from_rank0(trainer, train=True),
        "every stage's weights to every rank": lambda: checkpoint.gather_weights(trainer),
        "every stage's optimizer state into model.optimizer":
            lambda: optimizers.gather_into_user(trainer),
        "the stage optimizer's state from model.optimizer":
            lambda: optimizers.take_state(trainer.executor.optimizer, trainer.user_optimizer),
    }
    per_call = {"every stage's weights to every rank": 2}
    medians = {}
    for what, move in moves.items():
        seconds = []
        for _ in range(args.reps):
            world.Barrier()
            start = time.perf_counter()
            move()
            seconds.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
        medians[what] = statistics.median(seconds)
    if world.Get_rank() == 0:
        total = sum(medians[w] * per_call.get(w, 1) for w in medians)
        print(f"ResNet-{args.depth} v1, P = {world.Get_size()}, {len(model.weights)} weights; "
              f"medians of {args.reps}, the slower rank's\n")
        print("| move | ms | times a call |\n| --- | ---: | ---: |")
        for what, s in medians.items():
            print(f"| {what} | {s * 1e3:.1f} | {per_call.get(what, 1)} |")
        print(f"| **a call** | **{total * 1e3:.0f}** | |")
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"benchmark": "call_cost", "machine": harness.machine(),
                           "depth": args.depth, "ranks": world.Get_size(), "reps": args.reps,
                           "median_seconds": medians, "per_call": per_call,
                           "call_seconds": total}, f, indent=1)


if __name__ == "__main__":
    main()
