"""On paper: hf.plan's model of ResNet-1001 at the HyPar-Flow paper's image size on 1 to 512
nodes of a Frontera-like cluster, plain data parallelism against the best hybrid, calibrated
on the cluster in a box.

Every input the box can measure is measured (`--measure`, about 30 minutes; kept in
`results/resnet1001-profile.json`), each one printed with the projection:

* the profile of ResNet-1001 v2 on CIFAR-10's 32 × 32 images, per rank: measured in a job of
  2 ranks of one thread on this 2-core machine (rank 0 times the model piece by piece, as
  hf.fit("auto") does; then both ranks time it at once: the contention of a node whose
  cores all compute);
* how a rank's step scales with its threads: the compiled step with 1 and with 2 threads,
  giving Amdahl's serial fraction f = 2 · T₂ / T₁ − 1, at 32 × 32 and at 64 × 64 (the
  larger image's is used: threads gain more on larger maps; a Frontera rank's 1 to 56
  threads and 224 × 224 images are extrapolated by Amdahl's law from it);
* how a step scales with the image: at 64 × 64 against 32 × 32 with 4 × the samples (the
  same pixels). A 224 × 224 image is then costed as 49 CIFAR images, per layer call and
  for the whole model (`--pixel-cost` scales that).

What the box cannot measure is a flag: a cluster core's speed over this one's
(`--core-speed`, 1.0), the network between nodes (HDR100: 100 Gb/s, 1.5 µs), shared memory
within a node, and the memory a rank may use (the node's over its ranks; the planner's
estimate of a configuration, its activations those of the model built at the image size).

For every node count N, ranks per node k (t = cores / k threads each) and per-node batch
(weak scaling), every configuration is predicted: data parallel (P = 1, R = N · k; m > 1
accumulates gradients, which only memory calls for) and hybrid (P dividing k: each pipeline
inside a node, replicas across nodes; 1F1B on the executor and in the step graph). Speedup:
images/s over the best one-node configuration of the same kind.

`--calibrate` checks the same model where the box can: 4 ranks on its 2 cores, ResNet-1001 on
32 × 32 images, data parallel 1 × 4 on one node (no link), then on 2 nodes × 2 ranks over a
1 Gb/s, 100 µs link data parallel 1 × 4 and the hybrid 2 × 2, against hf.fit's steps
measured there (3 rounds, interleaved; judged on a step within the calls, ±15 %); the
optimizer's update is timed first, as a stage takes it::

    .venv/bin/python benchmarks/frontera.py --measure     # measure, then project
    .venv/bin/python benchmarks/frontera.py --calibrate   # the box (about 90 minutes)
    .venv/bin/python benchmarks/frontera.py               # project from the kept measurements
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402

PROFILE = os.path.join(HERE, "results", "resnet1001-profile.json")
NODES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)
PROFILE_IMAGE = 32  # the profile's images: CIFAR-10's
PAPER_IMAGE = 224  # HyPar-Flow's Fig. 1: ResNet-1k on one 224 × 224 image needs 16.8 GB
PAPER_BYTES_ONE_IMAGE = 16.8e9
TOLERANCE = 0.15

# name: cores per node, memory per node (GiB), network between nodes, the paper's figure
SYSTEMS = {
    "frontera": dict(cores=56, memory_gib=192, latency=1.5e-6, bandwidth=100e9 / 8,
                     paper=(512, 481.0), label="Frontera (2 × Xeon 8280, 56 cores, 192 GiB, "
                                               "HDR100)"),
    "stampede2": dict(cores=48, memory_gib=192, latency=1.5e-6, bandwidth=100e9 / 8,
                      paper=(128, 110.0), label="Stampede2 SKX (2 × Xeon 8160, 48 cores, "
                                                "192 GiB, Omni-Path 100 Gb/s)"),
}
# (threads, image, sizes) of the step timings: 1 against 2 threads at both images; 64 × 64
# against 32 × 32 at 4 × the samples
STEP_JOBS = ((1, 32, (32,)), (2, 32, (32,)), (1, 64, (8,)), (2, 64, (8,)))
CALIBRATION = (dict(key="dp-node", name="1 node × 4 ranks, data parallel 1 × 4 (no link)",
                    P=1, R=4, m=1, nodes=1, rpn=4),
               dict(key="dp", name="2 nodes × 2 ranks, data parallel 1 × 4", P=1, R=4, m=1,
                    nodes=2, rpn=2),
               dict(key="hybrid", name="2 nodes × 2 ranks, hybrid 2 × 2, m = 4", P=2, R=2,
                    m=4, nodes=2, rpn=2))


def compiled_model(depth, image=PROFILE_IMAGE):
    """ResNet v2 of `depth` on `image` × `image` inputs, compiled as the suite's workers are."""
    import functools

    import keras

    from benchmarks.models import resnet_v2
    from benchmarks.planner import compiled_resnet

    return compiled_resnet(depth, keras,
                           functools.partial(resnet_v2, input_shape=(image, image, 3)))


