"""PyTorch peer for the benchmark: CIFAR ResNet v1 trained in one process or with
torch.distributed.pipelining on CPU.

Usage (with the venv from benchmarks/peers/setup_torch.sh):

    .venv-torch/bin/python benchmarks/peers/torch_pipeline.py --mode single --depth 20 \\
        --steps 2 --reps 1
    .venv-torch/bin/python benchmarks/peers/torch_pipeline.py --mode pipeline --schedule 1f1b \\
        --ranks 2 --microbatches 4 --depth 110 --batch-size 64 --steps 10 --reps 3

The model is `benchmarks/models.py::resnet_v1` rebuilt in PyTorch (same layers, parameter
count, He-normal truncated init, BN epsilon/momentum; L2 1e-4 on conv/dense kernels as SGD
weight decay 2e-4 on exactly those tensors). Every process runs one intra-op and one inter-op
thread. `single` trains the whole model in this process; `pipeline` spawns --ranks processes
(gloo on 127.0.0.1), cuts the model into --ranks stages with as equal numbers of residual
blocks as possible (stage 0 also holds the stem, the last stage the pooling + classifier),
wraps each in `torch.distributed.pipelining.PipelineStage` and drives them with
`ScheduleGPipe` or `Schedule1F1B`; `interleaved` and `zero-bubble` cut it into 2 × --ranks
stages, rank r holding stages r and r + --ranks, driven by `ScheduleInterleaved1F1B` or
`ScheduleInterleavedZeroBubble`. One warm-up pass over the --steps batches, then --reps
timed passes; a pipeline pass's time is the maximum over ranks.

stdout gets exactly one line, `RESULT {json}`, on success; everything else goes to stderr.
If any rank fails, the others are killed and the command exits non-zero; the parent also
gives up after --timeout seconds.
"""

import argparse
import json
import math
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

RESULT_PREFIX = "RESULT "
# --schedule: (torch.distributed.pipelining's class, stages a rank holds)
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved": ("ScheduleInterleaved1F1B", 2),
             "zero-bubble": ("ScheduleInterleavedZeroBubble", 2)}
CLASSES = 10
WEIGHT_DECAY = 1e-4  # Keras L2(1e-4): loss += 1e-4·Σw², gradient 2e-4·w


def log(*parts):
    print("[torch_pipeline]", *parts, file=sys.stderr, flush=True)


# --- command line ---------------------------------------------------------------------------

