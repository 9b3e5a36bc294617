"""`make bench`: every configuration of the benchmark in one run,
written to results/<machine>.md, .json and PNG plots.

One invocation runs, each as a child process with a timeout, on the same
ResNet and the same random CIFAR-shaped data:

* single-process `model.fit` with one TensorFlow thread (the baseline; run
  first, in the middle and last, its repetitions pooled, so that drift of a
  shared machine shows and is averaged) and with every core;
* `hf.fit` at (P, R) = (1, 1), (1, 2) and (2, 1) with m micro-batches under
  GPipe and 1F1B, one TensorFlow thread per rank;
* the peers, when their environments exist (`make peers`): Horovod
  (`.venv-horovod`, TensorFlow 2.15) single process and R = 2, and PyTorch's
  `torch.distributed.pipelining` (`.venv-torch`) single process and P = 2
  under GPipe and 1F1B; a missing peer is reported and skipped;
* the largest ResNet v2 depth whose training fits under a per-rank memory cap
  at P = 1, 2, 4 (`--cap-gib`).

Per configuration: images/s (median of `--reps` timed calls after a warm-up),
speedup over the single-process baseline of the same run (a peer: over its
own single process), efficiency against the bound (P·m/(m + P − 1) for a
pipeline, R for data parallelism), time to first step, peak RSS per rank and,
for hf, the share of a step each rank waits on receives and on the allreduce::

    .venv/bin/python benchmarks/suite.py            # ResNet-110 v1, batch 64: about an hour here
    .venv/bin/python benchmarks/suite.py --quick    # ResNet-20, fewer configurations: ~9 min
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from benchmarks.pipeline import bubble_bound  # noqa: E402

PEERS = {
    "horovod": (os.path.join(ROOT, ".venv-horovod"), "benchmarks/peers/horovod_resnet.py",
                "bash benchmarks/peers/setup_horovod.sh"),
    "torch": (os.path.join(ROOT, ".venv-torch"), "benchmarks/peers/torch_pipeline.py",
              "bash benchmarks/peers/setup_torch.sh"),
}


# --- worker: one Keras or hf configuration, printed as a RESULT line ------------------------

def worker(args):
    """Warm-up call (timing its first step), `reps` timed calls, one traced call; RESULT line."""
    harness.one_thread_per_rank(args.threads)  # set before TensorFlow loads
    if args.inter_op:  # TensorFlow's inter-op pool alone (a gradient bucket's hand-over op)
        os.environ["TF_NUM_INTEROP_THREADS"] = str(args.inter_op)
    import hyparflow as hf  # isort: skip  (before TensorFlow)
    import keras

    from benchmarks.models import resnet_v1, resnet_v2
    from hyparflow.data.batches import default_microbatches

    samples = args.steps * args.batch_size
    x, y, model = harness.cifar_job(resnet_v1 if args.model == "v1" else resnet_v2, args.depth,
                                    samples, args.seed)
    comm = None
    if args.worker == "hf":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if comm.Get_size() != args.partitions * args.replicas:
            raise SystemExit(f"--worker hf needs {args.partitions * args.replicas} ranks, "
                             f"got {comm.Get_size()}")

    # --planned-steps: each call plans that many steps (epochs of the same batches), as a
    # long training job does (hf.fit's defaults weigh them), and is stopped after --steps
    epochs = 1 if not args.planned_steps else -(-args.planned_steps // args.steps)
    done = []

    def stop_after_steps(batch, logs):
        done.append(batch)
        if len(done) % args.steps == 0:
            model.stop_training = True

    stopper = keras.callbacks.LambdaCallback(on_train_batch_end=stop_after_steps)
    stopper.batch_hooks_read_weights = False  # (it reads no weight)

    def run(callbacks):
        if comm is None:
            model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False,
                      callbacks=callbacks)
        else:
            speed = {} if args.defaults else dict(
                microbatches=args.microbatches, balance=args.balance,
                schedule=hf.Schedule(args.schedule, step_graph=args.step_graph or None))
            hf.fit(model, x, y, partitions=args.partitions, replicas=args.replicas,
                   batch_size=args.batch_size, epochs=epochs, verbose=0, shuffle=False,
                   callbacks=callbacks + [stopper] * (epochs > 1), **speed)

    def slowest(seconds):
        return seconds if comm is None else comm.allreduce(seconds, op=MPI.MAX)

    ends = []
    timer = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(time.perf_counter()))
    timer.batch_hooks_read_weights = False  # (it reads no weight)
    if comm is not None:
        comm.Barrier()
    start = time.perf_counter()
    run(callbacks=[timer])  # warm-up: partitions, traces and compiles
    first_step = ends[0] - start
    later = [b - a for a, b in zip(ends, ends[1:])]
    seconds, steady = [], []  # per call; the steps within the calls (end of one to the next)
    for _ in range(args.reps):
        if comm is not None:
            comm.Barrier()
        ends.clear()
        begin = time.perf_counter()
        run(callbacks=[timer])
        seconds.append(slowest(time.perf_counter() - begin))
        steady += [b - a for a, b in zip(ends, ends[1:])]
    record = {"peak_mib": harness.maxrss() / 1024, "first_step_s": first_step,
              "later_step_s": statistics.median(later) if later else None,
              "step_s": statistics.median(steady) if steady else None}
    shares = None
    if comm is not None and args.reps:
        path = os.path.join(tempfile.gettempdir(), f"hf-suite-{os.getppid()}.json")
        run(callbacks=[hf.Trace(path)])
        if comm.Get_rank() == 0:
            with open(path) as f:
                shares = wait_shares(json.load(f), comm.Get_size())
            os.remove(path)
    records = [record] if comm is None else comm.gather(record, root=0)
    if comm is not None and comm.Get_rank() != 0:
        return
    rates = [samples / s for s in seconds]
    first = max(r["first_step_s"] for r in records)
    later_step = max((r["later_step_s"] for r in records if r["later_step_s"]), default=None)
    # a step is over when its slowest rank is (every rank ends a step after the same messages)
    step = max((r["step_s"] for r in records if r["step_s"]), default=None)
    harness.print_result({
        "worker": args.worker, "model": f"resnet_{args.model}({args.depth})",
        "ranks": len(records), "threads": args.threads, "seconds": seconds,
        "images_per_s": rates, "median_images_per_s": statistics.median(rates) if rates else None,
        "step_s": step,
        "first_step_s": first,
        "trace_compile_s": first - later_step if later_step is not None else None,
        "peak_rss_mib": [r["peak_mib"] for r in records],
        "microbatches": None if comm is None else args.microbatches if not args.defaults
        else default_microbatches(args.partitions,
                                  args.batch_size // args.replicas),
        "stage_calls": None if comm is None else  # the cut hf.fit made
        [len(s.calls) for s in model.__dict__["_hyparflow_fit"].partition.stages],
        "chose": None if comm is None else chose(model.__dict__["_hyparflow_fit"]),
        "recv_wait_share": shares and shares["recv wait"],
        "allreduce_share": shares and shares["allreduce"],
        "compute_share": shares and shares["compute"],
        "optimizer_share": shares and shares["optimizer"],
        "step_s_traced": shares and shares["step"]})


def chose(trainer):
    """What hf.fit ran: the schedule (as the docs call it), whether in the step graph, and
    the balance method of its cut."""
    return {"schedule": trainer.executor.schedule.title,
            "step_graph": trainer.executor.step_graph is not None,
            "balance": trainer.partition.method}


def wait_shares(document, ranks):
    """Per rank, the median over steps of the share of the step spent in receive waits,
    allreduce, compute (forward, backward, both fused) and the optimizer's update; "step":
    the median step (s)."""
    from hyparflow import trace

    steps = sorted({s[3] for s in trace.spans_of(document)})
    out = {"step": statistics.median(trace.step_shares(document, step, ())[0]
                                     for step in steps)}
    for name, kinds in (("recv wait", ("recv wait",)), ("allreduce", ("allreduce",)),
                        ("compute", trace.COMPUTE), ("optimizer", ("optimizer",))):
        per_step = [trace.step_shares(document, step, kinds)[1] for step in steps]
        out[name] = [statistics.median(shares.get(rank, 0.0) for shares in per_step)
                     for rank in range(ranks)]
    return out


# --- configurations -------------------------------------------------------------------------

def configurations(args):
    """The runs of this invocation, in order: dicts with name, kind and their settings."""
    runs = [dict(name="keras 1 thread", kind="keras", threads=1, baseline=True),
            dict(name=f"keras {args.cores} threads", kind="keras", threads=args.cores)]
    runs += [dict(name="hf 1×1", kind="hf", P=1, R=1, m=1, schedule="1f1b"),
             dict(name="hf 1×2 (data parallel)", kind="hf", P=1, R=2, m=1, schedule="1f1b")]
    for schedule in args.schedules:
        for m in args.microbatches:
            runs.append(dict(name=f"hf 2×1 {schedule} m={m}"
                             + (" step graph" if args.step_graph else ""), kind="hf", P=2,
                             R=1, m=m, schedule=schedule, step_graph=args.step_graph))
    runs.append(dict(name="keras 1 thread (middle)", kind="keras", threads=1, baseline=True))
    if "horovod" in args.peers:
        runs += [dict(name="horovod 1 process", kind="horovod", mode="single", ranks=1),
                 dict(name="horovod 2 ranks (data parallel)", kind="horovod", mode="data",
                      ranks=2)]
    if "torch" in args.peers:
        runs.append(dict(name="torch 1 process", kind="torch", mode="single", ranks=1))
        for schedule in args.schedules:
            for m in args.microbatches:
                if schedule != "gpipe" and m < 2:
                    continue  # torch's 1F1B needs at least as many micro-batches as stages
                runs.append(dict(name=f"torch 2 stages {schedule} m={m}", kind="torch",
                                 mode="pipeline", ranks=2, m=m, schedule=schedule))
    runs.append(dict(name="keras 1 thread (last)", kind="keras", threads=1, baseline=True))
    return runs


def command(run, args):
    """The command line of one run."""
    common = ["--depth", str(args.depth), "--batch-size", str(args.batch_size),
              "--reps", str(args.reps), "--steps", str(args.steps), "--seed", str(args.seed)]
    if run["kind"] == "keras":
        return harness.child(__file__, "--worker", "keras", "--threads", str(run["threads"]),
                             *common)
    if run["kind"] == "hf":  # `defaults`: hf.fit with no speed arguments
        planned = ["--planned-steps", str(run["planned"])] if run.get("planned") else []
        speed = ["--defaults", *planned] if run.get("defaults") else [
            "--microbatches", str(run["m"]), "--schedule", run["schedule"],
            "--balance", run["balance"] if "balance" in run else args.balance,
            *(["--step-graph"] if run.get("step_graph") else [])]
        return harness.on_ranks(run["P"] * run["R"], __file__, "--worker", "hf",
                                "--partitions", str(run["P"]), "--replicas", str(run["R"]),
                                *speed, *common)
    venv, path, _ = PEERS[run["kind"]]
    cmd = [os.path.join(venv, "bin", "python"), os.path.join(ROOT, path),
           "--mode", run["mode"], "--ranks", str(max(run["ranks"], 2))] + common
    if run["kind"] == "torch" and run["mode"] == "pipeline":
        cmd += ["--microbatches", str(run["m"]), "--schedule", run["schedule"]]
    return cmd


def bound(run, cores):
    """Ideal speedup over one single-threaded process."""
    if run["kind"] == "keras":
        return run["threads"]
    if run["kind"] == "hf":
        return run["R"] * bubble_bound(run["m"], run["P"], _held(run))
    if run["kind"] == "horovod" or run.get("mode") == "single":
        return run["ranks"]
    return bubble_bound(run["m"], run["ranks"], _held(run))


def _held(run):
    """Stages a rank holds: 2 for the interleaved schedules (hyparflow's and torch's)."""
    return 2 if run.get("schedule") in ("interleaved", "zero-bubble") else 1


def installed_peers(wanted):
    """{peer: None if installed else why not}."""
    out = {}
    for peer in wanted:
        venv, _, setup = PEERS[peer]
        ready = os.path.exists(os.path.join(venv, ".installed"))
        out[peer] = (None if ready
                     else f"not installed ({venv} missing; run `{setup}` or `make peers`)")
    return out


# --- memory capacity: the largest depth under a per-rank cap --------------------------------

def valid_v2(depth):
    """The largest ResNet v2 depth 3k + 2 (k ≥ 3) not above `depth`."""
    return max(11, int(depth - 2) // 3 * 3 + 2)


def peak_of(depth, partitions, args):
    """Largest peak RSS over ranks (MiB) of 2 training steps of ResNet-`depth` v2 at P stages."""
    common = ["--model", "v2", "--depth", str(depth), "--batch-size", str(args.cap_batch_size),
              "--reps", "0", "--steps", "2", "--seed", str(args.seed)]
    cmd = harness.on_ranks(partitions, __file__, "--worker", "hf", "--partitions", str(partitions),
                           "--replicas", "1", "--microbatches", str(partitions), "--schedule",
                           "1f1b", "--balance", "memory", *common)
    result, error = harness.launch(cmd, args.timeout)
    return (max(result["peak_rss_mib"]) if result else None), error, cmd


def next_depth(points, cap):
    """The next depth to try: a secant between the closest points either side of the cap.

    `points` maps depth → peak MiB (None: the run failed, counted as over the cap).
    With no point over the cap yet, the line through the two deepest points is
    extended (at least one block past the deepest fit, to find a bound); the answer
    lies strictly between the deepest fitting depth and the shallowest failing one,
    or is None when that gap is within 5 % (or empty).
    """
    over = lambda p: p is None or p > cap  # noqa: E731
    fits = sorted(d for d, p in points.items() if not over(p))
    fails = sorted(d for d, p in points.items() if over(p))
    if not fits:
        return None
    lo = fits[-1]
    if fails:
        hi = fails[0]
        if points[hi] is None or points[hi] <= points[lo]:
            guess = (lo + hi) / 2
        else:
            guess = lo + (cap - points[lo]) * (hi - lo) / (points[hi] - points[lo])
        if hi - lo <= max(3, 0.05 * lo):
            return None
        depth = valid_v2(min(max(guess, lo + 3), hi - 1))
        return depth if lo < depth < hi else None
    if len(fits) < 2:
        return None
    a, b = fits[-2], fits[-1]
    slope = (points[b] - points[a]) / (b - a)
    if slope <= 0:
        return None
    return max(valid_v2(b + (cap - points[b]) / slope), b + 3)  # past the deepest fit


def capacity(args):
    """Per P: peak RSS at two probe depths, then a secant search for the
    deepest model under the cap."""
    cap = args.cap_gib * 1024
    rows = []
    for P in args.cap_partitions:
        points, errors = {}, {}
        for depth in sorted(args.cap_probes):
            points[depth], error, _ = peak_of(depth, P, args)
            if error:
                errors[depth] = error
        for _ in range(args.cap_checks):
            depth = next_depth(points, cap)
            if depth is None or depth in points:
                break
            points[depth], error, _ = peak_of(depth, P, args)
            if error:
                errors[depth] = error
        fits = [d for d, p in points.items() if p is not None and p <= cap]
        fails = [d for d, p in points.items() if p is None or p > cap]
        row = {"partitions": P, "peaks": points, "errors": errors,
               "largest_depth": max(fits, default=None),
               "smallest_over": min(fails, default=None)}
        rows.append(row)
        print(f"capacity P={P}: {row}", file=sys.stderr, flush=True)
    return rows


# --- report ---------------------------------------------------------------------------------

def mib_list(values):
    return " / ".join(f"{v:.0f}" for v in values) if values else "—"


def share_list(values):
    return " / ".join(f"{v:.0%}" for v in values) if values else "—"


def markdown(report):
    """The report as markdown: settings, the table of runs, the targets, the capacity table."""
    s, info = report["settings"], report["machine"]
    lines = [f"# Benchmark results: {report['machine_name']}", "",
             f"Started {report['started']}, took {report['minutes']:.1f} min. "
             f"{'Quick variant. ' if s['quick'] else ''}"
             f"ResNet-{s['depth']} v1, global batch {s['batch_size']}, random CIFAR-shaped "
             f"data, SGD with momentum; every rank one thread; median of {s['reps']} calls "
             f"of {s['steps']} steps after a warm-up call."
             + "".join(f" Rerun {r['started']} ({r['minutes']:.1f} min): "
                       f"{', '.join(r['only']) if r['only'] else 'all'} "
                       f"({' and '.join(r['parts'])})." for r in report.get("reruns", [])),
             "",
             f"Machine: {info['cpu']}, {info['usable_cores']} usable cores; {info['platform']}; "
             f"Python {info['python']}, TensorFlow {info['tensorflow']}, Keras {info['keras']}, "
             f"mpi4py {info['mpi4py']}, Open MPI {info['openmpi']}.", ""]
    for peer, why in report["peers"].items():
        if why:
            lines.append(f"Peer {peer}: {why}.")
    lines += ["", "| configuration | ranks | images/s | speedup | bound | efficiency "
              "| first step (s) | trace + compile (s) | peak RSS per rank (MiB) "
              "| recv wait per rank | allreduce per rank |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for row in report["runs"]:
        r = row["result"]
        if r is None:
            lines.append(f"| {row['name']} | | failed: {row['error'].splitlines()[0]} "
                         "| | | | | | | | |")
            continue
        speed = f"{row['speedup']:.2f}" if row["speedup"] else "—"
        eff = f"{row['speedup'] / row['bound']:.2f}" if row["speedup"] else "—"
        tc = r.get("trace_compile_s")
        lines.append(
            f"| {row['name']} | {len(r['peak_rss_mib'])} | {r['median_images_per_s']:.1f} "
            f"| {speed} | {row['bound']:.2f} | {eff} | {r['first_step_s']:.1f} "
            f"| {'—' if tc is None else f'{tc:.1f}'} | {mib_list(r['peak_rss_mib'])} "
            f"| {share_list(r.get('recv_wait_share'))} | {share_list(r.get('allreduce_share'))} |")
    lines += ["", "Speedup: images/s over the single-process one-thread baseline of the same "
              "run (for a peer, over its own single process); bound: P·m/(m + P − 1) × R "
              "(threads for Keras); efficiency = speedup / bound. First step: from the call "
              "to the end of the first step (slowest rank); trace + compile: that minus a "
              "later step. Waits: share of a step each rank spends in receive waits and in "
              "the gradient allreduce (from one traced call).", "", "## Targets", ""]
    lines += [f"- {t}" for t in report["targets"]]
    if report["capacity"]:
        lines += ["", f"## Largest ResNet v2 depth under {s['cap_gib']:g} GiB per rank", "",
                  f"Batch {s['cap_batch_size']}, 1F1B with m = P, `balance=\"memory\"`, one "
                  "thread per rank; the peak RSS (largest over ranks) of 2 training steps at "
                  "two probe depths, then a secant search between the deepest model that "
                  "fits and the shallowest that does not (at most "
                  f"{s['cap_checks']} more runs, stopping when they are within 5 %).", "",
                  "| P | depth → largest peak per rank (MiB) | largest depth under the cap "
                  "| shallowest over it |",
                  "| ---: | --- | ---: | ---: |"]
        for c in report["capacity"]:
            peaks = ", ".join(f"{d} → {'failed' if p is None else f'{p:.0f}'}"
                              for d, p in sorted(c["peaks"].items(), key=lambda i: int(i[0])))
            lines.append(f"| {c['partitions']} | {peaks} | {c['largest_depth'] or '—'} "
                         f"| {c['smallest_over'] or '—'} |")
    lines += ["", "Commands: see the `commands` of each run in the JSON file."]
    return "\n".join(lines) + "\n"


def targets(by_name):
    """The issue's targets, each as a sentence with the measured value."""
    out = []
    hf11 = by_name.get("hf 1×1")
    if hf11 and hf11["speedup"]:
        value = hf11["speedup"]
        out.append(f"overhead hf.fit(1, 1) / model.fit = {value:.2f} (target ≥ 0.97; "
                   "`benchmarks/overhead.py` measures it interleaved, more precisely)")
    dp = by_name.get("hf 1×2 (data parallel)")
    hv = by_name.get("horovod 2 ranks (data parallel)")
    if dp and dp["speedup"]:
        peer = f"Horovod's {hv['speedup']:.2f}" if hv and hv["speedup"] else "Horovod not measured"
        out.append(f"data parallel R = 2: hf {dp['speedup']:.2f}× against {peer} "
                   "(target ≥ Horovod's)")
    for schedule in ("gpipe", "1f1b"):
        hp = by_name.get(f"hf 2×1 {schedule} m=8")
        tp = by_name.get(f"torch 2 stages {schedule} m=8")
        if hp and hp["speedup"]:
            peer = (f"torch.distributed.pipelining's {tp['speedup']:.2f}×"
                    if tp and tp["speedup"] else "torch not measured")
            out.append(f"pipeline P = 2, m = 8, {schedule}: hf {hp['speedup']:.2f}× against "
                       f"{peer} (target ≥ 1.65× and ≥ torch's)")
    return out


