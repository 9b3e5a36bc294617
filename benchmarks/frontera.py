"""On paper: hf.plan's model of ResNet-1001 on 1 to 512 nodes of a Frontera-like cluster,
pure data parallel against the best hybrid, beside the HyPar-Flow paper's figures.

The profile of ResNet-1001 v2 (3338 layer calls, 10.3 M parameters, CIFAR-10
shapes) is measured once on this machine with one thread (`--measure`, about
15 minutes; kept in `results/resnet1001-profile.json`). A node of a system is
then modelled from it, with every assumption a flag:

* a rank with t threads computes in ``C(b) · (f + (1 − f)/t) / core_speed``
  (Amdahl, serial fraction f = `--serial`; this 2-core machine cannot measure
  how TensorFlow scales to 56 threads, so f is swept); C(b) beyond the largest
  size measured (32) is extrapolated along the last measured segment;
* the hand-off of a non-last stage (Python, per layer call) does not scale
  with threads, only with the core's speed;
* ranks of a node computing at once are `--contention` times slower than
  alone (1.0: this machine's two ranks say little of 56 cores sharing memory);
* messages inside a node cost the shared-memory defaults, between nodes the
  system's network (100 Gb/s); the allreduce is a ring across all replicas;
* a rank may use the node's memory over its ranks per node, and needs the
  planner's estimate (`Prediction.memory_bytes`).

For every node count N and ranks per node k (t = cores / k threads each), the
global batch is `--per-core` samples per core of the job (weak scaling), and
every configuration is predicted: data parallel (P = 1, R = N·k; m > 1 is
gradient accumulation, which only memory can call for) and hybrid (P dividing k:
each pipeline inside a node, replicas across nodes, m micro-batches, 1F1B).
Speedup is images/s over the best one-node configuration of the same kind::

    .venv/bin/python benchmarks/frontera.py --measure   # measure the profile, then project
    .venv/bin/python benchmarks/frontera.py             # project from the kept profile
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import harness  # noqa: E402

PROFILE = os.path.join(HERE, "results", "resnet1001-profile.json")
NODES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
MICROBATCHES = (1, 2, 4, 8, 16, 32)

# name: cores per node, memory per node (GiB), network between nodes, the paper's figure
SYSTEMS = {
    "frontera": dict(cores=56, memory_gib=192, latency=1.5e-6, bandwidth=100e9 / 8,
                     paper=(512, 481.0), label="Frontera (2 × Xeon 8280, 56 cores, HDR100)"),
    "stampede2": dict(cores=48, memory_gib=192, latency=1.5e-6, bandwidth=100e9 / 8,
                      paper=(128, 110.0), label="Stampede2 SKX (2 × Xeon 8160, 48 cores, "
                                                "Omni-Path 100 Gb/s)"),
}


def compiled_model(depth):
    """ResNet v2 of `depth`, compiled with SGD + momentum (its update is timed), one thread."""
    harness.one_thread_per_rank()
    import hyparflow  # noqa: F401  # isort: skip  (threads, before TensorFlow)
    import keras

    from benchmarks.models import resnet_v2

    model = resnet_v2(depth)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def measure(model, args):
    """Profile `model` in this process; write it to `args.profile`."""
    import dataclasses

    from hyparflow import planner

    profile = planner.measure(model, args.sizes, call_batch=max(args.sizes))
    document = {"depth": args.depth, "machine": harness.machine(),
                "profile": dataclasses.asdict(profile)}
    harness.write_report(document, args.profile)
    print(f"written: {args.profile}", flush=True)


def load_profile(path):
    from hyparflow import planner

    with open(path) as f:
        document = json.load(f)
    return document, planner.Profile(**document["profile"])


def on_node(profile, threads, serial, core_speed, contention, ranks_per_node):
    """The profile of one rank with `threads` threads of a node's cores (see the module doc)."""
    from dataclasses import replace

    scale = (serial + (1 - serial) / threads) / core_speed
    steps = {b: t * scale for b, t in profile.step_seconds.items()}
    splits = {b: steps[b] + max(0.0, profile.split_seconds[b] - profile.step_seconds[b])
              / core_speed for b in steps}
    return replace(profile, step_seconds=steps, split_seconds=splits,
                   update_seconds=profile.update_seconds * scale, contention=contention,
                   contention_ranks=ranks_per_node)


