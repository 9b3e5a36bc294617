"""Weights several stages hold (a layer called on each): their gradients summed over the stages
that hold them, so that every holder applies the update one model would."""

import numpy as np
import tensorflow as tf

from hyparflow.mpi import comm as comm_


class Tied:
    """The weights a layer called on several stages gives each of them (GPT-2's and Gemma's
    token embedding, read by the first stage and, reversed, by the output head on the last).

    Each stage holds its copy and computes its part of the gradient (a sparse one
    from a look-up, a dense one from a product). After the replicas' allreduce every
    rank of the pipeline adds its part (zeros where it holds none) in one allreduce
    per step, so every holder gets the whole gradient and, with an optimizer copy
    that started alike, applies the same update: the copies stay one weight. This is
    Megatron-LM's tied word embedding (the first and the last stage hold it and
    allreduce its gradient in their embedding group), over the pipeline's ranks.

    One model's tape adds a look-up's rows into the product's dense gradient, so the
    sum is dense unless every part is rows (two look-ups): then the rows are gathered
    in stage order, as the tape concatenates them. Which parts are rows is fixed by
    the graph, agreed at the first step.

    Args:
        partition: the `Partition` (its `tied`: {variable path: holding stages}).
        stage: the stage this rank holds (one a rank).
        variables: this rank's trainable variables, in the executor's order.
    """

    def __init__(self, partition, stage, variables):
        where = {v.path: k for k, v in enumerate(variables)}
        by_path = {v.path: v for st in partition.stages for v in st.model.trainable_variables}
        paths = sorted(partition.tied)
        # per tied weight: (its place among this rank's variables or None, shape, dtype)
        self.weights = [(where.get(p), tuple(by_path[p].shape),
                         np.dtype(by_path[p].dtype)) for p in paths]
        # the weights whose norm another stage reports (global_clipnorm counts each once)
        self.unreported = {where[p] for p in paths
                           if p in where and partition.tied[p][0] != stage}
        # per tied weight, agreed at the first step: whether any stage has a part of its
        # gradient, and whether its sum is rows
        self._present = self._rows = None

    def combine(self, grads, pipeline, wait=None):
        """This rank's gradients (summed over replicas) with each tied weight's whole
        gradient in place of its part (collective over the pipeline)."""
        grads = list(grads)
        if self._rows is None:
            self._present, self._rows = self._agree(grads, pipeline, wait)
        dense = [(j, w) for j, w in enumerate(self.weights) if not self._rows[j]]
        if dense:
            parts = [self._dense(grads, k, shape, dtype) for _, (k, shape, dtype) in dense]
            summed = comm_.allreduce_sum(parts, pipeline, wait=wait)
            for (j, (k, _, _)), total in zip(dense, summed):
                if k is not None and self._present[j]:
                    grads[k] = total
        for j, (k, shape, dtype) in enumerate(self.weights):
            if self._rows[j]:
                g = grads[k] if k is not None else None
                indices = np.zeros((0,), np.int64) if g is None else \
                    np.asarray(g.indices, np.int64)
                values = np.zeros((0,) + shape[1:], dtype) if g is None else \
                    np.asarray(g.values)
                indices, values = comm_.allgather_rows([indices, values], pipeline, wait=wait)
                if k is not None:
                    grads[k] = tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                                                tf.constant(shape, tf.int64))
        return grads

    def _agree(self, grads, pipeline, wait):
        """Per tied weight, agreed over the pipeline: (whether any holder has a part of its
        gradient, whether every part is rows)."""
        flags = np.zeros((len(self.weights), 3), np.int64)
        for j, (k, _, _) in enumerate(self.weights):
            g = grads[k] if k is not None else None
            flags[j] = (g is not None, isinstance(g, tf.IndexedSlices), g is not None and
                        not isinstance(g, tf.IndexedSlices))
        (flags,) = comm_.allreduce_sum([flags], pipeline, wait=wait)
        return [bool(f[0]) for f in flags], [bool(f[1]) and not f[2] for f in flags]

    @staticmethod
    def _dense(grads, k, shape, dtype):
        """This rank's part of a tied weight's gradient as a dense array (zeros for none)."""
        g = grads[k] if k is not None else None
        if g is None:
            return np.zeros(shape, dtype)
        if isinstance(g, tf.IndexedSlices):
            g = tf.math.unsorted_segment_sum(g.values, g.indices, shape[0])
        return np.asarray(g, dtype)