# --- the workers ----------------------------------------------------------------------------

def worker(args):
    """`steps`: the compiled step at each size with `--threads` threads on `--image` inputs;
    `contention`: every rank of the job times the model at once against rank 0 alone."""
    harness.one_thread_per_rank(args.threads)
    import hyparflow  # noqa: F401  # isort: skip  (threads, before TensorFlow)

    from hyparflow import planner
    from hyparflow.partitioner import timing

    model = compiled_model(args.depth, args.image)
    if args.worker == "update":  # as a stage takes it; rounds, as the other timings
        seconds = [planner.update_seconds(model.optimizer, model.trainable_variables)
                   for _ in range(3)]
        harness.print_result({"update_s_each": seconds, "update_s": statistics.median(seconds)})
        return
    if args.worker == "steps":
        roles = timing.Roles(model)
        seconds = {}
        for b in args.sizes:
            xs = roles.inputs(b)
            seconds[b] = timing.typical(lambda: roles.fused(xs))
        harness.print_result({"threads": args.threads, "image": args.image, "seconds": seconds})
        return
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    found = planner.measure_contention(model, args.sizes[0], world,
                                       planner.Profile(call_seconds=[], call_batch=1))
    if world.Get_rank() == 0:
        harness.print_result({"ranks": world.Get_size(), "microbatch": args.sizes[0],
                              "contention": found.contention})


# --- measuring ------------------------------------------------------------------------------

def measure(args):
    """The profile (2 ranks), then rounds of the step timings; written to `args.profile`."""
    from benchmarks import planner as planner_bench

    started = harness.now()
    # both ranks at once on 8 samples each (the contention)
    job = argparse.Namespace(depth=args.depth, batch_size=16, model="v2", timeout=args.timeout)
    profile = planner_bench.measure_profile(job, args.sizes, 2)
    steps = []
    for r in range(args.rounds):
        for threads, image, sizes in (STEP_JOBS if r % 2 == 0 else STEP_JOBS[::-1]):
            result = _launch([sys.executable, __file__, "--worker", "steps", "--threads",
                              str(threads), "--image", str(image), "--depth", str(args.depth),
                              "--sizes", *map(str, sizes)], args.timeout)
            steps.append(dict(result, round=r))
            print(f"round {r + 1}: {threads} thread(s), {image} × {image}: "
                  f"{result['seconds']}", file=sys.stderr, flush=True)
    document = harness.report("frontera-profile", __doc__, started, depth=args.depth,
                              image=PROFILE_IMAGE, profile=dataclasses.asdict(profile),
                              steps=steps)
    document["derived"] = derived(steps)
    harness.write_report(document, args.profile)
    print(f"written: {args.profile}", flush=True)


def _launch(command, timeout):
    result, error = harness.launch(command, timeout)
    if error:
        raise SystemExit(f"{' '.join(command)}: {error}")
    return result


