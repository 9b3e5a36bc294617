"""The planner's memory per rank against each rank's measured peak resident set, for every
schedule hf.fit runs (the step graph, interleaved and ZB-H1 included), in one run.

`partitions="auto"` and `hf.plan` leave out configurations predicted above the memory a rank
may use; this checks the prediction. Each configuration is a `hyparflow-run` job training a
ResNet (v1 by default, ResNet-110, batch 64, one TensorFlow thread a rank, SGD with
momentum): one warm-up call, then the measured call. Each rank reports, in KiB, its
resident set just before the first call (`rss_before`: TensorFlow, the model and the data
loaded) and its peak over the whole run (`ru_maxrss`: tracing and compiling included), and
over the measured call alone (`VmHWM` after a reset). The prediction is the planner's
(`planner.predict`'s `memory_bytes`) for the configuration and the cut hf.fit made, with
the largest `rss_before` of the job as its base, as `hf.plan` takes the measuring
process's; it is compared with the largest peak of the job's ranks::

    .venv/bin/python benchmarks/memory_plan.py                     # ResNet-110 v1: ~6 min here
    .venv/bin/python benchmarks/memory_plan.py --model v2 --depth 1001 --batch-size 8 \\
        --configs 1x1:1f1b:1 2x1:1f1b:4 4x1:1f1b:4
    .venv/bin/python benchmarks/memory_plan.py --model gpt2 --depth 12 --batch-size 16 \\
        --configs 1x1:1f1b:1 2x1:1f1b:4
    .venv/bin/python benchmarks/memory_plan.py --configs 2xauto:1.2 1x2:1f1b:2

`N×auto:GiB`: ``hf.fit(partitions="auto", replicas="auto")`` on N ranks with
``$HYPARFLOW_MEMORY_PER_RANK`` at GiB: the planning (its measuring of the model included) and
the configuration it chose, against the limit; its prediction is the chosen configuration's.

`--model gpt2`: keras-hub's GPT2CausalLM built from config (`--depth` layers of width 128, 4
heads, a vocabulary of 4096), on random sequences of 128 tokens (next-token targets): the
planner's constants were fitted to ResNets' layer calls, not to a transformer block's.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402
from benchmarks.memory import mib, reset_peak  # noqa: E402

# P×R:schedule[+graph]:m (zb-h1 runs in the step graph, which it turns on)
CONFIGS = ["1x2:1f1b:1", "2x1:1f1b:4", "2x1:gpipe:4", "2x1:1f1b+graph:4",
           "2x1:interleaved+graph:4", "2x1:zb-h1:4", "2x1:1f1b:8", "2x1:interleaved:8",
           "2x1:1f1b+graph:8", "2x1:interleaved+graph:8", "2x1:zb-h1:8"]
TOLERANCE = 0.15  # the target: predicted within ±15 % of measured


def parse_config(text):
    """'2x1:1f1b+graph:4' → (ranks, P, R, schedule, step_graph or None, m, None);
    '2xauto:1.2' → (2, "auto", "auto", None, None, None, 1.2): hf.fit chooses under 1.2 GiB."""
    shape, *rest = text.split(":")
    P, R = shape.split("x")
    if R == "auto":
        limit, = (float(v) for v in rest)
        if not limit > 0:
            raise ValueError(text)
        return int(P), "auto", "auto", None, None, None, limit
    schedule, m = rest
    graph = schedule.endswith("+graph")
    return (int(P) * int(R), int(P), int(R), schedule.removesuffix("+graph"),
            True if graph else None, int(m), None)


def worker(args):
    """One configuration on this job's ranks; rank 0 reports every rank's readings and the
    planner's prediction."""
    harness.one_thread_per_rank()
    import hyparflow as hf  # isort: skip  (before keras, which loads TensorFlow)
    from mpi4py import MPI

    from hyparflow.partitioner.graph import LayerGraph

    _, P, R, schedule, step_graph, m, limit = parse_config(args.configs[0])
    if limit is not None:  # (read by hf.fit's planning, on every rank)
        from hyparflow.mpi import memory

        os.environ[memory.ENV] = str(limit)
    x, y, model = job(args)
    comm = MPI.COMM_WORLD
    before = harness.current_rss()

    def run():
        how = {} if limit is not None else dict(
            microbatches=m, schedule=hf.Schedule(schedule, step_graph=step_graph))
        return hf.fit(model, x, y, partitions=P, replicas=R, batch_size=args.batch_size,
                      epochs=1, verbose=0, shuffle=False, **how)

    run()  # warm-up: cuts the model, traces and compiles
    warmup_peak = harness.maxrss()
    comm.Barrier()
    reset = reset_peak()
    run()
    peak = max(warmup_peak, harness.maxrss())
    steps_peak = harness.status_kib("VmHWM") if reset else None
    record = {"rank": comm.Get_rank(), "rss_before_kib": before, "peak_kib": peak,
              "warmup_peak_kib": warmup_peak, "steps_peak_kib": steps_peak}
    ranks = comm.gather(record, root=0)
    if comm.Get_rank() != 0:
        return
    trainer = model._hyparflow_fit
    if limit is not None:  # what the planning chose
        (P, R, m, schedule, _), = model._hyparflow_auto.values()
    result = {
        "config": args.configs[0], "limit_gib": limit, "partitions": P, "replicas": R,
        "schedule": schedule,
        "step_graph": trainer.executor.step_graph is not None, "microbatches": m,
        "stage_calls": [len(st.calls) for st in trainer.partition.stages], "ranks": ranks}
    base = max(r["rss_before_kib"] for r in ranks) * 1024
    harness.print_result({
        **result, "predicted_kib": predicted_bytes(LayerGraph(model), result,
                                                   args.batch_size) / 1024,
        "base_kib": base / 1024, "threads": harness.thread_settings()})