def project(graph, profile, system, args):
    """Per node count: the best data-parallel and the best hybrid prediction (dicts)."""
    from hyparflow import planner

    cores = system["cores"]
    network = planner.Network(system["latency"], system["bandwidth"])
    per_node = [k for k in range(1, cores + 1) if cores % k == 0]
    splits = {}
    rows = []
    for N in args.nodes:
        best = {"data parallel": None, "hybrid": None, "one process per node": None}
        for k in per_node:
            rank_profile = on_node(profile, cores // k, args.serial, args.core_speed,
                                   args.contention, k)
            limit = system["memory_gib"] * 2**30 / k
            ranks, batch = N * k, args.per_core * cores * N
            for P in [p for p in per_node if k % p == 0]:
                R = ranks // P
                if P not in splits:
                    splits[P] = planner.time_split(graph, profile, P)
                for m in MICROBATCHES:  # P = 1: m > 1 accumulates gradients, for memory
                    if batch // (R * m) < 1:
                        continue
                    p = planner.predict(graph, rank_profile, P, R, m, batch, "1f1b",
                                        network="shm", allreduce_network=network,
                                        ranks_per_node=k, split=splits[P])
                    if p.memory_bytes > limit:
                        continue
                    kinds = ["data parallel" if P == 1 else "hybrid"]
                    if P == 1 and k == 1:
                        kinds.append("one process per node")
                    for kind in kinds:
                        if best[kind] is None or p.images_per_s > best[kind]["images_per_s"]:
                            best[kind] = dict(nodes=N, ranks_per_node=k, threads=cores // k,
                                              P=P, R=R, m=m, batch=batch,
                                              images_per_s=p.images_per_s, step_s=p.step_s,
                                              allreduce_s=p.allreduce_s,
                                              memory_gib=p.memory_bytes / 2**30)
        rows.append(dict(best, nodes=N))  # a kind is None where nothing fits in memory
    for kind in ("data parallel", "hybrid", "one process per node"):
        fitting = [row[kind] for row in rows if row[kind] is not None]
        for r in fitting:  # over the fewest nodes it fits on, counted as linear up to there
            r["speedup"] = r["images_per_s"] / fitting[0]["images_per_s"] * fitting[0]["nodes"]
            r["efficiency"] = r["speedup"] / r["nodes"]
    return rows


def markdown(report):
    lines = [f"# ResNet-{report['depth']} on paper: hf.plan's model from 1 to "
             f"{report['settings']['nodes'][-1]} nodes", "",
             f"Profile measured on {report['profile_machine']['cpu']} (one thread); "
             f"{report['settings']['per_core']} samples per core per step (weak scaling); "
             f"core speed × {report['settings']['core_speed']:g}; contention "
             f"{report['settings']['contention']:g}. Speedup: images/s over the best "
             "one-node configuration of the same kind (k × t: ranks per node × threads).", ""]
    for run in report["runs"]:
        lines += [f"## {run['label']}, serial fraction f = {run['serial']:g}", "",
                  "| nodes | data parallel: k × t, images/s, speedup | hybrid: k × t, P, m, "
                  "images/s, speedup | hybrid / data parallel | hybrid / one process per node "
                  "|", "| ---: | --- | --- | ---: | ---: |"]
        for row in run["rows"]:
            dp, hy, one = row["data parallel"], row["hybrid"], row["one process per node"]
            lines.append(
                f"| {row['nodes']} | " + (f"{dp['ranks_per_node']} × {dp['threads']}, "
                                          f"{dp['images_per_s']:,.0f}, {dp['speedup']:.1f}×"
                                          if dp else "does not fit")
                + " | " + (f"{hy['ranks_per_node']} × {hy['threads']}, P = {hy['P']}, "
                           f"m = {hy['m']}, {hy['images_per_s']:,.0f}, {hy['speedup']:.1f}×"
                           if hy else "does not fit")
                + f" | {ratio(hy, dp)} | {ratio(hy, one)} |")
        nodes, figure = run["paper"]
        at = [r for r in run["rows"] if r["nodes"] == nodes]
        lines += ["", f"Paper: {figure:g}× on {nodes} nodes." + (
            f" Model at {nodes} nodes: hybrid {speedup(at[0]['hybrid'])}, data parallel "
            f"{speedup(at[0]['data parallel'])}." if at else ""), ""]
    return "\n".join(lines) + "\n"