def derived(steps):
    """From the step timings: Amdahl's serial fraction (1 against 2 threads at 32 × 32) and
    the cost of a 64 × 64 image over four 32 × 32 ones, per round and their medians."""
    def seconds(r, threads, image, b):  # (a worker's RESULT: JSON, its sizes text)
        return next(s["seconds"][str(b)] for s in steps
                    if (s["round"], s["threads"], s["image"]) == (r, threads, image))

    rounds = sorted({s["round"] for s in steps})
    serial = {image: [2 * seconds(r, 2, image, b) / seconds(r, 1, image, b) - 1
                      for r in rounds for b in sizes]
              for image, sizes in ((32, STEP_JOBS[1][2]), (64, STEP_JOBS[3][2]))}
    pixels = [seconds(r, 1, 64, b) / seconds(r, 1, 32, 4 * b) for r in rounds
              for b in STEP_JOBS[2][2]]
    # the larger image's: the nearer to the projection's (threads gain more on larger maps)
    return {"serial_each": serial[64], "serial": max(0.0, statistics.median(serial[64])),
            "serial_32_each": serial[32], "serial_32": statistics.median(serial[32]),
            "pixel_cost_each": pixels, "pixel_cost": statistics.median(pixels)}


def load(path):
    """The kept measurements: (document, planner.Profile)."""
    from hyparflow import planner

    with open(path) as f:
        document = json.load(f)
    return document, planner.Profile(**document["profile"])


# --- the model of a node --------------------------------------------------------------------

def at_scale(profile, scale):
    """`profile` for samples `scale` times as costly: its times at b those measured at
    scale · b (a 224 × 224 image costs 49 of 32 × 32): every measured size b becomes
    b / scale samples."""
    from hyparflow import planner

    class Scaled(planner.Profile):
        def __post_init__(self):  # sizes that are fractions of a sample stay so
            pass

    def rekeyed(table):
        return {b / scale: value for b, value in table.items()}

    fields = {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile)}
    fields.update(call_batch=profile.call_batch / scale,
                  step_seconds=rekeyed(profile.step_seconds),
                  split_seconds=rekeyed(profile.split_seconds),
                  calls_by_size=rekeyed(profile.calls_by_size))
    return dataclasses.dataclass(Scaled)(**fields)


def on_node(profile, threads, serial, core_speed, contention, ranks_per_node):
    """The profile of one rank with `threads` threads of a node whose `ranks_per_node` ranks
    all compute: Amdahl's law with serial fraction `serial` over the threads (the hand-off
    of a non-last stage, Python per layer call, only with the core's speed), `contention`
    once the node's ranks are busy (k ≥ 2; measured with every core of this machine busy)."""
    scale = (serial + (1 - serial) / threads) / core_speed
    steps = {b: t * scale for b, t in profile.step_seconds.items()}
    splits = {b: steps[b] + max(0.0, profile.split_seconds[b] - profile.step_seconds[b])
              / core_speed for b in steps}
    return dataclasses.replace(profile, step_seconds=steps, split_seconds=splits,
                               update_seconds=profile.update_seconds * scale,
                               contention=contention if ranks_per_node > 1 else 1.0,
                               contention_ranks=ranks_per_node)


