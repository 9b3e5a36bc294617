"""The planner against measurement: hf.plan's predicted images/s beside the measured images/s of
every hf configuration of the suite, in one run.

One invocation, each step a child process with a timeout:

1. the profile, as hf.fit("auto") measures it: a two-rank job in which rank 0
   measures the ResNet alone (per-layer eager times, the compiled whole model
   fused and split at each micro-batch size, one optimizer update) and then
   both ranks time the compiled model at once (the contention of ranks sharing
   a node);
2. every hf configuration of `suite.py` (P × R = 1 × 1, 1 × 2, and 2 × 1 under
   each of --schedules, GPipe and 1F1B by default, for each m; with --step-graph those
   with each stage's step one graph), timed by the suite's own worker;
3. the profile again, so that drift of a shared machine between the profile
   and the runs shows (both are reported; the predictions use their mean).

Nothing is fitted to the measured runs. Writes `results/<machine>-planner.md`
and `.json`::

    .venv/bin/python benchmarks/planner.py           # ResNet-110, batch 64: ~25 min here
    .venv/bin/python benchmarks/planner.py --quick   # ResNet-20, batch 32: a smoke run
"""

import argparse
import dataclasses
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness, suite  # noqa: E402

TOLERANCE = 0.15


def profile_worker(args):
    """Rank 0 measures alone, then every rank times the compiled model at once; RESULT line."""
    harness.one_thread_per_rank()
    if args.inter_op:  # as the timed jobs run (cluster.py --inter-op): Profile.inter_op
        os.environ["TF_NUM_INTEROP_THREADS"] = str(args.inter_op)
    import hyparflow  # noqa: F401  # isort: skip  (threads, before TensorFlow)
    import keras
    from mpi4py import MPI

    from benchmarks.models import resnet_v1, resnet_v2
    from hyparflow import planner
    from hyparflow.mpi import comm as comm_

    world = MPI.COMM_WORLD
    model = compiled_resnet(args.depth, keras, resnet_v2 if args.model == "v2" else resnet_v1)

    profile = comm_.from_root(world, lambda: planner.measure(model, args.sizes), "measuring")
    profile = planner.measure_contention(model, args.batch_size // world.Get_size(), world,
                                         profile)
    if world.Get_rank() == 0:
        harness.print_result(dataclasses.asdict(profile))


def compiled_resnet(depth, keras, build):
    """The suite's model: `build` (ResNet v1 or v2) of `depth`, compiled as its worker compiles
    it (the update is timed)."""
    keras.utils.set_random_seed(0)
    model = build(depth)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def measure_profile(args, sizes, ranks):
    """The profile a `ranks`-rank job measures (see `profile_worker`), as a `Profile`."""
    from hyparflow import planner

    cmd = harness.on_ranks(ranks, __file__, "--worker", "profile", "--depth", str(args.depth),
                           "--batch-size", str(args.batch_size),
                           "--sizes", *[str(b) for b in sizes],
                           "--model", getattr(args, "model", "v1"))
    if getattr(args, "inter_op", None):
        cmd += ["--inter-op", str(args.inter_op)]
    result, error = harness.launch(cmd, args.timeout)
    if error:
        raise SystemExit(f"profile: {error}")
    return planner.Profile(**result)


def mean_profile(profiles):
    """The mean of the profiles' timings (the per-layer times of the first: they only split)."""
    first = profiles[0]
    return dataclasses.replace(
        first, **{key: {b: statistics.mean(getattr(p, key)[b] for p in profiles)
                        for b in getattr(first, key)}
                  for key in ("step_seconds", "split_seconds")},
        **{key: statistics.mean(getattr(p, key) for p in profiles)
           for key in ("update_seconds", "contention")})


