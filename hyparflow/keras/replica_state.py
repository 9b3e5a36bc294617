"""The non-trainable state each replica updates on its own samples, made one value on every
replica as each variable's Keras `aggregation` asks: the mean, the sum, or the first replica's."""

import contextlib
import zlib

import numpy as np

from hyparflow.keras import variables as variables_
from hyparflow.mpi import comm as comm_


def of(model):
    """The non-trainable weights of `model`: what a replica's steps may update on its own
    samples (BatchNormalization's moving statistics, a layer's own counters and totals)."""
    return list(model.non_trainable_weights)


def held(partition, topology):
    """`of` the stages this rank holds (`Topology.stages`), in stage order."""
    return [w for s in topology.stages for w in of(partition.stages[s].model)]


def rule(variable):
    """How the replicas' values of `variable` become one.

    "sum" (`aggregation="sum"`): the value the replicas agreed on plus what every replica's
    steps added (a count or total over samples: model.fit's value); "first"
    (`"only_first_replica"`, and a non-floating variable left at `"none"`: a counter
    cannot be averaged): the first replica's; "mean" (`"mean"`, and a floating variable
    left at `"none"`, as Keras leaves BatchNormalization's statistics): the replicas' mean.
    """
    aggregation = getattr(variable, "aggregation", None) or "none"
    if aggregation == "sum":
        return "sum"
    if aggregation == "only_first_replica":
        return "first"
    if aggregation == "mean" or _floating(variable):
        return "mean"
    return "first"


def _floating(variable):
    return "float" in str(variable.dtype)


class Added:
    """What this replica's own steps added to its stage's `aggregation="sum"` variables since
    the replicas last agreed (empty with one replica: nothing to add up)."""

    def __init__(self, variables, replicas):
        self.variables = [v for v in variables if rule(v) == "sum"] if replicas > 1 else []
        self.clear()

    def clear(self):
        self.added = [np.zeros(v.shape, _wide(v.dtype)) for v in self.variables]

    @contextlib.contextmanager
    def step(self):
        """Count what the steps run inside add (callbacks between steps act alike on every
        replica: what they set is in every replica's value already)."""
        if not self.variables:
            yield
            return
        before = [variables_.value(v) for v in self.variables]
        try:
            yield
        finally:
            for total, v, b in zip(self.added, self.variables, before):
                total += variables_.value(v).astype(total.dtype) - b.astype(total.dtype)


def _wide(dtype):
    """A dtype a sum of `dtype` values over steps and replicas is made in: int64 for integers,
    float64 for the rest (floats, bool)."""
    return np.int64 if "int" in str(getattr(dtype, "name", dtype)) else np.float64


def merge(variables, added, group, bounded):
    """Every replica of `group` (this stage's replicas) gets one value of each of `variables`,
    by its `rule`; `added` (an `Added` over the same stage) is then cleared. `bounded(what)`
    gives the wait for a message (the watchdog's).

    One allreduce says which variables differ between replicas (a CRC of each) and
    whether any replica added to a "sum" one; a second, only if one does, carries them
    (sums and means made in float64 or int64). A variable the same on every replica — a
    frozen layer's kernel — is left exactly as it is, and not sent.
    """
    if group is None or group.Get_size() == 1:
        added.clear()
        return
    summed = {id(v): k for k, v in enumerate(added.variables)}
    others = [v for v in variables if id(v) not in summed]
    values = [variables_.value(v) for v in others]
    marks = [zlib.crc32(np.ascontiguousarray(v).view(np.uint8)) for v in values]
    moved = [int(np.any(a != 0)) for a in added.added]
    extremes = np.array(marks + [-m for m in marks] + moved, np.int64)
    comm_.allreduce(extremes, group, "max",
                    bounded("whether this stage's non-trainable state differs between replicas"))
    n = len(values)
    differ = [k for k in range(n) if extremes[k] != -extremes[n + k]]
    grown = [j for j in range(len(moved)) if extremes[2 * n + j]]
    if not differ and not grown:
        added.clear()
        return
    first = group.Get_rank() == 0
    means = {k for k in differ if rule(others[k]) == "mean"}
    send = []
    for k in differ:
        if k in means:
            send.append(values[k].astype(np.float64))
        else:  # the first replica's: the others send zeros
            send.append((values[k] if first else np.zeros_like(values[k])).astype(
                _wide(values[k].dtype)))
    send += [added.added[j] for j in grown]
    totals = comm_.allreduce_sum(send, group, wait=bounded(
        "the non-trainable state of this stage merged over replicas"))
    for k, total in zip(differ, totals):
        if k in means:
            total = total / group.Get_size()
            if not _floating(others[k]):
                total = np.rint(total)
        others[k].assign(total.astype(values[k].dtype))
    for j, total in zip(grown, totals[len(differ):]):
        v = added.variables[j]
        here = v.numpy()
        v.assign((here.astype(total.dtype) + total - added.added[j]).astype(here.dtype))
    added.clear()