def ratio(a, b):
    return f"{a['images_per_s'] / b['images_per_s']:.2f}" if a and b else "—"


def speedup(row):
    return f"{row['speedup']:.0f}×" if row else "does not fit"


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SYSTEMS), figsize=(12, 4.5), sharey=True)
    for ax, name in zip(axes, SYSTEMS):
        for run in [r for r in report["runs"] if r["system"] == name]:
            for kind, style in (("hybrid", "-"), ("data parallel", "--")):
                points = [(row["nodes"], row[kind]["images_per_s"]) for row in run["rows"]
                          if row[kind]]
                if points:
                    ax.plot(*zip(*points), style, marker="o", ms=3,
                            label=f"{kind}, f = {run['serial']:g}")
        n, figure = SYSTEMS[name]["paper"]
        ax.set(xscale="log", yscale="log", xlabel="nodes",
               title=f"{SYSTEMS[name]['label']}\n(paper: {figure:g}× over one node on {n} "
                     "nodes)")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("predicted images/s (weak scaling)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--measure", action="store_true", help="measure the profile first")
    parser.add_argument("--depth", type=int, default=1001, help="ResNet v2 depth (1001)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="micro-batch sizes to measure (1 2 4 8 16 32)")
    parser.add_argument("--profile", default=PROFILE, help=f"profile file ({PROFILE})")
    parser.add_argument("--serial", type=float, nargs="+", default=[0.02, 0.05, 0.1],
                        help="Amdahl serial fractions of a rank's threads (0.02 0.05 0.1)")
    parser.add_argument("--core-speed", type=float, default=1.0,
                        help="a cluster core's speed over this machine's (1.0)")
    parser.add_argument("--contention", type=float, default=1.0,
                        help="slowdown of a rank while every rank of its node computes (1.0)")
    parser.add_argument("--per-core", type=int, default=4, help="samples per core per step (4)")
    parser.add_argument("--nodes", type=int, nargs="+", default=NODES)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "frontera"))
    args = parser.parse_args(argv)
    args.nodes = sorted(set(args.nodes))
    if args.measure:
        model = compiled_model(args.depth)
        measure(model, args)
    document, profile = load_profile(args.profile)
    if not args.measure:
        model = compiled_model(document["depth"])
    from hyparflow.partitioner.graph import LayerGraph

    graph = LayerGraph(model)
    runs = []
    for name, system in SYSTEMS.items():
        for serial in args.serial:
            args_f = argparse.Namespace(**dict(vars(args), serial=serial))
            runs.append(dict(system=name, label=system["label"], serial=serial,
                             paper=system["paper"], rows=project(graph, profile, system, args_f)))
            print(f"projected {name}, f = {serial}", file=sys.stderr, flush=True)
    report = {"benchmark": "frontera", "depth": document["depth"],
              "profile_machine": document["machine"], "machine": harness.machine(),
              "settings": {"per_core": args.per_core, "core_speed": args.core_speed,
                           "contention": args.contention,
                           "nodes": args.nodes, "serial": args.serial,
                           "microbatches": list(MICROBATCHES)},
              "systems": SYSTEMS, "runs": runs}
    harness.write_report(report, args.output + ".json")
    text = markdown(report)
    with open(args.output + ".md", "w") as f:
        f.write(text)
    plot(report, args.output + ".png")
    print(text)
    print(f"written: {args.output}.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
