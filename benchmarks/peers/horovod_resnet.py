"""Horovod peer: times the CIFAR ResNet v1 of
benchmarks/models.py on one process or data-parallel over MPI.

Runs with the Python of .venv-horovod (TensorFlow 2.15, Keras 2, Horovod over the
PyPI Open MPI), which benchmarks/peers/setup_horovod.sh builds:

    bash benchmarks/peers/setup_horovod.sh
    .venv-horovod/bin/python benchmarks/peers/horovod_resnet.py --mode single --depth 110
    .venv-horovod/bin/python benchmarks/peers/horovod_resnet.py --mode data --ranks 2 --depth 110

--batch-size is the global batch: in data mode each of the R ranks trains on its own
B/R slice of every step's batch (no learning-rate scaling, so the optimisation is the
one of --mode single). Outside MPI, data mode re-launches this script with the venv's
mpiexec -n R and kills the whole job after --timeout seconds. Each process uses one
TensorFlow thread. One warm-up fit (which in data mode also broadcasts rank 0's
weights), then --reps timed fits of --steps steps each; a rep's time is the slowest
rank's. Exactly one line goes to stdout, ``RESULT {json}``; everything else to stderr.
The exit status is non-zero if any rank fails.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RANK_ENV = "OMPI_COMM_WORLD_RANK"


def log(*parts):
    print("horovod_resnet:", *parts, file=sys.stderr, flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--mode", choices=("single", "data"), default="single")
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks in data mode (default 2)")
    p.add_argument("--depth", type=int, default=110, help="ResNet v1 depth, 6n+2 (default 110)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="GLOBAL batch size, split B/R per rank in data mode (default 64)")
    p.add_argument("--reps", type=int, default=3, help="timed fits (default 3)")
    p.add_argument("--steps", type=int, default=10, help="steps per fit (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds before the whole run is killed (default 3600)")
    args = p.parse_args(argv)
    if args.mode == "single":
        args.ranks = 1
    for name in ("ranks", "batch_size", "reps", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.batch_size % args.ranks:
        p.error(f"--batch-size {args.batch_size} is not divisible by --ranks {args.ranks}")
    return args


# ----------------------------------------------------------------------------- launcher

def launch(args, argv):
    """Re-run this script under the venv's mpiexec; relay RESULT and the exit status."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        log(f"no mpiexec next to {sys.executable}; run benchmarks/peers/setup_horovod.sh")
        return 2
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Horovod's background thread wakes every HOROVOD_CYCLE_TIME ms (default 1): with one
    # core per rank it then takes the compute thread's core. Measured here (ResNet-110,
    # 2 ranks on 2 cores): 61.8 images/s at the default, 124 at 3, 10 or 25 ms.
    env.setdefault("HOROVOD_CYCLE_TIME", "10")
    command = [mpiexec, "-n", str(args.ranks), "--map-by", ":OVERSUBSCRIBE",
               "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-run-as-root")
    forward = ["TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "PYTHONUNBUFFERED",
               "TF_CPP_MIN_LOG_LEVEL"] + sorted(k for k in env if k.startswith("HOROVOD_"))
    for name in forward:  # Horovod's own tuning (e.g. HOROVOD_CYCLE_TIME) passes through
        command += ["-x", name]
    command += [sys.executable, os.path.abspath(__file__)] + list(argv)
    log("running", " ".join(command))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=None, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        log(f"timed out after {args.timeout:g} s; killing the job")
        _kill_group(proc)
        out, _ = proc.communicate()
        rc = 124
    except BaseException:
        _kill_group(proc)
        raise
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    for line in out.splitlines():
        if not line.startswith("RESULT "):
            print(line, file=sys.stderr)
    if rc == 0 and len(results) != 1:
        log(f"mpiexec exited 0 but printed {len(results)} RESULT lines")
        rc = 1
    if rc == 0:
        print(results[0], flush=True)
    else:
        log(f"data-parallel run failed (exit status {rc})")
    return rc


