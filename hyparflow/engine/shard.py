"""Optimizer state sharded over a stage's replicas (ZeRO stage 1): which replica updates
which variable; gradients reduce-scattered to it, its new values all-gathered from it.

Each of a stage's variables has one owner among the R replicas of the stage
(`owners`: whole variables, balanced by bytes). A step then moves the bytes of
one allreduce, in two halves: the summed gradient of each variable reaches its
owner only (one reduce-scatter), the owner's optimizer (built over its own
variables, so holding about 1/R of the slots) updates them, and every replica
gets every owner's new values (one all-gather). Optimizers update each variable
from its own gradient and slots (SGD, Adam, ...), so the weights are those of
one optimizer over all of them; what needs every variable (global_clipnorm's
norm, a loss scale's finite check) is combined over the owners by the executor.
"""

import numpy as np
import tensorflow as tf

from hyparflow.keras import optimizers as optimizers_
from hyparflow.keras import variables as variables_
from hyparflow.mpi import comm as comm_


def owners(sizes, replicas):
    """The owning replica of each variable of `sizes` (bytes): largest first, each to the
    least loaded replica (the lowest on a tie), so that every rank computes the same.

    Example:
        >>> owners([400, 100, 300, 200], 2)
        [0, 1, 1, 0]
    """
    load = [0] * replicas
    out = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        r = min(range(replicas), key=lambda r: (load[r], r))
        out[k] = r
        load[r] += sizes[k]
    return out


def _dtype(variable):
    return np.dtype(tf.as_dtype(variable.dtype).as_numpy_dtype)


def nbytes(variable):
    """Bytes of a variable's values."""
    return _dtype(variable).itemsize * int(np.prod(variable.shape, dtype=np.int64))


class Shard:
    """This rank's share of a stage's variables among the ranks of `comm` (the stage's
    replicas, ranked by replica)."""

    def __init__(self, variables, comm):
        self.variables = list(variables)
        self.comm = comm
        R, me = comm.Get_size(), comm.Get_rank()
        self.nbytes = [nbytes(v) for v in self.variables]
        self.owner = owners(self.nbytes, R)
        self.owned = [k for k, r in enumerate(self.owner) if r == me]  # positions, in order
        # every variable, grouped by owner: the layout of the reduce-scatter and all-gather
        self.order = sorted(range(len(self.variables)), key=lambda k: (self.owner[k], k))
        self.replicas = R
        # the all-gather's bytes per owner and where each owner's start
        self._sizes = np.zeros(R, np.int64)
        for k, r in enumerate(self.owner):
            self._sizes[r] += self.nbytes[k]
        self._offsets = np.concatenate([[0], np.cumsum(self._sizes)[:-1]])

    @property
    def owned_variables(self):
        return [self.variables[k] for k in self.owned]

    def reduce_scatter(self, grads, wait=None):
        """The owned variables' gradients summed over the replicas (in `owned` order).

        Dense gradients go in one reduce-scatter per dtype (summed in float32 where
        MPI has no sum for the dtype, as `comm.allreduce_sum`); sparse ones
        (IndexedSlices) are gathered row by row in replica order, as the unsharded
        step does, and kept where owned. None stays None.
        """
        grads = list(grads)
        out = {}
        by_dtype = {}
        for k in self.order:
            g = grads[k]
            if g is None:
                out[k] = None
            elif isinstance(g, tf.IndexedSlices):
                indices, values = comm_.allgather_rows(
                    [g.indices.numpy(), g.values.numpy()], self.comm, wait=wait)
                out[k] = tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                                          g.dense_shape)
            else:
                by_dtype.setdefault(np.dtype(g.dtype.as_numpy_dtype), []).append(k)
        for dtype, ks in by_dtype.items():
            wide = comm_.summable(dtype)
            arrays = [np.asarray(grads[k]) for k in ks]
            flat = np.concatenate([np.ravel(a) for a in arrays]).astype(wide, copy=False)
            counts = np.zeros(self.replicas, np.int64)
            for k, a in zip(ks, arrays):
                counts[self.owner[k]] += a.size
            # in place: this rank's sums land at the start of `flat` (no second buffer)
            comm_.reduce_scatter_sum(flat, counts, self.comm, wait)
            offset, owned = 0, set(self.owned)
            for k, a in zip(ks, arrays):
                if k in owned:
                    out[k] = flat[offset:offset + a.size].reshape(a.shape).astype(
                        dtype, copy=False)
                    offset += a.size
        return [out[k] for k in self.owned]

    def all_gather(self, wait=None):
        """Every replica's variables take their owners' values, bit for bit."""
        if self.replicas == 1:
            return
        nbytes = self.nbytes
        received = np.empty(int(self._sizes.sum()), np.uint8)
        me, at = self.comm.Get_rank(), 0
        for k in self.order:  # in place: this rank's values where the others' will land
            if self.owner[k] == me:
                received[at:at + nbytes[k]] = comm_.as_bytes(variables_.value(self.variables[k]))
            at += nbytes[k]
        comm_.allgather_bytes(received, self._sizes, self._offsets, self.comm, wait)
        at, theirs, values = 0, [], []
        for k in self.order:  # owner by owner, as the buffer is laid out
            if self.owner[k] != me:
                v = self.variables[k]
                theirs.append(v)
                values.append(received[at:at + nbytes[k]].view(_dtype(v)).reshape(tuple(v.shape)))
            at += nbytes[k]
        variables_.assign(theirs, values)

    def state(self, optimizer, wait=None):
        """{name: array} of the stage optimizer's state over every owner's variables (each
        owner's slots, and this rank's step count and scalars, which every owner shares)."""
        mine = optimizers_.stage_state(optimizer)
        merged = {}
        for state in comm_.allgather_objects(mine, self.comm, wait=wait):
            merged.update(state)
        merged.update(mine)
        return merged
