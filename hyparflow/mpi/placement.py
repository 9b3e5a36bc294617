"""Where ranks run: each node's ranks made consecutive, one GPU per rank, and the placement report.

hyparflow numbers a job's ranks pipeline by pipeline (rank = replica × P + stage),
so consecutive ranks should share a node: a pipeline sends a message per
micro-batch between neighbouring stages, while replicas exchange gradients once
per step. Launchers place ranks by slot (block) by default, which gives exactly
that; but ``mpirun --map-by node`` or a scheduler's cyclic distribution deal
ranks out round-robin, putting every stage of a pipeline on a different node.
`grouped` renumbers the ranks so that each node's ranks are consecutive,
whatever the launcher did, and `report` says where everything landed.

Nothing here imports TensorFlow or MPI at import time.
"""

import os

NODE_ENV = "HYPARFLOW_NODE"  # the node a rank reports (default: MPI's processor name)
# Open MPI between nodes (TCP): a message larger than the eager limit moves only when its
# sender calls MPI again, which a stage inside its compiled forward or backward does not;
# Open MPI's own TCP progress thread moves it meanwhile (benchmarks/README.md, cluster.py:
# pipelines across two nodes 1.03–1.5× faster, data parallel 3–7 % slower on 2 cores).
TCP_PROGRESS = "OMPI_MCA_btl_tcp_progress_thread"

# Variables that MPI launchers and Slurm set to this process's index on its node.
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                    "PMI_LOCAL_RANK", "SLURM_LOCALID")
_NVIDIA = "/proc/driver/nvidia/gpus"

PINNED_GPU = None  # the GPU `pin_gpu` gave this rank when hyparflow was imported
NODES = []  # every rank's node, by launcher rank, once `grouped` has run


def ranks_per_node(nodes=None):
    """The most ranks any node holds (None before `grouped` has run).

    Example:
        >>> ranks_per_node(["a", "b", "a", "b", "a"])
        3
    """
    nodes = NODES if nodes is None else nodes
    if not nodes:
        return None
    return max(nodes.count(n) for n in set(nodes))


def node_name():
    """This rank's node: ``$HYPARFLOW_NODE`` if set, else MPI's processor name."""
    name = os.environ.get(NODE_ENV, "")
    if name:
        return name
    from mpi4py import MPI

    return MPI.Get_processor_name()


def node_order(nodes):
    """World ranks in the order that makes each node's ranks consecutive.

    Nodes come in the order of their lowest rank, ranks within a node in rank
    order; a job placed by slot (block) keeps its order.

    Example:
        >>> node_order(["a", "b", "a", "b"])   # placed round-robin on two nodes
        [0, 2, 1, 3]
    """
    first = {}
    for node in nodes:
        first.setdefault(node, len(first))
    return sorted(range(len(nodes)), key=lambda rank: (first[nodes[rank]], rank))


NAME_BYTES = 256  # MPI_MAX_PROCESSOR_NAME in the common MPIs


def grouped(comm, wait=None):
    """`comm` itself when its ranks are grouped by node, else a copy renumbered so that they are.

    Collective: every rank of `comm` must call it. `wait(request)` waits for the
    node names (default: MPI's Wait); a guard's bounded wait sees a rank that
    never comes.
    """
    import numpy as np

    mine = node_name().encode()[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
    names = np.empty((comm.Get_size(), NAME_BYTES), np.uint8)
    request = comm.Iallgather(np.frombuffer(mine, np.uint8), names)
    (wait or (lambda r: r.Wait()))(request)
    nodes = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in names]
    NODES[:] = nodes
    order = node_order(nodes)
    if order == list(range(len(nodes))):
        return comm
    return comm.Split(color=0, key=order.index(comm.Get_rank()))


