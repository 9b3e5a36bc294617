"""The planner against the benchmark: hf.plan's predicted images/s for every hf configuration suite.py measured.

Reads the suite's results file (`results/<machine>.json`), measures the same
ResNet in this one process (one TensorFlow thread, as every benchmark rank),
predicts each measured hf configuration with `hyparflow.planner.predict`, and
writes the comparison to `results/<machine>-planner.md` and `.json`::

    .venv/bin/python benchmarks/planner.py          # after `make bench`
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.pipeline import THREAD_VARS, machine, write_report  # noqa: E402
from benchmarks.suite import machine_name  # noqa: E402

TOLERANCE = 0.15


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.path.join(HERE, "results", machine_name(machine()) + ".json")
    parser.add_argument("--results", default=default, help=f"suite results (default {default})")
    args = parser.parse_args(argv)
    for name in THREAD_VARS:
        os.environ[name] = "1"
    # isort: off
    import hyparflow  # noqa: F401  (threads, before TensorFlow)
    from hyparflow import planner
    from hyparflow.partitioner.graph import LayerGraph

    from benchmarks.models import resnet_v1
    # isort: on

    with open(args.results) as f:
        suite = json.load(f)
    settings = suite["settings"]
    B = settings["batch_size"]
    runs = [r for r in suite["runs"] if r["kind"] == "hf" and r["result"]]
    import keras

    model = resnet_v1(settings["depth"])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")  # as the suite: its update is timed
    graph = LayerGraph(model)
    sizes = sorted({max(1, B // (r["R"] * r["m"])) for r in runs})
    profile = planner.measure(model, sizes)
    rows = []
    for r in runs:
        p = planner.predict(graph, profile, r["P"], r["R"], r["m"], B, r["schedule"])
        measured = r["result"]["median_images_per_s"]
        rows.append({"name": r["name"], "P": r["P"], "R": r["R"], "m": r["m"],
                     "schedule": r["schedule"], "measured_images_per_s": measured,
                     "predicted_images_per_s": p.images_per_s,
                     "error": p.images_per_s / measured - 1, "stage_s": p.stage_s,
                     "allreduce_s": p.allreduce_s, "sizes": p.sizes})
    base = suite.get("baseline_images_per_s")
    report = {"benchmark": "planner", "machine": machine(), "suite": args.results,
              "settings": {"depth": settings["depth"], "batch_size": B,
                           "network": "shm", "handoff_s": planner.HANDOFF},
              "profile": {"call_batch": profile.call_batch,
                          "step_seconds": profile.step_seconds},
              "keras_baseline_images_per_s": base,
              "compiled_whole_model_images_per_s": B / profile.compute(B),
              "rows": rows}
    stem = os.path.splitext(args.results)[0] + "-planner"
    write_report(report, stem + ".json")
    within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    lines = [f"# hf.plan against `{os.path.basename(args.results)}`", "",
             f"ResNet-{settings['depth']} v1, batch {B}; the profile measured in one process "
             f"(one thread): compiled forward + backward of the whole model at b = "
             f"{', '.join(str(b) for b in sizes)}; per-layer eager times at b = "
             f"{profile.call_batch}. Network: shared memory defaults; hand-off "
             f"{planner.HANDOFF * 1e6:.0f} µs per call per micro-batch.", "",
             f"Whole model, compiled forward + backward alone: "
             f"{B / profile.compute(B):.1f} images/s; `model.fit` measured by the suite: "
             f"{base:.1f} images/s." if base else "", "",
             "| configuration | measured images/s | predicted images/s | error | within ±15% |",
             "| --- | ---: | ---: | ---: | :---: |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['measured_images_per_s']:.1f} "
                     f"| {r['predicted_images_per_s']:.1f} | {r['error']:+.0%} "
                     f"| {'yes' if abs(r['error']) <= TOLERANCE else 'no'} |")
    lines += ["", f"{within} of {len(rows)} configurations within ±15%."]
    text = "\n".join(lines) + "\n"
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    print(f"written: {stem}.md, {stem}.json")


if __name__ == "__main__":
    main()
