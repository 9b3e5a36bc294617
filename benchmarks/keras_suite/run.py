"""Keras' own trainer and callback tests with fit/evaluate/predict redirected to hyparflow.

One command does the whole measurement:

    .venv/bin/python benchmarks/keras_suite/run.py            # plain, 1x1, 1x2, 2x1
    .venv/bin/python benchmarks/keras_suite/run.py --configs 1x1 \\
        --files callbacks/csv_logger_test.py

1. "plain": every selected test file runs once with Keras untouched (one process); the plugin
   (ks_plugin.py) only counts the calls of keras.Model.fit/evaluate/predict each test makes.
   Counted from then on: the tests that pass there and make at least one such call.
2. "PxR": the counted tests run again with those calls going to hf.fit/evaluate/predict
   (partitions=P, replicas=R): 1x1 in one process, 1x2 and 2x1 under `mpiexec -n 2`. Every
   rank runs every test; a test passes only if it passes on every rank.

Each test file is one launch (under `timeout` and `nice -n 10`). When a launch dies (an error
after hf's checks ends the job with MPI_Abort, or the timeout kills it), the test that was
running is recorded as "aborted" (confirmed by running it alone once more, so that a test that
only died as a bystander is not blamed) and the tests not yet run are launched again, so one
failure never hides the others.

Results: <out>/<config>/results.json (per test: outcome on every rank, the exception, the
errors hyparflow raised) and <out>/summary.md (pass rates, failing tests by error signature);
launch logs in <out>/<config>/logs/.
"""

import argparse
import collections
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable
BIN = os.path.dirname(PY)

DEFAULT_FILES = ["trainers/trainer_test.py", "trainers/epoch_iterator_test.py",
                 "callbacks/*_test.py"]
EXCLUDED = ["callbacks/orbax_checkpoint_test.py"]  # needs the orbax package (not installed)


def keras_src():
    code = "import keras.src, os; print(os.path.dirname(keras.src.__file__))"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=base_env(),
                         check=True)
    return out.stdout.strip()