def local_rank():
    """This process's index among the ranks of its node, from the launcher (None if unknown)."""
    for name in _LOCAL_RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def gpu_count(driver=_NVIDIA):
    """NVIDIA GPUs the kernel driver lists on this node (no TensorFlow, no CUDA call)."""
    try:
        return len(os.listdir(driver))
    except OSError:
        return 0


def pin_gpu(environ=os.environ, driver=_NVIDIA):
    """Give this rank one GPU of its node, by local rank, through ``CUDA_VISIBLE_DEVICES``.

    When ``CUDA_VISIBLE_DEVICES`` already lists several devices (Slurm's
    ``--gpus-per-node`` gives every task all of them), the rank keeps entry
    (local rank mod count) of that list; one device, or an empty value (no GPU),
    is left as it is. Unset, the rank takes GPU (local rank mod GPUs on the
    node). Nothing happens when the launcher does not say the local rank. Must
    run before TensorFlow initialises its devices (hyparflow does it on import).

    Returns:
        The device given to this rank (as ``CUDA_VISIBLE_DEVICES`` names it), or None.
    """
    local = local_rank()
    if local is None:
        return None
    if "CUDA_VISIBLE_DEVICES" in environ:
        devices = [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
        if len(devices) < 2:
            return None
        gpu = devices[local % len(devices)]
    else:
        count = gpu_count(driver)
        if not count:
            return None
        gpu = str(local % count)
    environ["CUDA_VISIBLE_DEVICES"] = gpu
    return gpu


def ranges(values):
    """[0, 1, 2, 5] → '0-2, 5'."""
    out, values = [], sorted(values)
    start = prev = values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(out)


def entry():
    """This rank's line of the report: its node, its number from the launcher, its GPU."""
    from mpi4py import MPI

    return {"node": node_name(), "world_rank": MPI.COMM_WORLD.Get_rank(), "gpu": PINNED_GPU,
            "tcp_progress": os.environ.get(TCP_PROGRESS) == "1"}


def report(entries, partitions, replicas):
    """The placement, one line per node, and how many pipelines stay on one node.

    Args:
        entries: per rank of the job (in hyparflow's numbering), a dict with
            ``node``, ``world_rank`` (the launcher's number), ``gpu`` (or None).
        partitions, replicas: P and R.

    Returns:
        The lines, e.g. ``node c101: world ranks 0-3 → replica 0 stages 0-3``.
    """
    by_node = {}
    for rank, e in enumerate(entries):
        by_node.setdefault(e["node"], []).append((rank, e))
    lines = []
    for node, ranks in by_node.items():
        parts = {}
        for rank, _ in ranks:
            parts.setdefault(rank // partitions, []).append(rank % partitions)
        where = "; ".join(f"replica {r} stage{'s' if len(s) > 1 else ''} {ranges(s)}"
                          for r, s in parts.items())
        gpus = {str(e["gpu"]) for _, e in ranks if e["gpu"] is not None}
        if all(g.isdigit() for g in gpus):
            listed = ranges([int(g) for g in gpus]) if gpus else ""
        else:  # UUIDs or MIG names from CUDA_VISIBLE_DEVICES
            listed = ", ".join(sorted(gpus))
        gpu = f" (GPU {listed})" if gpus else ""
        world = ranges([e["world_rank"] for _, e in ranks])
        lines.append(f"node {node}: world rank{'s' if len(ranks) > 1 else ''} {world} → "
                     f"{where}{gpu}")
    whole = sum(1 for r in range(replicas)
                if len({entries[r * partitions + s]["node"] for s in range(partitions)}) == 1)
    progress = sum(bool(e.get("tcp_progress")) for e in entries)
    lines.append(f"{len(by_node)} node{'s' if len(by_node) > 1 else ''}, "
                 f"{partitions * replicas} ranks; {whole} of {replicas} pipeline"
                 f"{'s' if replicas > 1 else ''} within one node"
                 + (f"; Open MPI's TCP progress thread on {progress} of "
                    f"{partitions * replicas} ranks" if progress else ""))
    return lines
