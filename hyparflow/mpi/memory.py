"""Each rank's share of its node's memory: the job's memory limit (its cgroup's) or what the node
has, divided among the node's ranks; ``$HYPARFLOW_MEMORY_PER_RANK`` (GiB) sets it instead."""

import os
from typing import NamedTuple

ENV = "HYPARFLOW_MEMORY_PER_RANK"
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a number near 2^63


class Budget(NamedTuple):
    """The memory one rank may use: `bytes` (None: unknown) and where the number comes from."""

    bytes: int | None
    source: str


def env_number(name, environ=os.environ):
    """(the text, the number) of the variable `name`: (None, None) unset or blank, a NaN
    number where the text is not one (a size in MiB or GiB, checked by its reader)."""
    value = environ.get(name, "").strip()
    if not value:
        return None, None
    try:
        return value, float(value)
    except ValueError:
        return value, float("nan")


def given(environ=os.environ):
    """Bytes from ``$HYPARFLOW_MEMORY_PER_RANK`` (GiB), or None when it is not set.

    Raises:
        ValueError: not a number of GiB > 0, naming the variable and the value.
    """
    value, gib = env_number(ENV, environ)
    if value is None:
        return None
    if not 0 < gib < float("inf"):
        raise ValueError(f"{ENV}={value!r}: give the memory one rank may use in GiB, a number "
                         "> 0 (e.g. 3.5), or unset it for the job's limit shared by the node's "
                         "ranks.")
    return int(gib * 2**30)


def per_rank(local_ranks, environ=os.environ, root="/"):
    """The `Budget` of one of the `local_ranks` ranks of this node.

    ``$HYPARFLOW_MEMORY_PER_RANK`` if set; else the smaller of the job's memory limit (the
    cgroup's ``memory.max``, or v1's ``memory.limit_in_bytes``, the tightest on the way to
    the root) and what the node has for the job (its available memory now, plus what the
    node's ranks already hold, each taken as holding what this one does), over
    `local_ranks`; None bytes where neither can be read. `root`: where /proc and /sys are.

    Example:
        >>> per_rank(4, {ENV: "1.5"})
        Budget(bytes=1610612736, source='$HYPARFLOW_MEMORY_PER_RANK')
    """
    mine = given(environ)
    if mine is not None:
        return Budget(mine, f"${ENV}")
    limits = []
    limit = cgroup_limit(root)
    if limit is not None:
        limits.append((limit, "the job's memory limit (cgroup)"))
    available = _meminfo(root).get("MemAvailable")
    if available is not None:
        limits.append((available + local_ranks * resident(root), "the node's memory"))
    if not limits:
        return Budget(None, "unknown: no /proc/meminfo nor cgroup limit")
    total, source = min(limits)
    return Budget(total // local_ranks, f"{source} shared by {local_ranks} rank(s)")


def cgroup_limit(root="/"):
    """The tightest memory limit of this process's cgroup and its ancestors, bytes (None: none).

    Example (cgroup v2: ``0::/job`` in /proc/self/cgroup, ``8589934592`` in
    /sys/fs/cgroup/job/memory.max): 8 GiB.
    """
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            base, name = os.path.join(root, "sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):  # v1: the memory controller's
            base, name = os.path.join(root, "sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for k in range(len(parts), -1, -1):
            value = _read_number(os.path.join(base, *parts[:k], name))
            if value is not None and value < _UNLIMITED:
                found.append(value)
    return min(found) if found else None


def _read_number(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _meminfo(root):
    """/proc/meminfo's fields in bytes ({} where it cannot be read)."""
    out = {}
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            for line in f:
                key, _, rest = line.partition(":")
                words = rest.split()
                if words and words[0].isdigit():
                    out[key] = int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def resident(root="/"):
    """This process's resident memory, bytes (0 where it cannot be read)."""
    try:
        with open(os.path.join(root, "proc/self/statm")) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