def predict_rows(args, runs, profile):
    import keras

    from benchmarks.models import resnet_v1
    from hyparflow import planner
    from hyparflow.partitioner.graph import LayerGraph

    graph = LayerGraph(compiled_resnet(args.depth, keras, resnet_v1))
    rows = []
    for run in runs:
        p = planner.predict(graph, profile, run["P"], run["R"], run["m"], args.batch_size,
                            run["schedule"], ranks_per_node=2,
                            step_graph=bool(run.get("step_graph")))
        measured = run["result"]["median_images_per_s"]
        step = run["result"].get("step_s")  # a step within the calls: without a call's own cost
        rows.append({"name": run["name"], "P": run["P"], "R": run["R"], "m": run["m"],
                     "schedule": run["schedule"], "measured_images_per_s": measured,
                     "measured_images_per_s_all": run["result"]["images_per_s"],
                     "predicted_images_per_s": p.images_per_s,
                     "error": float(p.images_per_s / measured - 1),
                     "measured_step_s": step, "predicted_step_s": p.step_s,
                     "step_error": float(step / p.step_s - 1) if step else None,
                     "stage_s": p.stage_s,
                     "allreduce_s": p.allreduce_s, "update_s": p.update_s, "sizes": p.sizes,
                     "handoff_s_per_call": profile.handoff(p.microbatch_size)})
    return rows


def markdown(report):
    from hyparflow import planner

    s, rows = report["settings"], report["rows"]
    before, after = (planner.Profile(**p) for p in report["profiles"])
    sizes = sorted(before.step_seconds)
    B = s["batch_size"]
    within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    lines = [
        f"# hf.plan against measurement, ResNet-{s['depth']} v1, batch {B}", "",
        f"Machine: {report['machine']['cpu']}, {report['machine']['usable_cores']} "
        f"cores; {report['started']}, {report['minutes']:.0f} min.", "",
        "Profile (rank 0 alone, then 2 ranks at once), before / after the runs:", "",
        "| | before | after |", "| --- | ---: | ---: |",
        f"| compiled forward + backward, b = {B}: images/s "
        f"| {B / before.compute(B):.1f} | {B / after.compute(B):.1f} |",
        f"| hand-off per call, b = {sizes[0]} / {B} (µs) "
        f"| {before.handoff(sizes[0]) * 1e6:.0f} / {before.handoff(B) * 1e6:.0f} "
        f"| {after.handoff(sizes[0]) * 1e6:.0f} / {after.handoff(B) * 1e6:.0f} |",
        f"| optimizer update (ms) | {before.update_seconds * 1e3:.1f} "
        f"| {after.update_seconds * 1e3:.1f} |",
        f"| contention, 2 ranks at once | {before.contention:.3f} "
        f"| {after.contention:.3f} |", "",
        "Predictions from the mean of the two profiles (network: shared-memory defaults).", "",
        "The error is judged on whole calls (images/s over each call, its own start and end "
        "included); the step columns compare the predicted step with the median step within "
        "the calls (one step's end to the next), which leaves out what a call does once.", "",
        "| configuration | measured images/s | predicted images/s | error | within ±15% "
        "| step within calls (ms) | predicted step (ms) | step error |",
        "| --- | ---: | ---: | ---: | :---: | ---: | ---: | ---: |"]
    for r in rows:
        step = r.get("measured_step_s")
        on_step = (f"| {step * 1e3:.0f} | {r['predicted_step_s'] * 1e3:.0f} "
                   f"| {r['step_error']:+.0%} |" if step else "| | | |")
        lines.append(f"| {r['name']} | {r['measured_images_per_s']:.1f} "
                     f"| {r['predicted_images_per_s']:.1f} | {r['error']:+.0%} "
                     f"| {'yes' if abs(r['error']) <= TOLERANCE else 'no'} " + on_step)
    stepped = [r for r in rows if r.get("step_error") is not None]
    lines += ["", f"{within} of {len(rows)} configurations within ±15%; with the profile "
              f"before the runs alone: {report['within_before']} of {len(rows)}, after: "
              f"{report['within_after']} of {len(rows)}."]
    if stepped:
        near = sum(abs(r["step_error"]) <= TOLERANCE for r in stepped)
        lines.append(f"On the step within calls: {near} of {len(stepped)} within ±15% "
                     "(an error's sign as above: + where the prediction is the faster).")
    return "\n".join(lines) + "\n"


