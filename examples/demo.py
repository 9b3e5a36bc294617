"""Train one small ResNet on scikit-learn's digits with plain Keras and with hyparflow (2 stages
× 2 replicas on 4 MPI ranks), print their accuracies side by side, and draw hyparflow's timeline.
"""

# Run it with `make demo`, or as `python examples/demo.py`: the plain Keras run happens in
# this process, which then starts hyparflow's run with
# `hyparflow-run -n 4 python examples/demo.py --against build/demo/keras.json` and, after it,
# draws the timeline. Everything it writes goes to build/demo/. The model and the data come
# from examples/digits.py.

import argparse
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys

import hyparflow as hf  # isort: skip  (before TensorFlow: each rank's share of the cores)
from hyparflow import quiet
from hyparflow.mpi import comm

PARTITIONS, REPLICAS = 2, 2  # 2 pipeline stages × 2 copies of the pipeline = 4 MPI ranks
MICROBATCHES = 2  # each replica's 32 samples of a batch go through the pipeline as 2 × 16
SEED = 0  # the initial weights
# The same training arguments for model.fit and hf.fit. No shuffling, so that both see the
# same batches in the same order (hf.fit shuffles by default, as model.fit does).
SAME = dict(batch_size=64, validation_split=0.2, shuffle=False, verbose=0)

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.relpath(os.path.join(HERE, os.pardir, "build", "demo"))
KERAS_JSON = os.path.join(OUT, "keras.json")
TRACE_JSON = os.path.join(OUT, "trace.json")
TIMELINE_PNG = os.path.join(OUT, "timeline.png")


def load_example():
    """examples/digits.py as a module: its load_digits() and build_model()."""
    spec = importlib.util.spec_from_file_location("digits", os.path.join(HERE, "digits.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def steps_per_epoch(x):
    return math.ceil(len(x) * (1 - SAME["validation_split"]) / SAME["batch_size"])


def fingerprint(model):
    """A short hash of the model's weights: the two runs check that they start alike."""
    return hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()[:16]


def train_keras(epochs):
    """Plain Keras on this one process: model.fit, then model.evaluate on the test images."""
    digits = load_example()
    (x, y), (x_test, y_test) = digits.load_digits()
    model = digits.build_model(SEED, epochs * steps_per_epoch(x))
    start = fingerprint(model)
    history = model.fit(x, y, epochs=epochs, **SAME)
    _, test = model.evaluate(x_test, y_test, batch_size=SAME["batch_size"], verbose=0)
    return dict(history.history, test_accuracy=test, initial_weights=start,
                steps_per_epoch=steps_per_epoch(x))


def train_hyparflow(epochs, against):
    """One MPI rank's part of hf.fit and hf.evaluate; rank 0 prints the table."""
    from mpi4py import MPI

    digits = load_example()
    (x, y), (x_test, y_test) = digits.load_digits()
    model = digits.build_model(SEED, epochs * steps_per_epoch(x))
    start = fingerprint(model)
    history = hf.fit(model, x, y, partitions=PARTITIONS, replicas=REPLICAS,
                     microbatches=MICROBATCHES, epochs=epochs,
                     callbacks=[hf.Trace(TRACE_JSON)], **SAME)
    _, test = hf.evaluate(model, x_test, y_test, partitions=PARTITIONS, replicas=REPLICAS,
                          batch_size=SAME["batch_size"], verbose=0)
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    ours = dict(history.history, test_accuracy=test)
    keras = None
    if against:
        with open(against) as f:
            keras = json.load(f)
        if keras["initial_weights"] != start or len(keras["accuracy"]) != epochs:
            print(f"{against} is from another model or number of epochs: left out.")
            keras = None
    print_table(keras, ours, len(x), len(x_test))


def print_table(keras, ours, samples, test_samples):
    validation = samples - math.ceil(samples * (1 - SAME["validation_split"]))
    print(f"\nAccuracy: the same initial weights, the same batches in the same order (batch size "
          f"{SAME['batch_size']});\ndigits: {samples - validation} training, {validation} "
          f"validation, {test_samples} test images.\n")
    runs = [("plain Keras, 1 process", keras), (f"hyparflow, P={PARTITIONS} × R={REPLICAS}", ours)]
    runs = [(name, run) for name, run in runs if run is not None]

    def row(first, cells):
        print((f"{first:>5}" + "".join(f"{a:>9}{b:>13}   " for a, b in cells)).rstrip())

    print(("     " + "".join(f"{name:^22}   " for name, _ in runs)).rstrip())
    row("epoch", [("train", "validation")] * len(runs))
    for e in range(len(ours["accuracy"])):
        row(e + 1, [(f"{run['accuracy'][e]:.3f}", f"{run['val_accuracy'][e]:.3f}")
                    for _, run in runs])
    row("test", [("", f"{run['test_accuracy']:.3f}") for _, run in runs])
    if keras is None:
        print("\n(hyparflow alone: `python examples/demo.py` runs plain Keras too, beside it.)")
        return
    micro = SAME["batch_size"] // REPLICAS // MICROBATCHES
    print(f"\nClose, not equal, as expected: under hyparflow BatchNormalization normalises each "
          f"micro-batch\nof {micro} samples (Keras: each batch of {SAME['batch_size']}); its "
          "moving statistics are updated once a step,\nas Keras updates them, from the "
          "moments of the step's micro-batches pooled.", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--against", metavar="JSON",
                        help="(under hyparflow-run) the plain Keras run to print beside hf.fit's")
    args = parser.parse_args(argv)
    if comm.launched():  # one of the 4 ranks of hyparflow-run
        train_hyparflow(args.epochs, args.against)
        return

    quiet.install()  # TensorFlow's start-up lines left out, as hyparflow-run does for its ranks
    os.makedirs(OUT, exist_ok=True)
    print(f"1/3  Plain Keras: model.fit on this one process, {args.epochs} epochs ...", flush=True)
    keras = train_keras(args.epochs)
    with open(KERAS_JSON, "w") as f:
        json.dump(keras, f)

    ranks = PARTITIONS * REPLICAS
    command = [os.path.relpath(__file__), "--epochs", str(args.epochs), "--against", KERAS_JSON]
    print(f"2/3  hyparflow: hf.fit on {ranks} MPI ranks, the same model and data ...\n"
          f"     $ hyparflow-run -n {ranks} python {' '.join(command)}", flush=True)
    job = subprocess.run([sys.executable, "-m", "hyparflow.run", "-n", str(ranks),
                          sys.executable, __file__] + command[1:])
    if job.returncode != 0:
        sys.exit(job.returncode)

    from hyparflow import trace

    step = args.epochs * keras["steps_per_epoch"] - 2  # not the last: it may be a partial batch
    print(f"\n3/3  hyparflow's timeline of training step {step}, a full batch of the last epoch:\n"
          f"     $ python -m hyparflow.trace {TRACE_JSON} -o {TIMELINE_PNG} --step {step}",
          flush=True)
    trace.main([TRACE_JSON, "-o", TIMELINE_PNG, "--step", str(step)])
    print("     A row per rank, a box per micro-batch: forward (blue), backward (orange), both "
          "(purple);\n     then gradients summed over replicas and the optimizer step (greens). "
          "Grey: waiting.\n     The bubble is the share of the step a rank spends not "
          "computing; the ideal (P-1)/(m+P-1)\n     counts only the pipeline's fill and drain. "
          "Here 4 ranks share 2 cores, so each also waits\n     for a core, and small "
          "micro-batches leave fixed costs per message: measured is higher.")


if __name__ == "__main__":
    main()