def predicted_bytes(graph, result, batch_size):
    """The planner's memory for a configuration a worker measured (`result`: its P, R, m,
    schedule, step graph, stage calls and ranks' readings), with the largest resident set
    before the first call of the job's ranks as its base, as `hf.plan` takes the measuring
    process's."""
    from hyparflow import planner

    P, sizes = result["partitions"], result["stage_calls"]
    base = max(r["rss_before_kib"] for r in result["ranks"]) * 1024
    return planner.predict(
        graph, planner.Profile.for_memory(graph, base), P, result["replicas"],
        result["microbatches"], batch_size, result["schedule"],
        split=sizes if P > 1 else None, chunks=len(sizes) // P,
        step_graph=result["step_graph"]).memory_bytes


def job(args):
    """(x, y, model) of the configuration's model, compiled with SGD and momentum."""
    samples = args.steps * args.batch_size
    if args.model != "gpt2":
        from benchmarks.models import resnet_v1, resnet_v2

        return harness.cifar_job(resnet_v1 if args.model == "v1" else resnet_v2, args.depth,
                                 samples, args.seed)
    import keras
    import keras_hub
    import numpy as np

    length, vocabulary = 128, 4096
    keras.utils.set_random_seed(args.seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary, num_layers=args.depth, num_heads=4, hidden_dim=128,
        intermediate_dim=512, max_sequence_length=length, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tokens = np.random.default_rng(args.seed).integers(1, vocabulary, size=(samples, length))
    x = {"token_ids": tokens.astype("int32"), "padding_mask": np.ones_like(tokens, "int32")}
    return x, np.roll(tokens, -1, axis=1).astype("int32"), model


def name(args):
    """The model, as the record's settings and its table say it."""
    if args.model == "gpt2":
        return f"GPT-2 ({args.depth} layers, width 128, 128 tokens)"
    return f"resnet_{args.model}({args.depth})"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("v1", "v2", "gpt2"), default="v1",
                        help="ResNet v1 (depth 6n+2) or v2 (depth 9n+2), or GPT-2")
    parser.add_argument("--depth", type=int, default=110,
                        help="a ResNet's depth, GPT-2's layers")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2,
                        help="optimizer steps of the warm-up call and of the measured call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="+", default=CONFIGS,
                        help="P×R:schedule[+graph]:m each (default: " + " ".join(CONFIGS) + ")")
    harness.driver_options(parser, 1200, "memory_plan.json", roles=("hf",))
    args = parser.parse_args(argv)
    harness.at_least_one(parser, args, "depth", "batch_size", "steps")
    for c in args.configs:
        try:
            parse_config(c)
        except ValueError:
            parser.error(f"--configs: {c!r} is not P×R:schedule[+graph]:m (e.g. 2x1:1f1b:4) "
                         "or N×auto:GiB (e.g. 2xauto:1.2)")
    if args.worker and len(args.configs) != 1:
        parser.error("--worker hf measures one configuration")
    return args


