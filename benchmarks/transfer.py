"""Boundary-tensor transfer rate of hyparflow's messaging against raw mpi4py Send/Recv.

Run on two ranks::

    .venv/bin/hyparflow-run -n 2 --threads 1 .venv/bin/python benchmarks/transfer.py

For each size, rank 0 and rank 1 ping-pong the same bytes `--iters` times in
three ways in the same run, alternating: (a) raw ``comm.Send``/``comm.Recv`` of a
preallocated numpy buffer; (c) raw nonblocking ``Irecv`` posted first, ``Isend``,
``Wait`` on preallocated buffers (the MPI calls a stage makes, without Python
around them); (b) what a stage does per boundary tensor — an
eager TensorFlow tensor viewed as a numpy buffer (DLPack, no copy), sent with `Messages.send`
(``Isend``), received with `Messages.recv` (into the rank's kept, 64-byte
aligned buffer for that slot, with ``Irecv``), then waited for and handed to
TensorFlow (DLPack, no copy). Reported: MB/s of each (median of
`--reps`), the ratio (b)/(a), and the two parts of it: (c)/(a), what nonblocking
MPI costs, and (b)/(c), what hyparflow's Python around it costs.
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import hyparflow  # noqa: E402,F401  # isort: skip  (threads before TensorFlow)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from benchmarks import harness  # noqa: E402
from hyparflow.engine.stage import to_numpy, to_tensor  # noqa: E402
from hyparflow.mpi import comm as comm_  # noqa: E402

# Boundary tensors of ResNet-110 (CIFAR) for micro-batches of 8 and 64 samples.
SIZES = {"8×32×32×16 (mb 8, stage 1 width)": (8, 32, 32, 16),
         "8×16×16×32": (8, 16, 16, 32),
         "64×32×32×16 (full batch)": (64, 32, 32, 16),
         "64×8×8×64": (64, 8, 8, 64)}


def raw(comm, peer, buf, out, iters):
    start = time.perf_counter()
    for _ in range(iters):
        if comm.rank == 0:
            comm.Send(buf, dest=peer, tag=1)
            comm.Recv(out, source=peer, tag=2)
        else:
            comm.Recv(out, source=peer, tag=1)
            comm.Send(buf, dest=peer, tag=2)
    return time.perf_counter() - start


def nonblocking(comm, peer, buf, out, iters):
    start = time.perf_counter()
    for _ in range(iters):
        if comm.rank == 0:
            send = comm.Isend(buf, dest=peer, tag=5)
            recv = comm.Irecv(out, source=peer, tag=6)
            recv.Wait()
            send.Wait()
        else:
            comm.Irecv(out, source=peer, tag=5).Wait()
            comm.Isend(buf, dest=peer, tag=6).Wait()
    return time.perf_counter() - start


def ours(comm, peer, tensor, shape, iters, pool):
    start = time.perf_counter()
    for _ in range(iters):
        messages = comm_.Messages(comm)
        if comm.rank == 0:
            messages.send(to_numpy(tensor), peer, 3)
            req, got = messages.recv(shape, np.float32, peer, 4, pool, "slot")
        else:
            req, got = messages.recv(shape, np.float32, peer, 3, pool, "slot")
            req.Wait()
            messages.send(to_numpy(tensor), peer, 4)
        req.Wait()
        to_tensor(got)
        messages.wait_sends()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "transfer.json"))
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run on exactly 2 ranks")
    peer = 1 - comm.rank
    rows = []
    for label, shape in SIZES.items():
        buf = np.random.default_rng(0).random(shape, dtype=np.float32)
        out = np.empty_like(buf)
        tensor = tf.constant(buf)
        pool = comm_.BufferPool()  # as the executor keeps one per rank
        raw(comm, peer, buf, out, 3), ours(comm, peer, tensor, shape, 3, pool)  # warm-up
        nonblocking(comm, peer, buf, out, 3)
        t_raw, t_nb, t_ours = [], [], []
        for _ in range(args.reps):
            comm.Barrier()
            t_raw.append(raw(comm, peer, buf, out, args.iters))
            comm.Barrier()
            t_nb.append(nonblocking(comm, peer, buf, out, args.iters))
            comm.Barrier()
            t_ours.append(ours(comm, peer, tensor, shape, args.iters, pool))
        moved = 2 * args.iters * buf.nbytes / 1e6
        rate_raw = moved / statistics.median(t_raw)
        rate_nb = moved / statistics.median(t_nb)
        rate_ours = moved / statistics.median(t_ours)
        per_trip_us = 1e6 * (statistics.median(t_ours) - statistics.median(t_nb)) / args.iters
        rows.append({"tensor": label, "bytes": buf.nbytes, "raw_MB_per_s": rate_raw,
                     "nonblocking_MB_per_s": rate_nb, "hyparflow_MB_per_s": rate_ours,
                     "ratio": rate_ours / rate_raw, "nonblocking_ratio": rate_nb / rate_raw,
                     "python_ratio": rate_ours / rate_nb,
                     "python_us_per_round_trip": per_trip_us})
    if comm.rank == 0:
        report = {"benchmark": "transfer", "description": __doc__.strip().splitlines()[0],
                  "machine": harness.machine(), "iters": args.iters, "reps": args.reps,
                  "rows": rows}
        harness.write_report(report, args.output)
        print("| boundary tensor | bytes | raw Send/Recv MB/s | raw Isend/Irecv MB/s | "
              "hyparflow MB/s | ratio | nonblocking / raw | hyparflow / nonblocking | "
              "Python µs per round trip |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['tensor']} | {r['bytes']:,} | {r['raw_MB_per_s']:.0f} | "
                  f"{r['nonblocking_MB_per_s']:.0f} | {r['hyparflow_MB_per_s']:.0f} | "
                  f"{r['ratio']:.2f} | {r['nonblocking_ratio']:.2f} | "
                  f"{r['python_ratio']:.2f} | {r['python_us_per_round_trip']:.0f} |")


if __name__ == "__main__":
    main()