def project(graph, profile, system, per_node_batch, inputs, args):
    """Per node count: the best data-parallel and the best hybrid prediction (dicts; None
    where nothing fits the memory)."""
    from hyparflow import planner

    cores = system["cores"]
    network = planner.Network(system["latency"], system["bandwidth"])
    per_node = [k for k in range(1, cores + 1) if cores % k == 0]
    splits = {}
    rows = []
    for N in args.nodes:
        best = {"data parallel": None, "hybrid": None}
        for k in per_node:
            rank_profile = on_node(profile, cores // k, inputs["serial"], args.core_speed,
                                   inputs["contention"], k)
            limit = system["memory_gib"] * 2**30 / k
            ranks, batch = N * k, per_node_batch * N
            for P in [p for p in per_node if k % p == 0]:
                R = ranks // P
                kind = "data parallel" if P == 1 else "hybrid"
                for step_graph in ((False,) if P == 1 else (False, True)):
                    for m in MICROBATCHES:
                        b = batch // (R * m)
                        if b < 1 or b * R * m != batch:
                            continue
                        if (P, b, step_graph) not in splits:
                            splits[P, b, step_graph] = planner.time_split(
                                graph, profile, P, b, step_graph)
                        p = planner.predict(graph, rank_profile, P, R, m, batch, "1f1b",
                                            network="shm", allreduce_network=network,
                                            ranks_per_node=k, step_graph=step_graph,
                                            split=splits[P, b, step_graph])
                        if p.memory_bytes > limit:
                            continue
                        if best[kind] is None or p.images_per_s > best[kind]["images_per_s"]:
                            best[kind] = dict(nodes=N, ranks_per_node=k, threads=cores // k,
                                              P=P, R=R, m=m, b=b, batch=batch,
                                              step_graph=step_graph,
                                              images_per_s=p.images_per_s, step_s=p.step_s,
                                              allreduce_s=p.allreduce_s,
                                              memory_gib=p.memory_bytes / 2**30)
        rows.append(dict(best, nodes=N))
    for kind in ("data parallel", "hybrid"):
        fitting = [row[kind] for row in rows if row[kind] is not None]
        for r in fitting:  # over the fewest nodes it fits on, counted as linear up to there
            r["speedup"] = r["images_per_s"] / fitting[0]["images_per_s"] * fitting[0]["nodes"]
            r["efficiency"] = r["speedup"] / r["nodes"]
    return rows


def inputs_of(document, args):
    """The projection's inputs: measured unless a flag gives them."""
    derived_ = document.get("derived") or {}
    profile = document["profile"]
    return {"serial": args.serial if args.serial is not None else derived_.get("serial", 0.05),
            "serial_each": derived_.get("serial_each"),
            "serial_32_each": derived_.get("serial_32_each"),
            "pixel_cost": args.pixel_cost,
            "pixel_cost_measured": derived_.get("pixel_cost_each"),
            "contention": profile.get("contention", 1.0),
            "contention_ranks": profile.get("contention_ranks", 1)}


# --- the box --------------------------------------------------------------------------------