def table(report):
    lines = ["| configuration | stage calls | predicted (MiB) | peak, whole run (MiB) | "
             "predicted ÷ peak | peak, measured call (MiB) | predicted ÷ that |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in report["runs"]:
        if row["result"] is None:
            lines.append(f"| {row['config']} | failed: {row['error'].splitlines()[0]} "
                         "| | | | | |")
            continue
        r = row["result"]
        peak = max(k["peak_kib"] for k in r["ranks"])
        steps = [k["steps_peak_kib"] for k in r["ranks"]]
        steps = max(steps) if None not in steps else None
        ratio = "—" if steps is None else f"{r['predicted_kib'] / steps:.2f}"
        chose = (f" → {r['partitions']}×{r['replicas']}:{r['schedule']}:{r['microbatches']}"
                 if r.get("limit_gib") else "")
        lines.append(f"| {row['config']}{chose} | {'|'.join(map(str, r['stage_calls']))} "
                     f"| {mib(r['predicted_kib'])} | {mib(peak)} "
                     f"| {r['predicted_kib'] / peak:.2f} | {mib(steps)} | {ratio} |")
    return "\n".join(lines)


def drive(args):
    started = harness.now()
    measured = harness.commit()  # the code the jobs ran (the tree may change while they do)
    runs, commands = [], {}
    for config in args.configs:
        cmd = harness.on_ranks(parse_config(config)[0], __file__, "--worker", "hf", "--configs",
                               config, "--model", args.model, "--depth", str(args.depth),
                               "--batch-size", str(args.batch_size), "--steps",
                               str(args.steps), "--seed", str(args.seed))
        commands[config] = cmd
        result, error = harness.launch(cmd, args.timeout)
        runs.append({"config": config, "result": result, "error": error})
    report = harness.report(
        "memory_plan", __doc__, started,
        settings={"model": name(args),
                  "batch_size": args.batch_size, "steps": args.steps, "seed": args.seed,
                  "configs": args.configs, "threads_per_process": 1,
                  "optimizer": "SGD(learning_rate=0.01, momentum=0.9)"},
        runs=runs, commands=commands, commit=measured)
    stem = os.path.splitext(args.output)[0]
    text = (f"{report['machine']['cpu']}, commit {measured}, {started}.\n\n"
            f"{name(args)}, batch {args.batch_size}, one TensorFlow thread "
            f"a rank, {args.steps} steps a call (a warm-up call, then the measured one); the "
            "largest of the job's ranks; target: predicted within "
            f"±{TOLERANCE:.0%} of the whole run's peak.\n\n" + table(report) + "\n")
    harness.publish(report, stem, text)
    return 0 if all(r["error"] is None for r in runs) else 1


def main(argv=None):
    return harness.dispatch(parse_args(argv), worker, drive)


if __name__ == "__main__":
    sys.exit(main())