def drive(args):
    import datetime

    harness.one_thread_per_rank()  # this process loads TensorFlow to predict: one thread
    import hyparflow  # noqa: F401 (threads, before TensorFlow)

    started = datetime.datetime.now(datetime.timezone.utc)
    options = ["--depth", str(args.depth), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--reps", str(args.reps), "--peers",
               "--schedules", *args.schedules, "--microbatches"] + [str(m) for m in
                                                                   args.microbatches]
    if args.step_graph:
        options.append("--step-graph")
    suite_args = suite.parse_args(options)
    runs = [r for r in suite.configurations(suite_args) if r["kind"] == "hf"]
    sizes = sorted({max(1, args.batch_size // (r["R"] * r["m"])) for r in runs})
    profiles = [measure_profile(args, sizes, 2)]
    for run in runs:
        result, error = harness.launch(suite.command(run, suite_args), args.timeout)
        if error:
            raise SystemExit(f"{run['name']}: {error}")
        run["result"] = result
        print(f"{run['name']}: {result['median_images_per_s']:.1f} images/s", file=sys.stderr,
              flush=True)
    profiles.append(measure_profile(args, sizes, 2))
    rows = predict_rows(args, runs, mean_profile(profiles))
    within = {}
    for which, p in (("before", profiles[0]), ("after", profiles[1])):
        within[which] = sum(bool(abs(r["error"]) <= TOLERANCE)
                            for r in predict_rows(args, runs, p))
    report = {"benchmark": "planner", "machine": harness.machine(),
              "started": started.isoformat(timespec="seconds"),
              "minutes": (datetime.datetime.now(datetime.timezone.utc)
                          - started).total_seconds() / 60,
              "settings": {"depth": args.depth, "batch_size": args.batch_size,
                           "microbatches": args.microbatches, "steps": args.steps,
                           "reps": args.reps, "network": "shm", "ranks_per_node": 2,
                           "schedules": args.schedules, "step_graph": args.step_graph},
              "profiles": [dataclasses.asdict(p) for p in profiles], "rows": rows,
              "within_before": within["before"], "within_after": within["after"]}
    name = args.name or (harness.machine_name(report["machine"])
                         + ("-quick" if args.quick else "") + "-planner")
    stem = os.path.join(args.output_dir, name)
    harness.publish(report, stem, markdown(report))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--quick", action="store_true", help="ResNet-20, batch 32, m ≤ 4")
    parser.add_argument("--depth", type=int, default=None, help="ResNet v1 depth (110)")
    parser.add_argument("--batch-size", type=int, default=None, help="(64)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=None,
                        help="m of the pipelined runs (1 2 4 8 16)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child")
    parser.add_argument("--output-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", choices=("profile",), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"],
                        choices=("gpipe", "1f1b", "interleaved", "zb-h1"),
                        help="of the P = 2 runs (zb-h1: with --step-graph)")
    parser.add_argument("--step-graph", action="store_true",
                        help="the P = 2 runs (and their predictions) with the step graph")
    parser.add_argument("--name", default=None,
                        help="results file stem (default: the machine's, then -planner)")
    parser.add_argument("--inter-op", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=("v1", "v2"), default="v1", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.depth = args.depth or (20 if args.quick else 110)
    args.batch_size = args.batch_size or (32 if args.quick else 64)
    args.microbatches = args.microbatches or ([1, 4] if args.quick else [1, 2, 4, 8, 16])
    if args.quick:
        args.steps, args.reps = min(args.steps, 4), min(args.reps, 2)
    return harness.dispatch(args, profile_worker, drive)


if __name__ == "__main__":
    sys.exit(main())