def calibrate(args):
    """Measured steps of `CALIBRATION` on the box's 4 ranks against the model."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "cluster"))
    import box as box_  # tests/cluster/box.py

    from benchmarks import cluster

    started = harness.now()
    _, profile = load(args.profile)
    # the optimizer's update as a stage takes it (gradients from numpy to a compiled apply):
    # the profile may predate the planner's measuring it so
    update = _launch([sys.executable, __file__, "--worker", "update", "--depth",
                      str(args.depth)], args.timeout)
    print(f"the update as a stage takes it: {update['update_s']:.3f} s (the profile's: "
          f"{profile.update_seconds:.3f} s)", file=sys.stderr, flush=True)
    profile = dataclasses.replace(profile, update_seconds=update["update_s"])
    contention = _launch(harness.on_ranks(4, __file__, "--worker", "contention", "--depth",
                                          str(args.depth), "--sizes", "4"), args.timeout)
    print(f"4 ranks on the 2 cores: {contention['contention']:.2f}× slower than one alone",
          file=sys.stderr, flush=True)
    job = argparse.Namespace(schedule="1f1b", balance="time", depth=args.depth, model="v2",
                             batch_size=args.batch_size, reps=args.reps, steps=args.steps,
                             seed=0, inter_op=None, timeout=args.timeout)
    links, jobs = [], []
    with box_.Box(nodes=2, profile=args.link, prefix=cluster.PREFIX) as box:
        for r in range(args.rounds):
            link = cluster.measure_link(box, args.timeout)
            links.append(dict(link, round=r))
            print(f"round {r + 1}: {link['line']}", file=sys.stderr, flush=True)
            for run in (CALIBRATION if r % 2 == 0 else CALIBRATION[::-1]):
                timed = cluster.time_run(run, box, job)
                jobs.append(dict(timed, round=r, key=run["key"]))
    rows = calibration_rows(args, profile, contention["contention"], links, jobs)
    report = harness.report("frontera-calibration", __doc__, started, depth=args.depth,
                            batch_size=args.batch_size, link=args.link, update=update,
                            contention_4_ranks=contention, links=links, jobs=jobs, rows=rows,
                            profile_file=os.path.relpath(args.profile, HERE))
    harness.write_report(report, args.calibration + ".json")
    text = calibration_markdown(report)
    with open(args.calibration + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0 if all(r["within"] for r in rows) else 1


def box_prediction(graph, profile, contention, link, run, batch_size):
    """The model of a box run: shared memory within a node, the measured link between; the
    box's 4 ranks share 2 cores, so a node's `rpn` ranks computing at once run `contention`
    slower (measured with all 4 busy)."""
    from hyparflow import planner

    boxed = dataclasses.replace(profile, contention=contention, contention_ranks=run["rpn"])
    network = planner.Network(link["latency_s"], link["bandwidth_Bps"],
                              link.get("allreduce_bandwidth_Bps"))
    return planner.predict(graph, boxed, run["P"], run["R"], run["m"], batch_size, "1f1b",
                           network="shm", allreduce_network=network,
                           ranks_per_node=run["rpn"])


def calibration_rows(args, profile, contention, links, jobs):
    harness.one_thread_per_rank()
    import hyparflow  # noqa: F401  # isort: skip  (threads, before TensorFlow)

    from hyparflow.partitioner.graph import LayerGraph

    graph = LayerGraph(compiled_model(args.depth))
    link = {key: statistics.median(lk[key] for lk in links)
            for key in ("latency_s", "bandwidth_Bps", "allreduce_bandwidth_Bps")}
    rows = []
    for run in CALIBRATION:
        done = [j["result"] for j in jobs if j["key"] == run["key"] and j["result"]]
        steps = [r["step_s"] for r in done if r.get("step_s")]
        p = box_prediction(graph, profile, contention, link, run, args.batch_size)
        step = statistics.median(steps) if steps else None
        error = float(step / p.step_s - 1) if step else None
        rows.append({"key": run["key"], "name": run["name"], "P": run["P"], "R": run["R"],
                     "m": run["m"], "measured_step_s_each": steps, "measured_step_s": step,
                     "measured_images_per_s_each": [x for r in done for x in r["images_per_s"]],
                     "predicted_step_s": float(p.step_s),
                     "predicted_stage_s": [float(t) for t in p.stage_s],
                     "predicted_allreduce_s": float(p.allreduce_s), "error": error,
                     "within": bool(error is not None and abs(error) <= TOLERANCE),
                     "errors": [j["error"] for j in jobs if j["key"] == run["key"]
                                and j["error"]]})
    return rows


def calibration_markdown(report):
    link = report["links"][0]
    lines = [f"# The projection's model on the box: ResNet-{report['depth']} v2, 32 × 32, "
             f"batch {report['batch_size']}", "",
             f"{report['started']}, commit {report['commit']}, {report['machine']['cpu']}. "
             f"4 ranks on 2 cores; between the 2 nodes the link `{report['link']}` "
             f"(round 1: {link['line']}); 4 ranks at once "
             f"{report['contention_4_ranks']['contention']:.2f}× slower than one alone; "
             "the optimizer's update as a stage takes it "
             f"{_update(report)}. "
             "Judged on a step within the calls (median of every call's steps per run).", "",
             "| configuration | measured step (s), per run | median | predicted | "
             "error | within ±15 % |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for row in report["rows"]:
        each = ", ".join(f"{s:.2f}" for s in row["measured_step_s_each"]) or "failed"
        lines.append(f"| {row['name']} | {each} | {_f(row['measured_step_s'], '.2f')} | "
                     f"{row['predicted_step_s']:.2f} | {_f(row['error'], '+.0%')} | "
                     f"{'yes' if row['within'] else 'no'} |")
    return "\n".join(lines) + "\n"


def _update(report):
    update = report.get("update")  # (records before the update was measured here)
    return "not measured (the profile's)" if update is None else f"{update['update_s']:.3f} s"


def _f(value, spec):
    return "—" if value is None else format(value, spec)


# --- the report -----------------------------------------------------------------------------

def markdown(report):
    s = report["settings"]
    i = report["inputs"]
    lines = [f"# ResNet-{report['depth']} v2 at {s['image']} × {s['image']} on paper: hf.plan's "
             f"model from 1 to {s['nodes'][-1]} nodes", "",
             f"A projection, not a measurement. Commit {report['commit']}; measurements of "
             f"{report['profile_started']} on {report['profile_machine']['cpu']}. Inputs:", "",
             f"- measured: a rank's profile with 2 ranks of one thread on 2 cores; both at once "
             f"{i['contention']:.2f}× slower than one alone (applied to a node's ranks "
             "computing at once, k ≥ 2); Amdahl serial fraction f = "
             f"{i['serial']:.3f} (1 against 2 threads at 64 × 64, per round and size: "
             f"{_list(i['serial_each'], '.3f')}; at 32 × 32: "
             f"{_list(i['serial_32_each'], '.3f')}; extrapolated to 56 threads and to "
             f"{s['image']} × {s['image']}); a 64 × 64 image over four 32 × 32 ones: "
             f"{_list(i['pixel_cost_measured'], '.2f')}",
             f"- assumed: a {s['image']} × {s['image']} image costs ({s['image']}/32)² × "
             f"{i['pixel_cost']:g} 32 × 32 ones; a cluster core × {s['core_speed']:g} this "
             "one; 100 Gb/s and 1.5 µs between nodes, shared memory within; a rank may use "
             "its node's memory over its ranks, and needs the planner's estimate (activations "
             f"of the model built at {s['image']} × {s['image']}: one image "
             f"{report['one_image_gib']:.1f} GiB with one rank, the paper's Fig. 1 says "
             f"{PAPER_BYTES_ONE_IMAGE / 1e9:g} GB)",
             "- priced: data parallel (P = 1, m > 1 accumulating) and hybrid (pipelines of P "
             "ranks within a node, 1F1B on the executor or in the step graph), every ranks "
             "per node k dividing the cores (t = cores / k threads each), every m; the best "
             "of each kind. Speedup: over the fewest nodes the kind fits on, linear up to "
             "there.", ""]
    for run in report["runs"]:
        lines += [f"## {run['label']}, {run['per_node_batch']} images per node per step", "",
                  "| nodes | data parallel: k × t, m, images/s, speedup | hybrid: k × t, P, m, "
                  "images/s, speedup | hybrid / data parallel |",
                  "| ---: | --- | --- | ---: |"]
        for row in run["rows"]:
            dp, hy = row["data parallel"], row["hybrid"]
            lines.append(f"| {row['nodes']} | {_config(dp)} | {_config(hy)} | "
                         f"{ratio(hy, dp)} |")
        nodes, figure = run["paper"]
        at = [r for r in run["rows"] if r["nodes"] == nodes]
        lines += ["", f"Paper: {figure:g}× on {nodes} nodes (hybrid over one node)." + (
            f" Model at {nodes} nodes: hybrid {speedup(at[0]['hybrid'])}, data parallel "
            f"{speedup(at[0]['data parallel'])}." if at else ""), ""]
    return "\n".join(lines) + "\n"


def _list(values, spec):
    return ", ".join(format(v, spec) for v in values) if values else "not measured"


def _config(row):
    if row is None:
        return "does not fit"
    where = f"P = {row['P']}, " if row["P"] > 1 else ""
    graph = ", step graph" if row["step_graph"] else ""
    return (f"{row['ranks_per_node']} × {row['threads']}, {where}m = {row['m']}{graph}, "
            f"{row['images_per_s']:,.1f}, {row['speedup']:.0f}×")


def ratio(a, b):
    return f"{a['images_per_s'] / b['images_per_s']:.2f}" if a and b else "—"


def speedup(row):
    return f"{row['speedup']:.0f}×" if row else "does not fit"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--measure", action="store_true", help="measure the inputs first")
    parser.add_argument("--calibrate", action="store_true",
                        help="the model against runs on the box (4 ranks on 1 and 2 nodes)")
    parser.add_argument("--depth", type=int, default=1001, help="ResNet v2 depth (1001)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="micro-batch sizes of the profile (1 2 4 8 16 32)")
    parser.add_argument("--rounds", type=int, default=3, help="of the timings (3)")
    parser.add_argument("--profile", default=PROFILE, help=f"measurements ({PROFILE})")
    parser.add_argument("--image", type=int, default=None,
                        help=f"image side of the projection ({PAPER_IMAGE})")
    parser.add_argument("--serial", type=float, default=None,
                        help="Amdahl serial fraction (default: the measured one)")
    parser.add_argument("--pixel-cost", type=float, default=1.0,
                        help="a large image's cost over its pixels' worth of 32 × 32 (1.0)")
    parser.add_argument("--core-speed", type=float, default=1.0,
                        help="a cluster core's speed over this machine's (1.0)")
    parser.add_argument("--per-node", type=int, nargs="+", default=[8, 32],
                        help="images per node per step (weak scaling; 8 32)")
    parser.add_argument("--nodes", type=int, nargs="+", default=NODES)
    parser.add_argument("--batch-size", type=int, default=16, help="of --calibrate (16)")
    parser.add_argument("--steps", type=int, default=4, help="a call's steps (--calibrate, 4)")
    parser.add_argument("--reps", type=int, default=2, help="timed calls a run (--calibrate)")
    parser.add_argument("--link", default="slow", help="the box's link (--calibrate; slow)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "frontera"))
    parser.add_argument("--calibration",
                        default=os.path.join(HERE, "results", "frontera-calibration"))
    parser.add_argument("--worker", choices=("steps", "contention", "update"), default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.image = args.image or PROFILE_IMAGE
        worker(args)
        return 0
    args.nodes = sorted(set(args.nodes))
    args.image = args.image or PAPER_IMAGE
    if args.measure:
        measure(args)
    if args.calibrate:
        return calibrate(args)
    return project_all(args)


def project_all(args):
    harness.one_thread_per_rank()
    import hyparflow  # noqa: F401  # isort: skip  (threads, before TensorFlow)

    from hyparflow import planner
    from hyparflow.partitioner.graph import LayerGraph

    document, profile = load(args.profile)
    inputs = inputs_of(document, args)
    scale = (args.image / PROFILE_IMAGE) ** 2 * args.pixel_cost
    graph = LayerGraph(compiled_model(document["depth"], args.image))
    scaled = at_scale(profile, scale)
    one_image = planner.predict(graph, scaled, 1, 1, 1, 1).memory_bytes  # one rank, one image
    runs = []
    for name, system in SYSTEMS.items():
        for per_node in args.per_node:
            runs.append(dict(system=name, label=system["label"], per_node_batch=per_node,
                             paper=system["paper"],
                             rows=project(graph, scaled, system, per_node, inputs, args)))
            print(f"projected {name}, {per_node} images per node", file=sys.stderr, flush=True)
    report = harness.report(
        "frontera", __doc__, harness.now(), depth=document["depth"],
        profile_started=document.get("started", "undated"),
        profile_machine=document["machine"], inputs=inputs,
        one_image_gib=one_image / 2**30,
        settings={"image": args.image, "core_speed": args.core_speed, "nodes": args.nodes,
                  "per_node": args.per_node, "microbatches": list(MICROBATCHES)},
        systems=SYSTEMS, runs=runs)
    harness.publish(report, args.output, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
