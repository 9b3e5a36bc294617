"""Overhead of hf.fit(partitions=1, replicas=1) against model.fit,
one TensorFlow thread, in-process.

Both runners start from the same weights and see the same data. Each gets one
warm-up call, then their timed calls alternate (the order flipping every
repetition) so that drifts in machine load hit both alike::

    .venv/bin/python benchmarks/overhead.py                        # ResNet-56, 7 reps × 10 steps
    .venv/bin/python benchmarks/overhead.py --depth 20 --reps 1 --steps 2 --output /tmp/o.json
"""

import os

for _name in ("HYPARFLOW_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
    os.environ[_name] = "1"  # before TensorFlow loads: one thread for both runners

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import hyparflow as hf  # noqa: E402  # isort: skip  (before TensorFlow)
import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.models import resnet_v1  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--depth", type=int, default=56, help="ResNet v1 depth (default 56)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7, help="timed calls of each runner")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per call")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the weights")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "overhead.json"),
                        help="results file (default benchmarks/results/overhead.json)")
    args = parser.parse_args(argv)
    harness.at_least_one(parser, args, "depth", "batch_size", "reps", "steps")
    return args


def compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def runners(args, x, y):
    """{name: zero-argument function doing one call of `steps` steps}, same initial weights."""
    keras.utils.set_random_seed(args.seed)
    keras_model = compiled(resnet_v1(args.depth))
    hf_model = compiled(resnet_v1(args.depth))
    hf_model.set_weights(keras_model.get_weights())

    def keras_fit():
        keras_model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False)

    def hf_fit():
        hf.fit(hf_model, x, y, partitions=1, replicas=1, batch_size=args.batch_size, epochs=1,
               verbose=0, shuffle=False)

    return {"keras": keras_fit, "hf": hf_fit}, keras_model


def main(argv=None):
    args = parse_args(argv)
    samples = args.steps * args.batch_size
    rng = np.random.default_rng(args.seed)
    x = rng.random((samples, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=samples).astype(np.int32)
    run, keras_model = runners(args, x, y)
    started = harness.now()

    for name in ("keras", "hf"):  # warm-up: trace and build everything once
        run[name]()
    seconds = {"keras": [], "hf": []}
    for rep in range(args.reps):
        for name in (("keras", "hf") if rep % 2 == 0 else ("hf", "keras")):
            start = time.perf_counter()
            run[name]()
            seconds[name].append(time.perf_counter() - start)

    rates = {name: [samples / s for s in secs] for name, secs in seconds.items()}
    median = {name: statistics.median(r) for name, r in rates.items()}
    # Each repetition times both runners back to back: the ratio within a repetition
    # cancels slow drifts of the machine; the headline is the median of those.
    paired = [k / h for k, h in zip(seconds["keras"], seconds["hf"])]
    ratio = statistics.median(paired)
    report = {
        "benchmark": "overhead",
        "description": "hf.fit(partitions=1, replicas=1) against model.fit in one process: "
                       "same initial weights and data, one TensorFlow thread, one warm-up "
                       "call each, then alternating timed calls of `steps` steps; median "
                       "images/s of each and their ratio.",
        "started": started,
        "machine": harness.machine(),
        "settings": {"model": keras_model.name, "params": keras_model.count_params(),
                     "depth": args.depth, "batch_size": args.batch_size, "reps": args.reps,
                     "steps": args.steps, "seed": args.seed,
                     "threads": {"intra_op": os.environ["TF_NUM_INTRAOP_THREADS"],
                                 "inter_op": os.environ["TF_NUM_INTEROP_THREADS"]},
                     "keras_jit_compile": bool(keras_model.jit_compile)},
        "keras": {"seconds": seconds["keras"], "images_per_s": rates["keras"],
                  "median_images_per_s": median["keras"]},
        "hf": {"seconds": seconds["hf"], "images_per_s": rates["hf"],
               "median_images_per_s": median["hf"]},
        "ratio_per_rep": paired,
        "ratio_of_medians": median["hf"] / median["keras"],
        "ratio_hf_over_keras": ratio,
    }
    harness.write_report(report, args.output)

    print(f"ResNet-{args.depth} v1, batch {args.batch_size}, one TensorFlow thread, "
          f"median of {args.reps} × {args.steps} steps\n")
    print("| runner | images/s (median) | ms/step | images/s per rep |")
    print("| --- | ---: | ---: | --- |")
    for name, label in (("keras", "model.fit"), ("hf", "hf.fit (P=1, R=1)")):
        per_rep = ", ".join(f"{r:.1f}" for r in rates[name])
        print(f"| {label} | {median[name]:.1f} | {1000 * args.batch_size / median[name]:.1f} "
              f"| {per_rep} |")
    print(f"\nratio hf/keras (median of per-repetition ratios): {ratio:.3f}; "
          f"per repetition: {', '.join(f'{r:.3f}' for r in paired)}\nwritten to {args.output}")


if __name__ == "__main__":
    main()
