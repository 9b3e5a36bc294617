"""`make bench-cluster`: the cluster in a box (tests/cluster/box.py) as a benchmark, beside
hf.plan's prediction.

One invocation builds a 2-node box and, for each link profile (unshaped, slow = 1 Gb/s and
100 µs one way):

1. measures the link between the nodes (tests/cluster/try_box.py's mpi4py probe: bandwidth
   of 64 MiB messages, half the round trip of one byte; and hyparflow's own
   `planner.measure_link`, as hf.fit("auto") makes it, for the bandwidth an allreduce sees);
2. times hf.fit with the suite's worker (`suite.py --worker hf`: ResNet v1, one TensorFlow
   thread per rank, median images/s of `--reps` calls after a warm-up call), launched by
   hyparflow-run from node 0 across the box: 1 node × 1 rank (the baseline), data parallel
   and pipeline on 2 nodes × 1 rank, and a hybrid 2 × 2 on 2 nodes × 2 ranks (4 ranks on
   this 2-core machine: reported as runs, not as a speed);
3. asks hf.plan for each configuration with the measured link between the nodes and shared
   memory within a node, from a profile measured as hf.fit("auto") does (planner.py's
   profile job, outside the box).

Rounds interleave everything (the order of profiles and of configurations reverses every
round). Where boxes cannot be built (not root, not Linux, no iproute2) it prints why and
exits 0. Writes `results/<machine>-cluster.md` and `.json` (`--quick`:
`<machine>-quick-cluster.*`)::

    .venv/bin/python benchmarks/cluster.py           # ResNet-56 v1, batch 64, 2 rounds
    .venv/bin/python benchmarks/cluster.py --quick   # ResNet-20, 1 round: a smoke run
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shlex
import signal
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLUSTER_TESTS = os.path.join(ROOT, "tests", "cluster")
sys.path.insert(0, ROOT)
sys.path.insert(0, CLUSTER_TESTS)

import box as box_  # noqa: E402  (tests/cluster/box.py)
import try_box  # noqa: E402  (tests/cluster/try_box.py: the link probe)

from benchmarks import harness  # noqa: E402
from benchmarks import planner as planner_bench  # noqa: E402

PREFIX = "hfbench"  # the box's own name: never the test tier's (hfbox)
TCP_PROGRESS = "OMPI_MCA_btl_tcp_progress_thread"  # hyparflow.mpi.comm.TCP_PROGRESS
BUCKETS = "HYPARFLOW_BUCKET_MB"  # hyparflow.engine.buckets.ENV (hyparflow-run forwards it)
PROFILES = ("unshaped", "slow")
SUITE = os.path.join(HERE, "suite.py")
TOLERANCE = 0.15
# try_box.PROBE's line: "hfbench-node0 -> hfbench-node1: 119 MB/s, one-way latency 141.2 us"
PROBE_LINE = re.compile(r"(\d+(?:\.\d+)?) MB/s, one-way latency (\d+(?:\.\d+)?) us")
# hyparflow's own measurement, as hf.fit("auto") makes it: its allreduce bandwidth is priced.
LINK = """
import hyparflow
from hyparflow import planner
from mpi4py import MPI
net = planner.measure_link(MPI.COMM_WORLD)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(f"measure_link {net.latency!r} {net.bandwidth!r} {net.allreduce_bandwidth!r}", flush=True)
"""


# --- the configurations ---------------------------------------------------------------------

def configurations(args):
    """The timed configurations: name, nodes, ranks per node, P, R, m, and whether the
    machine has a core for every rank (a speed) or not (runs only)."""
    runs = [dict(key="1x1", name="1 node × 1 rank, hf 1×1 (baseline)", nodes=1, rpn=1,
                 P=1, R=1, m=1, speed=True),
            dict(key="dp", name="2 nodes × 1 rank, data parallel P=1 R=2", nodes=2, rpn=1,
                 P=1, R=2, m=1, speed=True)]
    runs += [dict(key=f"pp-m{m}", name=f"2 nodes × 1 rank, pipeline P=2 R=1 m={m}", nodes=2,
                  rpn=1, P=2, R=1, m=m, speed=True) for m in args.microbatches]
    if args.same_node:  # the same pipelines within node 0: shared memory, no link
        runs += [dict(key=f"pp1-m{m}", name=f"1 node × 2 ranks, pipeline P=2 R=1 m={m}",
                      nodes=1, rpn=2, P=2, R=1, m=m, speed=True) for m in args.microbatches]
    if args.hybrid_microbatches:
        m = args.hybrid_microbatches
        runs.append(dict(key=f"hybrid-m{m}", name=f"2 nodes × 2 ranks, hybrid P=2 R=2 m={m}",
                         nodes=2, rpn=2, P=2, R=2, m=m, speed=False))
    if args.overlap_ab:  # data parallel twice: gradient buckets during the backward, after it
        runs = [runs[0]] + [
            dict(runs[1], key=f"dp-buckets-{state}", name=f"{runs[1]['name']}, {what}",
                 env={BUCKETS: value})
            for state, value, what in (("on", "", "buckets during the backward"),
                                       ("off", "0", "one allreduce after the backward"))]
    if args.tcp_progress_ab:  # every job across nodes twice: Open MPI's TCP thread off, on
        runs = [run for run in runs if run["nodes"] == 1] + [  # the baseline first
            dict(run, key=f"{run['key']}-progress-{state}",
                 name=f"{run['name']}, TCP progress thread {state}", env={TCP_PROGRESS: value})
            for run in runs for state, value in (("off", "0"), ("on", "1"))
            if run["nodes"] > 1]
    return runs


def worker_command(run, args):
    """The suite's hf worker for `run` (one thread per rank, set by the worker itself)."""
    return [sys.executable, SUITE, "--worker", "hf", "--partitions", str(run["P"]),
            "--replicas", str(run["R"]), "--microbatches", str(run["m"]),
            "--schedule", args.schedule, "--balance", args.balance, "--depth", str(args.depth),
            "--batch-size", str(args.batch_size), "--reps", str(args.reps),
            "--steps", str(args.steps), "--seed", str(args.seed),
            "--model", getattr(args, "model", "v1")] + (
                ["--inter-op", str(args.inter_op)] if args.inter_op else [])