def _kill_group(proc):
    """SIGTERM then SIGKILL the launched process group."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


# ----------------------------------------------------------------------------- model

def build_model(depth, seed):
    """benchmarks.models.resnet_v1(depth), built by Keras 2 here, from the same seed."""
    import tensorflow as tf
    tf.keras.utils.set_random_seed(seed)
    sys.path.insert(0, ROOT)
    from benchmarks.models import resnet_v1
    return resnet_v1(depth)


# ----------------------------------------------------------------------------- worker

def worker(args):
    os.environ["TF_NUM_INTRAOP_THREADS"] = "1"
    os.environ["TF_NUM_INTEROP_THREADS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import resource
    import statistics

    import numpy as np
    import tensorflow as tf
    import horovod  # isort: skip  (after TensorFlow, as written)

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    data = args.mode == "data"
    if data:
        import horovod.tensorflow.keras as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        if size != args.ranks:
            raise RuntimeError(f"--ranks {args.ranks} but Horovod sees {size} ranks")
    else:
        rank, size = 0, 1

    B, R, steps = args.batch_size, size, args.steps
    b = B // R
    rng = np.random.default_rng(args.seed)
    x = rng.random((steps * B, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, steps * B).astype(np.int32)
    if data:  # this rank's slice of every step's global batch
        idx = (np.arange(steps)[:, None] * B + rank * b + np.arange(b)[None, :]).ravel()
        x, y = x[idx], y[idx]

    model = build_model(args.depth, args.seed)
    optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
    if data:
        optimizer = hvd.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")

    def slowest(value):
        """The maximum of `value` over ranks (and a barrier)."""
        if not data:
            return value
        return float(np.max(hvd.allgather(tf.constant([value], tf.float64)).numpy()))

    def barrier(name):
        if data:
            hvd.allreduce(tf.constant(0.0), name=name)

    fit = dict(epochs=1, batch_size=b, shuffle=False, verbose=0)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if data else []
    barrier("barrier_warmup")
    t0 = time.perf_counter()
    model.fit(x, y, callbacks=callbacks, **fit)
    first_call = slowest(time.perf_counter() - t0)
    log(f"rank {rank}: warm-up fit {first_call:.3f} s")

    seconds = []
    for rep in range(args.reps):
        barrier(f"barrier_rep{rep}")
        t0 = time.perf_counter()
        model.fit(x, y, **fit)
        seconds.append(slowest(time.perf_counter() - t0))
        log(f"rank {rank}: rep {rep} {seconds[-1]:.3f} s")

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if data:
        rss_all = [float(v) for v in hvd.allgather(tf.constant([rss], tf.float64)).numpy()]
    else:
        rss_all = [rss]
    if rank != 0:
        return 0
    ips = [steps * B / s for s in seconds]
    median_step = statistics.median(seconds) / steps
    result = {
        "peer": "horovod", "mode": args.mode, "depth": args.depth, "batch_size": B,
        "ranks": R, "steps": steps, "reps": args.reps,
        "seconds": [round(s, 6) for s in seconds],
        "images_per_s": [round(v, 3) for v in ips],
        "median_images_per_s": round(statistics.median(ips), 3),
        "first_call_s": round(first_call, 6),
        "first_step_s": round(first_call - (steps - 1) * median_step, 6),
        "peak_rss_mib": [round(v, 1) for v in rss_all],
        "tensorflow": tf.__version__, "horovod": horovod.__version__,
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.mode == "data" and RANK_ENV not in os.environ:
        return launch(args, argv)
    if args.mode == "single":
        def expire(*_):
            log(f"timed out after {args.timeout:g} s")
            os._exit(124)
        signal.signal(signal.SIGALRM, expire)
        signal.alarm(max(1, int(args.timeout)))
    try:
        return worker(args)
    except BaseException:
        import traceback
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        # Leave at once without finalising MPI: mpiexec then ends the other ranks,
        # which would otherwise wait forever in the next collective.
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