def blocks_per_stage(depth):
    """n for depth = 6n + 2, or None."""
    if depth < 8 or (depth - 2) % 6:
        return None
    return (depth - 2) // 6


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--mode", choices=["single", "pipeline"], required=True)
    p.add_argument("--depth", type=int, default=110, help="6n+2 (20, 56, 110, ...)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", choices=list(SCHEDULES), default="gpipe")
    p.add_argument("--ranks", type=int, default=2, help="pipeline stages = processes")
    p.add_argument("--reps", type=int, default=3, help="timed passes")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds the parent waits for the ranks before killing them")
    # internal: set by the parent for its children
    p.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    n = blocks_per_stage(args.depth)
    if n is None:
        p.error(f"--depth {args.depth} is not 6n+2 with n >= 1 (e.g. 20, 56, 110)")
    for name in ("batch_size", "microbatches", "ranks", "reps", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    if args.mode == "pipeline":
        if args.ranks < 2:
            p.error("--mode pipeline needs --ranks >= 2")
        if args.ranks > 3 * n:
            p.error(f"--ranks {args.ranks} exceeds the {3 * n} residual blocks of depth "
                    f"{args.depth}")
        if args.batch_size % args.microbatches:
            p.error(f"--batch-size {args.batch_size} is not a multiple of --microbatches "
                    f"{args.microbatches}")
        if args.schedule == "1f1b" and args.microbatches < args.ranks:
            p.error(f"--schedule 1f1b needs --microbatches >= --ranks ({args.ranks})")
    return args


def split_blocks(total, parts):
    """As equal as possible, the first stages taking the remainder: split_blocks(9, 2) == [5, 4]."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


# --- model ----------------------------------------------------------------------------------

def build_model(depth, seed):
    """[stem, block, ..., block, head] as nn.Modules, identical for a given seed on every rank."""
    import torch
    from torch import nn

    def he_normal_(weight):
        # keras.initializers.HeNormal: truncated normal (±2σ), σ = sqrt(2/fan_in)/0.8796...
        fan_in = weight[0].numel()
        std = math.sqrt(2.0 / fan_in) / 0.87962566103423978
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2 * std, b=2 * std)

    def conv(cin, cout, kernel, stride):
        c = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)
        he_normal_(c.weight)
        return c

    def bn(c):
        return nn.BatchNorm2d(c, eps=1e-3, momentum=0.01)  # Keras defaults: ε 1e-3, momentum 0.99

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1, self.bn1 = conv(cin, cout, 3, stride), bn(cout)
            self.conv2, self.bn2 = conv(cout, cout, 3, 1), bn(cout)
            self.shortcut = (nn.Sequential(conv(cin, cout, 1, stride), bn(cout))
                             if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return torch.relu(self.shortcut(x) + y)

    n = blocks_per_stage(depth)
    torch.manual_seed(seed)
    stem = nn.Sequential(conv(3, 16, 3, 1), bn(16), nn.ReLU())
    blocks, cin = [], 16
    for stage in range(3):
        cout = 16 * 2 ** stage
        for b in range(n):
            blocks.append(BasicBlock(cin, cout, 2 if stage > 0 and b == 0 else 1))
            cin = cout
    dense = nn.Linear(64, CLASSES)  # softmax folded into CrossEntropyLoss (logits out)
    he_normal_(dense.weight)
    nn.init.zeros_(dense.bias)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), dense)
    return [stem] + blocks + [head]


def make_optimizer(module):
    """SGD(0.01, momentum 0.9); weight decay 2e-4 (= Keras L2 1e-4) on conv/dense kernels only."""
    import torch
    from torch import nn

    decay, rest = [], []
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            decayed = name == "weight" and isinstance(m, (nn.Conv2d, nn.Linear))
            (decay if decayed else rest).append(p)
    return torch.optim.SGD([{"params": decay, "weight_decay": 2 * WEIGHT_DECAY},
                            {"params": rest, "weight_decay": 0.0}], lr=0.01, momentum=0.9)


def make_data(args):
    """The same numbers as benchmarks/pipeline.py (NHWC there), transposed to N×3×32×32."""
    import numpy as np
    import torch

    samples = args.steps * args.batch_size
    rng = np.random.default_rng(args.seed)
    x = rng.random((samples, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=samples)
    x = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    y = torch.from_numpy(y.astype(np.int64))
    return x.split(args.batch_size), y.split(args.batch_size)


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def one_thread():
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def result(args, seconds, first_step_s, rss, split, schedule, microbatches, ranks):
    import torch

    samples = args.steps * args.batch_size
    rates = [samples / s for s in seconds]
    return {"peer": "torch", "mode": args.mode, "schedule": schedule, "depth": args.depth,
            "batch_size": args.batch_size, "microbatches": microbatches, "ranks": ranks,
            "steps": args.steps, "reps": args.reps, "seconds": seconds, "images_per_s": rates,
            "median_images_per_s": statistics.median(rates), "first_step_s": first_step_s,
            "peak_rss_mib": rss, "torch": torch.__version__, "split": split}


# --- single process -------------------------------------------------------------------------

def run_single(args):
    one_thread()
    from torch import nn

    model = nn.Sequential(*build_model(args.depth, args.seed)).train()
    opt = make_optimizer(model)
    loss_fn = nn.CrossEntropyLoss()
    xs, ys = make_data(args)
    first = []

    def train_pass():
        for x, y in zip(xs, ys):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if not first:
                first.append(time.perf_counter() - t0)

    train_pass()  # warm-up
    seconds = timed(train_pass, args.reps)
    n = blocks_per_stage(args.depth)
    print(RESULT_PREFIX + json.dumps(result(args, seconds, first[0], [peak_rss_mib()], [3 * n],
                                            None, None, 1)), flush=True)


# --- pipeline: one rank ---------------------------------------------------------------------

def timed(train_pass, reps):
    """The seconds of `reps` calls of `train_pass` in this process, each logged."""
    seconds = []
    for rep in range(reps):
        t0 = time.perf_counter()
        train_pass()
        seconds.append(time.perf_counter() - t0)
        log(f"single rep {rep}: {seconds[-1]:.3f} s")
    return seconds


def run_rank(args):
    one_thread()
    xs, ys = make_data(args)
    pipeline_rank(args, build_model(args.depth, args.seed), make_optimizer, nn_loss(),
                  list(zip(xs, ys)), lambda seconds, first, rss, split: result(
                      args, seconds, first, rss, split, args.schedule, args.microbatches,
                      args.ranks))


def nn_loss():
    from torch import nn

    return nn.CrossEntropyLoss()


def pipeline_rank(args, layers, optimizer, loss_fn, steps, done):
    """This rank's part of a pipelined run: `layers` ([first, middle…, last] nn.Modules, the
    same on every rank) cut into --ranks × (stages a rank) stages, the middle ones split as
    evenly as possible, the first and the last with the first and last stage; driven by
    --schedule's class over `steps` ((input, target) batches): one warm-up pass, --reps
    timed ones, a pass's time the maximum over ranks. Rank 0 writes `done(seconds, the first
    step's seconds, peak RSS per rank, split)` to the result file. (Threads: `one_thread`
    first, before any parallel work.)"""
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import pipelining

    rank, world = args._rank, args.ranks
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        name, held = SCHEDULES[args.schedule]
        stages = world * held
        first_layer, middle, last_layer = layers[0], layers[1:-1], layers[-1]
        split = split_blocks(len(middle), stages)
        modules = []
        for index in range(rank, stages, world):  # stage c·world + rank for each chunk c
            lo = sum(split[:index])
            parts = (([first_layer] if index == 0 else []) + middle[lo:lo + split[index]]
                     + ([last_layer] if index == stages - 1 else []))
            modules.append(nn.Sequential(*parts).train())
        del layers, first_layer, middle, last_layer
        opt = optimizer(nn.ModuleList(modules))
        pipe = [pipelining.PipelineStage(module, stage_index=index, num_stages=stages,
                                         device=torch.device("cpu"))
                for module, index in zip(modules, range(rank, stages, world))]
        cls = getattr(pipelining, name)
        schedule = cls(pipe if held > 1 else pipe[0], n_microbatches=args.microbatches,
                       loss_fn=loss_fn)
        first = []

        def train_step(x, y):
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            opt.step()

        def train_pass():
            for x, y in steps:
                t0 = time.perf_counter()
                train_step(x, y)
                if not first:
                    first.append(time.perf_counter() - t0)

        def max_over_ranks(value):
            t = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t.item())

        dist.barrier()
        train_pass()  # warm-up: also exchanges shapes and builds the p2p buffers
        first_step_s = max_over_ranks(first[0])
        seconds = []
        for rep in range(args.reps):
            dist.barrier()
            t0 = time.perf_counter()
            train_pass()
            seconds.append(max_over_ranks(time.perf_counter() - t0))
            if rank == 0:
                log(f"pipeline rep {rep}: {seconds[-1]:.3f} s")
        rss = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(rss, torch.tensor([peak_rss_mib()], dtype=torch.float64))
        if rank == 0:
            with open(args._result_file, "w") as f:
                json.dump(done(seconds, first_step_s, [float(r.item()) for r in rss], split), f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """Child pre-exec: SIGKILL this child when the parent dies (Linux), best effort."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def stop(procs, grace=5.0):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_parent(args, argv, script=__file__):
    """Spawn --ranks children of `script` (this file, or another peer built on it) and print
    rank 0's result line; returns the exit code."""
    fd, result_file = tempfile.mkstemp(prefix="torch_pipeline_", suffix=".json")
    os.close(fd)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(args.ranks), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = []

    def on_signal(signum, _frame):
        stop(procs, grace=2.0)
        sys.exit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        for rank in range(args.ranks):
            cmd = [sys.executable, os.path.abspath(script), *argv,
                   "--_rank", str(rank), "--_result-file", result_file]
            procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank)),
                                          stdout=sys.stderr, preexec_fn=_die_with_parent))
        deadline = time.monotonic() + args.timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                log("rank(s) failed: " + ", ".join(f"rank {r} exit {c}" for r, c in failed)
                    + "; stopping the others")
                code = 1
                break
            if all(c == 0 for c in codes):
                code = 0
                break
            if time.monotonic() > deadline:
                log(f"timeout after {args.timeout:g} s; killing all ranks")
                code = 124
                break
            time.sleep(0.1)
        stop(procs)
        if code == 0:
            with open(result_file) as f:
                res = json.load(f)
            print(RESULT_PREFIX + json.dumps(res), flush=True)
        return code
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        os.unlink(result_file)


def dispatch(argv, parse, single, rank, script=__file__):
    """A peer's command line: `single(args)` in this process (--mode single), `rank(args)` as
    a spawned rank, or the parent that spawns --ranks of `script`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.mode == "single":
        single(args)
        return 0
    if args._rank is not None:
        rank(args)
        return 0
    return run_parent(args, argv, script)


def main(argv=None):
    return dispatch(argv, parse_args, run_single, run_rank)


if __name__ == "__main__":
    sys.exit(main())