def command(run, box, args):
    """hyparflow-run started inside node 0: across the box's nodes with its mpiexec options,
    or (one node) a plain local launch inside node 0."""
    launcher = harness.hyparflow_run() + ["-n", str(run["P"] * run["R"]), "--threads", "1"]
    if run["nodes"] > 1:
        if run["nodes"] != box.nodes:
            raise ValueError(f"{run['name']}: the box has {box.nodes} nodes")
        launcher += ["--mpiexec-args", shlex.join(box.mpiexec_options(run["rpn"]))]
    return box.enter(0) + launcher + worker_command(run, args)


def microbatch_sizes(runs, batch_size):
    return sorted({max(1, batch_size // (r["R"] * r["m"])) for r in runs})


# --- measuring ------------------------------------------------------------------------------

def measure_link(box, timeout):
    """One-way bandwidth (bytes/s) and latency (s) between node 0 and node 1."""
    lines, seconds = try_box.run(box, try_box.PROBE, ranks_per_node=1, timeout=timeout)
    match = next((m for m in map(PROBE_LINE.search, lines) if m), None)
    if match is None:
        raise RuntimeError(f"the link probe printed no figures: {lines}")
    ours, more = try_box.run(box, LINK, ranks_per_node=1, timeout=timeout)
    found = next((line.split()[1:] for line in ours if line.startswith("measure_link ")), None)
    if found is None:
        raise RuntimeError(f"planner.measure_link printed no figures: {ours}")
    ring = float(found[2])
    return {"bandwidth_Bps": float(match.group(1)) * 1e6,
            "latency_s": float(match.group(2)) * 1e-6,
            "allreduce_bandwidth_Bps": ring, "measure_link": [float(v) for v in found],
            "line": f"{lines[0]}; an allreduce {ring / 1e6:.0f} MB/s (planner.measure_link)",
            "seconds": seconds + more}


def time_run(run, box, args):
    """One configuration's job: the worker's RESULT, or an error."""
    cmd = command(run, box, args)
    load = os.getloadavg()
    start = time.monotonic()
    with _environment(run):  # mpiexec forwards OMPI_MCA_* to every node's ranks
        result, error = harness.launch(cmd, args.timeout)
    seconds = time.monotonic() - start
    if result is not None:
        print(f"  {run['name']}: {result['median_images_per_s']:.1f} images/s "
              f"({seconds:.0f} s)", file=sys.stderr, flush=True)
    else:
        print(f"  {run['name']}: FAILED: {error}", file=sys.stderr, flush=True)
    return {"result": result, "error": error, "seconds": seconds, "load_before": list(load),
            "command": cmd}


@contextlib.contextmanager
def _environment(run):
    """The run's environment variables (`run["env"]`) set inside, put back after."""
    saved = {name: os.environ.get(name) for name in run.get("env", {})}
    os.environ.update(run.get("env", {}))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def measure(args, runs):
    """Every round: each profile (link probe, then every configuration). Returns the links,
    the timed jobs and the forwarder's counts, the box torn down."""
    links, jobs, forwarder = [], [], []
    box = box_.Box(nodes=2, profile="unshaped", prefix=PREFIX)
    with box:
        print(f"built {box.nodes} nodes: {', '.join(box.hosts)}", file=sys.stderr, flush=True)
        for r in range(args.rounds):
            profiles = args.profiles if r % 2 == 0 else args.profiles[::-1]
            order = runs if r % 2 == 0 else runs[::-1]
            for profile in profiles:
                box.shape(profile)
                link = measure_link(box, args.timeout)
                link.update(profile=profile, round=r)
                links.append(link)
                print(f"round {r + 1}, {profile}: {link['line']}", file=sys.stderr, flush=True)
                for run in order:
                    job = time_run(run, box, args)
                    job.update(profile=profile, round=r, key=run["key"])
                    jobs.append(job)
                if box.profile.latency is not None:
                    box.shape("unshaped")  # stops the forwarder, which reports its counts
                    forwarder.append({"round": r, "report": box.forwarder_report})
    return links, jobs, forwarder


# --- predicting -----------------------------------------------------------------------------

def predictions(run, link, profile, model, args):
    """(real nodes, box) hf.plan predictions of `run` with `link` between the nodes.

    Real nodes: hf.plan as a user of two real nodes calls it (shared memory within a node,
    the link between nodes, the configuration's ranks per node). Box: the two nodes are the
    same 2 cores, so every rank of the job counts for the contention; with one rank per
    node every message crosses the link, which is then the `network`. A hybrid (pipelines
    within nodes, allreduce between) cannot be said that way: its box column is the real
    nodes' one (its compute is 4 ranks on 2 cores, which no column models)."""
    import hyparflow as hf

    P, R, m = run["P"], run["R"], run["m"]
    net = {"latency": link["latency_s"], "bandwidth": link["bandwidth_Bps"]}
    if "allreduce_bandwidth_Bps" in link:
        net["allreduce_bandwidth"] = link["allreduce_bandwidth_Bps"]

    def ask(**network):
        with _environment(run):  # $HYPARFLOW_BUCKET_MB, as the run had it
            plan = hf.plan(model, P * R, args.batch_size, microbatches=[m],
                           schedules=(args.schedule,), profile=profile, verbose=0, **network)
        return plan.find(P, R, m, args.schedule)

    if run["nodes"] == 1:
        real = ask(ranks_per_node=P * R)
        return real, real
    real = ask(network="shm", allreduce_network=net, ranks_per_node=run["rpn"])
    if run["rpn"] == 1:
        return real, ask(network=net, ranks_per_node=P * R)
    return real, real


def rows_of(args, runs, links, jobs, profile):
    """Per profile and configuration: the measured median (calls of every round pooled), the
    two predictions and their errors."""
    import keras  # after hyparflow (drive imports it first: one thread)

    from benchmarks.models import resnet_v1
    from benchmarks.planner import compiled_resnet

    model = compiled_resnet(args.depth, keras, resnet_v1)
    rows = []
    for prof in args.profiles:
        found = [lk for lk in links if lk["profile"] == prof]
        link = {"latency_s": statistics.median(lk["latency_s"] for lk in found),
                "bandwidth_Bps": statistics.median(lk["bandwidth_Bps"] for lk in found)}
        rings = [lk["allreduce_bandwidth_Bps"] for lk in found if "allreduce_bandwidth_Bps" in lk]
        if rings:  # runs before it was measured priced the allreduce at the link's bandwidth
            link["allreduce_bandwidth_Bps"] = statistics.median(rings)
        base = None
        for run in runs:
            done = [j for j in jobs if j["profile"] == prof and j["key"] == run["key"]]
            rates = [x for j in done if j["result"] for x in j["result"]["images_per_s"]]
            errors = [j["error"] for j in done if j["error"]]
            measured = statistics.median(rates) if rates else None
            steps = [j["result"]["step_s"] for j in done
                     if j["result"] and j["result"].get("step_s")]
            step = statistics.median(steps) if steps else None  # of the calls' steps, per job
            real, boxed = predictions(run, link, profile, model, args)
            if run["key"] == "1x1":
                base = measured
            last = next((j["result"] for j in reversed(done) if j["result"]), None)
            rows.append({
                "profile": prof, "key": run["key"], "name": run["name"], "nodes": run["nodes"],
                "ranks_per_node": run["rpn"], "P": run["P"], "R": run["R"], "m": run["m"],
                "speed": run["speed"], "link": link, "measured_images_per_s": measured,
                "measured_images_per_s_all": rates, "errors": errors,
                "speedup": measured / base if measured and base and run["key"] != "1x1"
                else (1.0 if measured and run["key"] == "1x1" else None),
                "first_step_s": last and last["first_step_s"],
                "recv_wait_share": last and last["recv_wait_share"],
                "allreduce_share": last and last["allreduce_share"],
                "compute_share": last and last.get("compute_share"),
                "step_s_traced": last and last.get("step_s_traced"),
                "predicted_real_nodes": prediction_record(real),
                "predicted_box": prediction_record(boxed),
                "error_real_nodes": real.images_per_s / measured - 1 if measured else None,
                "error_box": boxed.images_per_s / measured - 1 if measured else None,
                # hf.plan predicts a step: judged against the steps within the calls, which
                # leave out what a call costs once (its start's agreement and broadcasts,
                # its end's gathering of the trained model)
                "measured_step_s": step,
                "error_step_real_nodes": step / real.step_s - 1 if step else None,
                "error_step_box": step / boxed.step_s - 1 if step else None})
    return rows


def prediction_record(p):
    return {"images_per_s": p.images_per_s, "step_s": p.step_s, "stage_s": p.stage_s,
            "allreduce_s": p.allreduce_s, "update_s": p.update_s, "sizes": p.sizes,
            "microbatch_size": p.microbatch_size}


# --- report ---------------------------------------------------------------------------------

def _f(value, spec, none="—"):
    return none if value is None else format(value, spec)


def _shares(values):
    return " / ".join(f"{v:.0%}" for v in values) if values else "—"


def markdown(report):
    from hyparflow import planner

    s, info, rows = report["settings"], report["machine"], report["rows"]
    profile = planner.Profile(**report["profile_used"])
    B = s["batch_size"]
    lines = [
        f"# The cluster in a box against hf.plan, ResNet-{s['depth']} v1, batch {B}", "",
        f"Started {report['started']}, took {report['minutes']:.1f} min"
        f"{' (quick: a smoke run)' if s['quick'] else ''}. {s['rounds']} round(s); each "
        f"configuration: a warm-up call, then the median images/s of {s['reps']} calls of "
        f"{s['steps']} steps (per round; rounds pooled); one TensorFlow intra-op thread per rank"
        f" and {s.get('inter_op') or 1} inter-op; "
        f"schedule {s['schedule']}, balance {s['balance']!r}.", "",
        f"Machine: {info['cpu']}, {info['usable_cores']} usable cores; {info['platform']}; "
        f"Python {info['python']}, TensorFlow {info['tensorflow']}, Keras {info['keras']}, "
        f"mpi4py {info['mpi4py']}, Open MPI {info['openmpi']}. Load average (1 min) before "
        f"the runs: {_load_range(report)}.", ""]
    if s["note"]:
        lines += [f"**Note: {s['note']}**", ""]
    lines += ["Link between the nodes (try_box's probe, per round):", "",
              "| profile | round | one-way latency (µs) | bandwidth (MB/s) |",
              "| --- | ---: | ---: | ---: |"]
    for lk in report["links"]:
        lines.append(f"| {lk['profile']} | {lk['round'] + 1} | {lk['latency_s'] * 1e6:.1f} "
                     f"| {lk['bandwidth_Bps'] / 1e6:.0f} |")
    lines += ["", f"Profile ({len(report['profiles'])} measured, mean used): compiled forward "
              f"+ backward at b = {B}: {B / profile.compute(B):.1f} images/s; optimizer update "
              f"{profile.update_seconds * 1e3:.1f} ms; contention with "
              f"{profile.contention_ranks} ranks at once {profile.contention:.3f}.", "",
              "| profile | configuration | images/s (calls) | speedup | step (ms) "
              "| predicted step, real nodes | error | predicted step, box | error "
              "| within ±15 % (box) | allreduce share | recv wait share | compute share |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | --- | --- "
              "| --- |"]
    for r in rows:
        real, boxed = r["predicted_real_nodes"]["step_s"], r["predicted_box"]["step_s"]
        if r["measured_images_per_s"] is None:
            why = (r["errors"] or ["no result"])[0].splitlines()[0]
            lines.append(f"| {r['profile']} | {r['name']} | failed: {why} | | | "
                         f"{real * 1e3:.0f} | | {boxed * 1e3:.0f} | | | | | |")
            continue
        judged = r["speed"]
        verdict = (("yes" if abs(_judged_error(r)) <= TOLERANCE else "no") if judged
                   else "not judged: runs, not a speed")
        speedup = _f(r["speedup"], ".2f")
        if not judged:
            speedup += " (4 ranks on 2 cores)"
        step = r.get("measured_step_s")
        lines.append(
            f"| {r['profile']} | {r['name']} | {r['measured_images_per_s']:.1f} | {speedup} "
            f"| {_f(step and step * 1e3, '.0f')} | {real * 1e3:.0f} "
            f"| {_f(r.get('error_step_real_nodes'), '+.0%')} | {boxed * 1e3:.0f} "
            f"| {_f(r.get('error_step_box'), '+.0%')} | {verdict} "
            f"| {_shares(r['allreduce_share'])} | {_shares(r['recv_wait_share'])} "
            f"| {_shares(r.get('compute_share'))} |")
    judged = [r for r in rows if r["speed"] and r["measured_images_per_s"] is not None]
    within = sum(abs(_judged_error(r)) <= TOLERANCE for r in judged)
    within_calls = sum(abs(r["error_box"]) <= TOLERANCE for r in judged)
    lines += ["", f"Box column: {within} of {len(judged)} timed configurations within ±15 % "
              f"on the step (on the images/s of whole calls: {within_calls} of "
              f"{len(judged)}).", "",
              "Images/s (calls): median over the calls of `--steps` steps, each call's start "
              "and end included (what a user of such short calls sees). Step: median time "
              "from the end of one step to the end of the next within the calls, slowest "
              "rank; what hf.plan predicts, and what the ±15 % is judged on. Speedup: images/s "
              "over the 1 node × 1 rank run under the same profile. Error: measured step / "
              "predicted step − 1 (+: hf.plan is too optimistic). Real nodes: `hf.plan("
              "network=\"shm\", allreduce_network=<the measured link>, ranks_per_node=<the "
              "configuration's>)`, as for two real machines (ranks of different nodes do not "
              "slow each other). Box: the two nodes share this machine's cores, so "
              "`ranks_per_node` = every rank (the measured contention applies) and `network` = "
              "the measured link (with one rank per node every message crosses it); the "
              "hybrid's box column is its real-nodes one. Shares: of a step, per rank, from one "
              "traced call (the last round's)."]
    if report["forwarder"]:
        lines += ["", "The slow profile's forwarder, per round: "
                  + "; ".join(", ".join(f["report"]) or "no report"
                              for f in report["forwarder"]) + "."]
    lines += ["", "Commands: see `jobs[].command` in the JSON file."]
    return "\n".join(lines) + "\n"


def _judged_error(row):
    """The box column's error on the step (results from before steps were timed: on the
    images/s of whole calls)."""
    step = row.get("error_step_box")
    return row["error_box"] if step is None else step


def _load_range(report):
    loads = [j["load_before"][0] for j in report["jobs"]]
    return f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"


# --- driver ---------------------------------------------------------------------------------

def drive(args):
    ok, reason = box_.available(prefix=PREFIX)
    if not ok:
        print(f"bench-cluster skipped: {reason}")
        return 0
    # SIGTERM (make, a timeout) unwinds like Ctrl-C: the box is torn down on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = datetime.datetime.now(datetime.timezone.utc)
    runs = configurations(args)
    sizes = microbatch_sizes(runs, args.batch_size)
    print(f"profile of ResNet-{args.depth} at b = {sizes} (2 ranks, outside the box)",
          file=sys.stderr, flush=True)
    profiles = [planner_bench.measure_profile(args, sizes, 2)]
    links, jobs, forwarder = measure(args, runs)
    if args.profile_after:
        profiles.append(planner_bench.measure_profile(args, sizes, 2))
    ended = datetime.datetime.now(datetime.timezone.utc)
    report = {"benchmark": "cluster", "machine": harness.machine(),
              "started": started.isoformat(timespec="seconds"),
              "minutes": (ended - started).total_seconds() / 60,
              "settings": {"quick": args.quick, "depth": args.depth,
                           "batch_size": args.batch_size, "microbatches": args.microbatches,
                           "hybrid_microbatches": args.hybrid_microbatches,
                           "tcp_progress_ab": args.tcp_progress_ab,
                           "overlap_ab": args.overlap_ab, "inter_op": args.inter_op,
                           "steps": args.steps, "reps": args.reps, "rounds": args.rounds,
                           "schedule": args.schedule, "balance": args.balance,
                           "profiles": args.profiles, "box_prefix": PREFIX,
                           "note": args.note},
              "runs": runs, "profiles": [dataclasses.asdict(p) for p in profiles],
              "links": links, "jobs": jobs, "forwarder": forwarder, "rows": None}
    name = args.name or (harness.machine_name(report["machine"])
                         + ("-quick" if args.quick else "") + "-cluster")
    stem = os.path.join(args.output_dir, name)
    # the measurements first: --report-only redoes the rest
    harness.write_report(report, stem + ".json")
    finish(report, stem)
    return 1 if any(j["error"] for j in jobs) else 0


def finish(report, stem):
    """hf.plan's predictions of the measured runs, and the report (JSON and markdown)."""
    harness.one_thread_per_rank()  # this process loads TensorFlow to predict: one thread
    import hyparflow  # noqa: F401  # isort: skip  (threads, before TensorFlow)
    from hyparflow import planner

    settings = argparse.Namespace(**report["settings"])
    profile = planner_bench.mean_profile([planner.Profile(**p) for p in report["profiles"]])
    report["profile_used"] = dataclasses.asdict(profile)
    report["rows"] = rows_of(settings, report["runs"], report["links"], report["jobs"],
                             profile)
    harness.publish(report, stem, markdown(report))


def report_only(path):
    """Predict and write the report again from a results file's measurements."""
    with open(path) as f:
        report = json.load(f)
    finish(report, os.path.splitext(path)[0])
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--quick", action="store_true",
                        help="ResNet-20, 4 steps × 2 calls, m = 4, one round: a smoke run")
    parser.add_argument("--depth", type=int, default=None, help="ResNet v1 depth (56; quick 20)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (64)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=None,
                        help="m of the pipeline runs (2 4 8; quick 4)")
    parser.add_argument("--hybrid-microbatches", type=int, default=4,
                        help="m of the 2 × 2 hybrid on 2 nodes × 2 ranks (0: leave it out)")
    parser.add_argument("--steps", type=int, default=None, help="steps per call (10; quick 4)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per run (3; quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (2; quick 1)")
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES),
                        choices=sorted(box_.PROFILES), help="link profiles (unshaped slow)")
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    parser.add_argument("--balance", default="time", help="hf.fit balance (time, as hf.plan)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per child")
    parser.add_argument("--same-node", action="store_true",
                        help="also time each pipeline on 1 node × 2 ranks (shared memory), "
                             "to tell the link's cost from the pipeline's")
    parser.add_argument("--tcp-progress-ab", action="store_true",
                        help="run every job across nodes with Open MPI's TCP progress thread "
                             "off and on (hyparflow's default: on when a job spans nodes)")
    parser.add_argument("--overlap-ab", action="store_true",
                        help="time data parallel across the nodes with its gradient buckets "
                             "reduced during the backward (hyparflow's default) and with one "
                             f"allreduce after it ({BUCKETS}=0); no pipelines")
    parser.add_argument("--inter-op", type=int, default=None,
                        help="TensorFlow inter-op threads per rank (default: one, as intra-op; "
                             "the buckets' hand-over runs beside the backward from two)")
    parser.add_argument("--note", default="",
                        help="a line for the results, e.g. that the machine was not quiet")
    parser.add_argument("--name", default=None,
                        help="results file stem (default <machine>[-quick]-cluster)")
    parser.add_argument("--output-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--report-only", metavar="JSON", default=None,
                        help="measure nothing: predict and write the report again from the "
                             "measurements in this results file")
    args = parser.parse_args(argv)
    if args.report_only:
        return report_only(args.report_only)
    q = args.quick
    for key, full, quick in (("depth", 56, 20), ("microbatches", [2, 4, 8], [4]),
                             ("steps", 10, 4), ("reps", 3, 2), ("rounds", 2, 1)):
        if getattr(args, key) is None:
            setattr(args, key, quick if q else full)
    args.profile_after = not q  # a full run measures the profile before and after the runs
    if args.steps < 2 or args.reps < 1 or args.rounds < 1:
        parser.error("--steps must be at least 2, --reps and --rounds at least 1")
    if any(m < 1 for m in args.microbatches) or args.hybrid_microbatches < 0:
        parser.error("--microbatches: every m must be at least 1")
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