def plots(report, stem):
    """Three PNGs beside the report: throughput, speedup against the bound, peak memory per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["runs"] if r["result"]]
    names = [r["name"] for r in rows]
    colour = {"keras": "#7f7f7f", "hf": "#1f77b4", "horovod": "#2ca02c", "torch": "#d62728"}
    colours = [colour[r["kind"]] for r in rows]
    title = f"ResNet-{report['settings']['depth']} v1, batch {report['settings']['batch_size']}"
    paths = []

    def save(fig, suffix):
        path = f"{stem}-{suffix}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.5))
    ax.barh(names, [r["result"]["median_images_per_s"] for r in rows], color=colours)
    ax.invert_yaxis()
    ax.set_xlabel("images/s (median)")
    ax.set_title(f"Throughput — {title}")
    save(fig, "throughput")

    ranked = [r for r in rows if r["speedup"]]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(ranked) + 1.5))
    ax.barh([r["name"] for r in ranked], [r["speedup"] for r in ranked],
            color=[colour[r["kind"]] for r in ranked], label="measured")
    ax.scatter([r["bound"] for r in ranked], [r["name"] for r in ranked], marker="|", s=200,
               color="black", label="bound (ideal)", zorder=3)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over one single-threaded process")
    ax.legend(loc="lower right")
    ax.set_title(f"Speedup against the ideal — {title}")
    save(fig, "speedup")

    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.5))
    for i, r in enumerate(rows):
        peaks = r["result"]["peak_rss_mib"]
        height = 0.8 / len(peaks)
        for k, peak in enumerate(peaks):
            ax.barh(i - 0.4 + height * (k + 0.5), peak, height=height, color=colours[i],
                    alpha=1 - 0.25 * k, edgecolor="white")
    ax.set_yticks(range(len(rows)), names)
    ax.invert_yaxis()
    ax.set_xlabel("peak RSS per rank (MiB; one bar per rank)")
    ax.set_title(f"Memory — {title}")
    save(fig, "memory")

    if report["capacity"]:
        caps = [c for c in report["capacity"] if c["largest_depth"]]
        if caps:
            fig, ax = plt.subplots(figsize=(5, 3.5))
            ax.bar([str(c["partitions"]) for c in caps], [c["largest_depth"] for c in caps],
                   color=colour["hf"])
            ax.set_xlabel("stages P")
            ax.set_ylabel("largest ResNet v2 depth")
            ax.set_title(f"Under {report['settings']['cap_gib']:g} GiB per rank")
            save(fig, "capacity")
    return paths


# --- driver ---------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--quick", action="store_true",
                        help="ResNet-20, 8 steps, m = 1 4, a cap search at small depths")
    parser.add_argument("--depth", type=int, default=None, help="ResNet v1 depth (110; quick 20)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, nargs="+", default=None,
                        help="m for the P = 2 runs (1 2 4 8 16; quick 1 4)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"],
                        choices=("gpipe", "1f1b", "interleaved", "zb-h1"))
    parser.add_argument("--step-graph", action="store_true",
                        help="the P = 2 runs with hf.Schedule(step_graph=True)")
    parser.add_argument("--balance", default="time", help="hf.fit balance for P > 1 (time)")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per run (median)")
    parser.add_argument("--steps", type=int, default=None, help="steps per call (10; quick 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", nargs="*", default=["horovod", "torch"],
                        choices=sorted(PEERS), help="peers to run when installed")
    parser.add_argument("--cap-gib", type=float, default=None,
                        help="per-rank memory cap of the depth search (4; quick 1.5; 0 = skip)")
    parser.add_argument("--cap-partitions", type=int, nargs="+", default=None,
                        help="P of the cap search (1 2 4; quick 1 4)")
    parser.add_argument("--cap-probes", type=int, nargs=2, default=None,
                        help="the two probe depths of the cap search (56 164; quick 29 56)")
    parser.add_argument("--cap-batch-size", type=int, default=None, help="(64; quick 32)")
    parser.add_argument("--cap-checks", type=int, default=None,
                        help="runs of the search after the probes (3; quick 2)")
    parser.add_argument("--parts", nargs="+", default=None,
                        choices=("runs", "capacity"),
                        help="what to run (runs capacity; with --only: runs); a part left "
                             "out is kept from the existing results file of the same name")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="run only the configurations whose name starts with one of "
                             "these (e.g. horovod), replacing them in the existing results")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child run")
    parser.add_argument("--output-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default=None,
                        help="results file stem (default: the machine, '-quick' for --quick)")
    # internal: one measurement
    parser.add_argument("--worker", choices=("keras", "hf"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=("v1", "v2"), default="v1", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--inter-op", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--partitions", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--defaults", action="store_true", help=argparse.SUPPRESS)  # hf.fit's
    parser.add_argument("--planned-steps", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(depth=20 if quick else 110, microbatches=[1, 4] if quick else [1, 2, 4, 8, 16],
                    steps=8 if quick else 10, cap_gib=1.5 if quick else 4.0,
                    cap_probes=[29, 56] if quick else [56, 164],
                    cap_batch_size=32 if quick else 64, cap_checks=2 if quick else 3,
                    cap_partitions=[1, 4] if quick else [1, 2, 4])
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.worker == "hf" and isinstance(args.microbatches, list):
        args.microbatches = args.microbatches[0]
    if args.reps < (0 if args.worker else 1) or args.steps < 2:
        parser.error("--reps must be at least 1 and --steps at least 2")
    if args.parts is None:
        args.parts = ["runs"] if args.only else ["runs", "capacity"]
    args.cores = harness.machine()["usable_cores"]
    return args


def report_minutes(started):
    return (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60


def drive(args):
    started = datetime.datetime.now(datetime.timezone.utc)
    info = harness.machine()
    name = args.name or harness.machine_name(info) + ("-quick" if args.quick else "")
    peers = installed_peers(args.peers)
    args.peers = [p for p, why in peers.items() if why is None]
    for peer, why in peers.items():
        if why:
            print(f"peer {peer}: {why}; going on without it", file=sys.stderr, flush=True)
    os.makedirs(args.output_dir, exist_ok=True)
    stem = os.path.join(args.output_dir, name)
    old = {}
    partial = set(args.parts) != {"runs", "capacity"} or args.only
    if partial and os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            old = json.load(f)
    wanted = [r for r in configurations(args)
              if not args.only or any(r["name"].startswith(p) for p in args.only)]
    fresh = []
    for run in wanted if "runs" in args.parts else []:
        cmd = command(run, args)
        result, error = harness.launch(cmd, args.timeout)
        fresh.append(dict(run, command=cmd, result=result, error=error,
                          bound=bound(run, args.cores)))
        rate = result and result["median_images_per_s"]
        print(f"{run['name']}: {f'{rate:.1f} images/s' if rate else error}", file=sys.stderr,
              flush=True)
    if "runs" in args.parts and not args.only:
        rows = fresh
    else:  # the rows of the existing file, those rerun replaced
        again = {r["name"]: r for r in fresh}
        rows = [again.pop(r["name"], r) for r in old.get("runs", [])] + list(again.values())
        peers = dict(old.get("peers", {}), **{p: why for p, why in peers.items()
                                              if any(r["kind"] == p for r in fresh)})
    by_name = {r["name"]: r for r in rows}
    base = [v for r in rows if r.get("baseline") and r["result"]
            for v in r["result"]["images_per_s"]]
    base_rate = statistics.median(base) if base else None
    own = {kind: by_name.get(f"{kind} 1 process") for kind in PEERS}
    for row in rows:
        r = row["result"]
        row["speedup"] = None
        if r is None or not r["median_images_per_s"]:
            continue
        if row["kind"] in PEERS:
            single = own[row["kind"]]
            if single and single["result"]:
                row["speedup"] = r["median_images_per_s"] / single["result"]["median_images_per_s"]
        elif base_rate:
            row["speedup"] = r["median_images_per_s"] / base_rate
    cap = (capacity(args) if args.cap_gib > 0 else []) if "capacity" in args.parts \
        else old.get("capacity", [])
    report = {
        "benchmark": "suite", "machine_name": name, "machine": info,
        "started": started.isoformat(timespec="seconds"),
        "minutes": report_minutes(started),
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("worker", "model", "threads", "partitions", "replicas",
                                  "schedule")},
        "peers": peers, "runs": rows, "baseline_images_per_s": base_rate,
        "targets": targets(by_name), "capacity": cap, "reruns": [],
    }
    if partial and old:  # the first run's time, and what was rerun since
        report["started"], report["minutes"] = old["started"], old["minutes"]
        report["reruns"] = old.get("reruns", []) + [{
            "started": started.isoformat(timespec="seconds"), "minutes": report_minutes(started),
            "parts": args.parts, "only": args.only}]
    harness.write_report(report, stem + ".json")
    text = markdown(report)
    with open(stem + ".md", "w") as f:
        f.write(text)
    written = [stem + ".json", stem + ".md"] + plots(report, stem)
    print(text)
    print("written: " + ", ".join(os.path.relpath(p, ROOT) for p in written))
    return 0 if all(r["result"] for r in rows) else 1


def main(argv=None):
    return harness.dispatch(parse_args(argv), worker, drive)


if __name__ == "__main__":
    sys.exit(main())
