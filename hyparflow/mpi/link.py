"""The network between two nodes, measured: latency and bandwidth of a message, and the
bandwidth an allreduce sees (what hf.plan prices messages crossing nodes by). The timed
messages themselves are blocking sends and receives between the two ranks measuring: a
watchdog's polling would be part of what is timed."""

import math
import time

import numpy as np

from hyparflow.mpi import comm as comm_
from hyparflow.mpi import placement, sums
from hyparflow.mpi.guard import bounded


def measure(comm, nbytes=4 << 20, rounds=5, pings=100):
    """(latency s, bandwidth B/s, allreduce bandwidth B/s) between rank 0's node and the next
    node of `comm`, or None on one node.

    Collective. Rank 0 and the
    first rank on another node measure: the latency is half the best mean round
    trip of `pings` one-byte messages (of `rounds` tries), the bandwidth `nbytes`
    over the best time of sending them and hearing a one-byte reply, less that
    round trip, and the allreduce bandwidth what the ring model's two steps of
    `nbytes` / 2 need to take the best time of an allreduce of `nbytes` between the
    two (2 · latency + `nbytes` / it). Every other rank waits without spinning; all get the
    figures.
    """
    wait = bounded(comm, "every rank to measure the link between nodes (hf.plan)")
    nodes = comm_.allgather_objects(placement.node_name(), comm, wait)
    other = next((r for r, node in enumerate(nodes) if node != nodes[0]), None)
    if other is None:
        return None
    rank = comm.Get_rank()
    figures = None
    pair = comm.Split(0 if rank in (0, other) else comm_.mpi().UNDEFINED, rank)
    if rank in (0, other):
        peer = other if rank == 0 else 0
        tiny, big = np.zeros(1, np.uint8), np.zeros(nbytes, np.uint8)
        summed = np.zeros(nbytes // 4, np.float32)
        trip, send, reduce = math.inf, math.inf, math.inf
        for _ in range(rounds):
            comm_.idle(comm.Ibarrier())  # the two measure while the others sleep
            start = time.perf_counter()
            for _ in range(pings):
                _there_and_back(comm, rank == 0, peer, tiny, tiny, tag=71)
            trip = min(trip, (time.perf_counter() - start) / pings)
            start = time.perf_counter()
            _there_and_back(comm, rank == 0, peer, big, tiny, tag=72)
            send = min(send, time.perf_counter() - start)
            pair.Barrier()
            start = time.perf_counter()
            sums.start(summed, pair).Wait()  # the sum a stage's replicas make
            reduce = min(reduce, time.perf_counter() - start)
        pair.Free()
        figures = (trip / 2, nbytes / max(send - trip, 1e-9),
                   summed.nbytes / max(reduce - trip, 1e-9))
    else:
        for _ in range(rounds):
            comm_.idle(comm.Ibarrier())
    return comm_.broadcast_object(figures, 0, comm, wait)


def _there_and_back(comm, first, peer, message, reply, tag):
    """`first` sends `message` to `peer` and waits for `reply`; the peer receives the message
    and sends the reply."""
    if first:
        comm.Send(message, peer, tag=tag)
        comm.Recv(reply, peer, tag=tag)
    else:
        comm.Recv(message, peer, tag=tag)
        comm.Send(reply, peer, tag=tag)