def base_env():
    env = dict(os.environ)
    env.update(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", HYPARFLOW_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(
                   [HERE, os.path.join(HERE, "stubs")]
                   + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
    return env


def parse_config(name):
    if name == "plain":
        return "plain", 1, 1
    p, r = name.split("x")
    return "hf", int(p), int(r)


class Launcher:
    def __init__(self, out, src, hf_timeout):
        self.out, self.src, self.hf_timeout = out, src, hf_timeout
        self.ini = os.path.join(out, "pytest.ini")
        with open(self.ini, "w") as f:  # no project configuration gets picked up
            f.write("[pytest]\naddopts =\nfilterwarnings =\n    ignore::DeprecationWarning\n")
        self.count = 0
        self.rootdir = os.path.dirname(os.path.dirname(src))  # site-packages: nodeids keras/src/...

    def run(self, config, nodeids, tag):
        """Run `nodeids` in one launch; returns {nodeid: merged result} for those that ended,
        and (the launch's return code, whether it timed out, the log path)."""
        mode, P, R = parse_config(config)
        ranks = P * R
        self.count += 1
        cdir = os.path.join(self.out, config)
        rdir = os.path.join(cdir, "records")
        ldir = os.path.join(cdir, "logs")
        os.makedirs(rdir, exist_ok=True)
        os.makedirs(ldir, exist_ok=True)
        launch_tag = f"{tag}.{self.count}"
        for stale in glob.glob(os.path.join(rdir, f"{launch_tag}.rank*.jsonl")):
            os.remove(stale)  # an earlier run's launch of this number (ranks append records)
        tmp = os.path.join("/tmp", "keras_suite_tmp", config, launch_tag)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        cwd = os.path.join(tmp, "cwd")  # tests that write to the working directory
        os.makedirs(cwd)
        argfile = os.path.join(tmp, "args.txt")
        with open(argfile, "w") as f:
            f.write("\n".join(os.path.join(self.src, n.split("/", 2)[2])
                              if n.startswith("keras/src/") else n for n in nodeids) + "\n")
        env = base_env()
        env.update(KS_MODE=mode, KS_P=str(P), KS_R=str(R), KS_OUT=rdir, KS_TAG=launch_tag,
                   KS_TMP=tmp, KS_HF_TIMEOUT=str(self.hf_timeout))
        pytest = [PY, "-m", "pytest", "-c", self.ini, "--rootdir", self.rootdir,
                  "-p", "ks_plugin", "-p", "no:cacheprovider", "-q", "-rN", "--tb=short",
                  "--capture=tee-sys",  # what hyparflow prints before an abort reaches the log
                  "--no-header", f"@{argfile}"]
        if ranks > 1:
            command = [os.path.join(BIN, "mpiexec"), "-n", str(ranks), "--oversubscribe"]
            if os.geteuid() == 0:
                command.append("--allow-run-as-root")
            for k in ("KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL", "CUDA_VISIBLE_DEVICES",
                      "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "HYPARFLOW_THREADS",
                      "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONPATH", "KS_MODE",
                      "KS_P", "KS_R", "KS_OUT", "KS_TAG", "KS_TMP", "KS_HF_TIMEOUT"):
                command += ["-x", k]
            command += pytest
        else:
            command = pytest
        limit = min(3600, 240 + 40 * len(nodeids))
        command = ["timeout", "-k", "20", str(limit), "nice", "-n", "10"] + command
        log = os.path.join(ldir, f"{launch_tag}.log")
        start = time.monotonic()
        with open(log, "w") as f:
            f.write(" ".join(command) + "\n")
            f.flush()
            rc = subprocess.call(command, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                 start_new_session=True)
        seconds = time.monotonic() - start
        shutil.rmtree(tmp, ignore_errors=True)
        records = [read_records(path) for path in
                   sorted(glob.glob(os.path.join(rdir, f"{launch_tag}.rank*.jsonl")))]
        while len(records) < ranks:
            records.append(({}, []))
        ended = {}
        for nodeid in nodeids:
            per_rank = [r[0].get(nodeid) for r in records]
            if all(per_rank):
                ended[nodeid] = merge(per_rank)
        started = [n for n in nodeids if any(n in r[1] for r in records)]
        self.partial = {n: [r[0].get(n) for r in records] for n in nodeids if n not in ended}
        return ended, started, rc, rc == 124 or rc == 137, log, seconds


def read_records(path):
    ends, starts = {}, []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the abort
            if rec["event"] == "start":
                starts.append(rec["nodeid"])
            else:
                ends[rec["nodeid"]] = rec
    return ends, starts


def merge(per_rank):
    outcomes = [r["outcome"] for r in per_rank]
    if all(o == "passed" for o in outcomes):
        outcome = "passed"
    elif all(o == "skipped" for o in outcomes):
        outcome = "skipped"
    else:
        outcome = "failed"
    first_bad = next((r for r in per_rank if r["outcome"] == "failed"), per_rank[0])
    return {"outcome": outcome, "ranks": outcomes, "calls": per_rank[0]["calls"],
            "traceback": first_bad.get("traceback"),
            "exc": first_bad["exc"], "hf_errors": first_bad["hf_errors"],
            "failed_ranks": [i for i, o in enumerate(outcomes) if o == "failed"],
            "seconds": max(r["seconds"] for r in per_rank)}


def tail_of(log, lines=25):
    with open(log, errors="replace") as f:
        text = f.read().splitlines()
    keep = [line for line in text if "hyparflow" in line or "Error" in line or "watchdog" in line
            or "Abort" in line or "abort" in line]
    return (keep[-8:] or text[-lines:])


def collect(launcher, src, files):
    """The nodeids of the selected files, in order (pytest --collect-only, one process)."""
    paths = []
    for pattern in files:
        for path in sorted(glob.glob(os.path.join(src, pattern))):
            if os.path.relpath(path, src) not in EXCLUDED:
                paths.append(path)
    command = [PY, "-m", "pytest", "-c", launcher.ini, "--rootdir", launcher.rootdir,
               "-p", "ks_plugin", "-p", "no:cacheprovider", "--collect-only", "-q"] + paths
    out = subprocess.run(command, capture_output=True, text=True, env=base_env(), cwd="/tmp")
    nodeids = [line.strip() for line in out.stdout.splitlines()
               if line.startswith("keras/src/") and "::" in line]
    if not nodeids:
        sys.exit("collection failed:\n" + out.stdout[-3000:] + out.stderr[-3000:])
    return nodeids


def death(launcher, died, rc, timed_out, log):
    """The record of a test during which the launch died. If some rank had finished it with
    a failure (and the others were then stuck in hf.fit until the watchdog ended the job),
    that rank's exception is the cause."""
    kind = "timeout" if timed_out else "aborted"
    per_rank = launcher.partial.get(died, [])
    failed = [(i, r) for i, r in enumerate(per_rank) if r and r["outcome"] == "failed"]
    verdict = {"outcome": kind, "rc": rc, "calls": {}, "hf_errors": [],
               "log": os.path.relpath(log, launcher.out),
               "ranks": [r["outcome"] if r else kind for r in per_rank],
               "exc": {"type": kind, "message": " | ".join(tail_of(log))}}
    if failed:
        i, r = failed[0]
        verdict.update(calls=r["calls"], hf_errors=r["hf_errors"], failed_ranks=[i],
                       traceback=r.get("traceback"),
                       exc=dict(r["exc"] or {}, message=f"(rank {i}, then the job {kind}) "
                                + (r["exc"] or {}).get("message", "")))
    return verdict


def run_config(launcher, config, nodeids):
    """Run `nodeids`, one launch per test file; after a launch dies, the test that was running
    is the suspect and the tests not yet run are launched again."""
    results = {}
    files = list(dict.fromkeys(n.split("::")[0] for n in nodeids))
    for file in files:
        todo = [n for n in nodeids if n.split("::")[0] == file]
        tag = os.path.basename(file).replace(".py", "")
        suspects = []
        while todo:
            ended, started, rc, timed_out, log, seconds = launcher.run(config, todo, tag)
            results.update(ended)
            print(f"  [{config}] {file}: {len(ended)}/{len(todo)} tests ended, rc={rc}, "
                  f"{seconds:.0f} s", flush=True)
            rest = [n for n in todo if n not in ended]
            if not rest:
                break
            died = next((n for n in rest if n in started), None)
            if died is None:  # nothing could even start: the launch itself failed
                for n in rest:
                    results[n] = {"outcome": "launch failed", "calls": {}, "hf_errors": [],
                                  "exc": {"type": "launch", "message": " | ".join(tail_of(log))}}
                break
            verdict = death(launcher, died, rc, timed_out, log)
            if len(todo) > 1:
                suspects.append((died, verdict))
            else:
                results[died] = verdict
            todo = [n for n in rest if n != died]
        for died, _verdict in suspects:  # alone once more: was it the culprit or a bystander?
            ended, started, rc, timed_out, log, seconds = launcher.run(config, [died],
                                                                       tag + "-alone")
            print(f"  [{config}] {died} alone: rc={rc}, {seconds:.0f} s", flush=True)
            if died in ended:
                results[died] = dict(ended[died], note="died in a launch of several tests, "
                                     "ended when run alone")
            else:
                results[died] = death(launcher, died, rc, timed_out, log)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="plain,1x1,1x2,2x1")
    parser.add_argument("--files", nargs="*", default=DEFAULT_FILES,
                        help="globs relative to keras/src")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--hf-timeout", type=float, default=30)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other files' results of an earlier run (with --files)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    src = keras_src()
    launcher = Launcher(args.out, src, args.hf_timeout)
    configs = args.configs.split(",")
    for config in configs:
        if args.report_only:
            break
        print(f"== {config}", flush=True)
        if config == "plain":
            nodeids = collect(launcher, src, args.files)
            print(f"   {len(nodeids)} tests collected", flush=True)
            os.makedirs(os.path.join(args.out, "plain"), exist_ok=True)
            ids_path = os.path.join(args.out, "plain", "nodeids.json")
            known = []
            if args.merge and os.path.exists(ids_path):
                with open(ids_path) as f:
                    known = json.load(f)
            with open(ids_path, "w") as f:
                json.dump(list(dict.fromkeys(known + nodeids)), f, indent=0)
            results = run_config(launcher, "plain", nodeids)
        else:
            plain = load(args.out, "plain")
            selection = [n for n, r in plain.items() if counted(r)]
            files = [os.path.relpath(p, src) for pattern in args.files
                     for p in glob.glob(os.path.join(src, pattern))]
            with open(os.path.join(args.out, "plain", "nodeids.json")) as f:
                order = {n: i for i, n in enumerate(json.load(f))}
            selection = sorted((n for n in selection
                                if n.split("::")[0][len("keras/src/"):] in files), key=order.get)
            results = run_config(launcher, config, selection)
        path = os.path.join(args.out, config, "results.json")
        if args.merge and os.path.exists(path):  # the files run now replace their old results
            ran = {n.split("::")[0] for n in results}
            with open(path) as f:
                old = {n: r for n, r in json.load(f).items() if n.split("::")[0] not in ran}
            results = dict(old, **results)
        with open(path, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    report(args.out, [c for c in ("plain", "1x1", "1x2", "2x1")
                      if os.path.exists(os.path.join(args.out, c, "results.json"))])


def load(out, config):
    with open(os.path.join(out, config, "results.json")) as f:
        return json.load(f)


def counted(r):
    return r["outcome"] == "passed" and sum((r.get("calls") or {}).values()) > 0


# Causes found so far (see README.md), matched on "test name | exception | traceback | log tail".
# kind: gap (a difference from Model.fit hyparflow could remove), refusal (hyparflow refuses
# the set-up with a clear message, by design), harness (an artefact of running a test written
# for one process on several ranks).
CAUSES = [  # the first match wins: hyparflow's refusals first (they come before anything runs)
    ("sequential-without-input-shape", "refusal (could build from x)",
     r"without a known input shape"),
    ("synchronized-norm-batch-under-replicas", "refusal",
     r"without samples, and synchronized BatchNormalization"),
    ("too-few-layer-calls", "refusal", r"layer calls, so it can be split into at most"),
    ("subclassed-model-P>1", "refusal", r"is a subclassed keras\.Model"),
    ("train_step-override-P>1", "refusal", r"overrides train_step"),
    ("predict-compiled-untrained", "gap", r"None values not supported"),
    ("ragged-targets", "gap", r"test_trainer_with_raggeds"),
    ("writer-file-after-fit", "gap", r"test_stop_training_csv|test_custom_summary"),
    ("stateful-layer-per-microbatch", "gap", r"backup_and_restore_test.*(12 != 6|4 != 2)"),
    ("tf-distribute-scope", "gap (error message)",
     r"DistributedVariable|test_swap_ema_weights_with_tf_distribute"),
    ("test-mutates-shared-file", "harness", r"test_CSVLogger|test_model_checkpoint_options"),
]


def cause_of(nodeid, r):
    exc = r.get("exc") or {}
    text = " | ".join([nodeid, exc.get("message") or "", r.get("traceback") or "",
                       " ".join(r.get("hf_errors") or [])])
    for name, kind, pattern in CAUSES:
        if re.search(pattern, text, re.S):
            return name, kind
    return "unclassified", "?"


def signature(r):
    exc = r.get("exc") or {}
    if r.get("hf_errors"):
        text = r["hf_errors"][0]
    else:
        text = f"{exc.get('type')}: {exc.get('message', '')}"
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    return text[:160]


def report(out, configs):
    plain = load(out, "plain")
    total = {o: sum(1 for r in plain.values() if r["outcome"] == o)
             for o in ("passed", "failed", "skipped")}
    selection = sorted(n for n, r in plain.items() if counted(r))
    by_file = collections.Counter(n.split("::")[0].split("/")[-1] for n in selection)
    lines = ["# Keras' own tests through hyparflow: results", "",
             f"Machine: {platform.node()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}",
             "", f"Plain Keras: {total['passed']} passed, {total['failed']} failed, "
             f"{total['skipped']} skipped; counted (pass plain and call fit/evaluate/predict on "
             f"a keras.Model): {len(selection)}", "",
             "Counted per file: " + ", ".join(f"{k} {v}" for k, v in sorted(by_file.items())), "",
             "| config | passed | failed | aborted/timeout | pass rate |",
             "| --- | --- | --- | --- | --- |"]
    tables = {}
    for config in configs:
        if config == "plain":
            continue
        res = load(out, config)
        ok = sum(1 for n in selection if res.get(n, {}).get("outcome") == "passed")
        dead = sum(1 for n in selection if res.get(n, {}).get("outcome") in ("aborted", "timeout"))
        missing = sum(1 for n in selection if n not in res)
        lines.append(f"| {config} | {ok} | {len(selection) - ok - dead - missing} | {dead} | "
                     f"{100 * ok / max(1, len(selection)):.0f} % |"
                     + (f" ({missing} not run)" if missing else ""))
        tables[config] = res
    lines += ["", "## Failing tests by cause", "",
              "| cause | kind | " + " | ".join(tables) + " |",
              "| --- | --- | " + " | ".join("---" for _ in tables) + " |"]
    by_cause = collections.defaultdict(lambda: collections.defaultdict(list))
    for config, res in tables.items():
        for n in selection:
            r = res.get(n, {"outcome": "not run"})
            if r["outcome"] != "passed":
                by_cause[cause_of(n, r)][config].append(n)
    for (name, kind), per in sorted(by_cause.items(),
                                    key=lambda kv: -sum(map(len, kv[1].values()))):
        lines.append(f"| {name} | {kind} | " + " | ".join(str(len(per.get(c, []))) for c in tables)
                     + " |")
    lines.append("")
    for (name, kind), per in sorted(by_cause.items()):
        tests = sorted({n for ns in per.values() for n in ns})
        lines.append(f"* **{name}** ({kind}): " + "; ".join(
            f"{n.split('/')[-1].split('.py')[0]}::{n.split('::')[-1]} "
            f"[{', '.join(c for c in tables if n in per.get(c, []))}]" for n in tests))
    lines += ["", "## Failing tests by error signature", ""]
    for config, res in tables.items():
        groups = collections.defaultdict(list)
        for n in selection:
            r = res.get(n, {"outcome": "not run"})
            if r["outcome"] != "passed":
                groups[signature(r) if r["outcome"] != "not run" else "not run"].append((n, r))
        lines += [f"### {config}", ""]
        for sig, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"* **{len(items)}×** `{sig}`")
            for n, r in items:
                ranks = r.get("failed_ranks")
                lines.append(f"  * {n.split('::', 1)[1]} ({n.split('/')[-1].split('::')[0]}; "
                             f"{r['outcome']}{'' if not ranks else f' on ranks {ranks}'})")
        lines.append("")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:20 + len(configs)]))


if __name__ == "__main__":
    main()
