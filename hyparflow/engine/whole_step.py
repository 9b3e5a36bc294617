"""One stage (P = 1) trained a step at a time in one compiled function: forward, backward, the
sum over the replicas and the optimizer's update, as Model.fit's train function holds them."""

import contextlib

import tensorflow as tf

from hyparflow.engine import schedule as schedule_
from hyparflow.engine.python_ops import GraphSums
from hyparflow.engine.stage import _as_tensors
from hyparflow.keras import optimizers as optimizers_
from hyparflow.mpi import comm as comm_


class WholeStep:
    """The whole step of a one-stage executor as one `tf.function`.

    The executor's way runs a step as three compiled functions with Python between
    them: the fused forward and backward (which adds the gradients to the sums), the
    sums read, and the optimizer's update, the replicas' allreduce on numpy arrays
    before it. Here the gradients never leave the graph: they are summed over the
    replicas by a Python op inside it (`GraphSums`: one fused allreduce, sparse rows
    gathered in replica order) and applied by the optimizer, as Keras' own train
    function applies them. The arithmetic is the executor's (the same forward, loss
    scale, `tape.gradient` and `optimizer.apply`), so the weights are the same.

    With gradient buckets (replicas, `buckets.Reducer`) the backward adds its
    gradients to the stage's sums as in the executor's way, which hands each bucket to
    the reducer as it is finished, and the update waits for the buckets' sums.

    It runs where nothing needs the gradients between the backward and the update on
    the Python side: one stage a rank (P = 1), one micro-batch a replica (m = 1), every
    replica with samples, an optimizer that neither scales the loss dynamically (whose
    verdict on float16 sums hyparflow takes in float32) nor is sharded; `usable` says
    where. Elsewhere, and for a step outside it, the executor's way runs (the gradient
    sums it keeps stay at zero meanwhile, so a step of either way follows one of the
    other).
    """

    def __init__(self, executor):
        self.executor = executor
        self.worker = executor.chunks[0].worker
        replicas = executor.replicas
        self.sums = GraphSums(self._sum, self._rows) \
            if replicas is not None and replicas.Get_size() > 1 else None
        # (one trace per micro-batch size, as the last stage's functions: Keras' loss
        # trackers count a micro-batch by its static size)
        self._function = tf.function(self._step_fn)
        self._ran = False

    @staticmethod
    def usable(executor):
        """Whether `executor` (built) can run its steps as one function each (`runs` then
        says which steps)."""
        replicas = executor.replicas
        return (executor.topology.partitions == 1 and len(executor.chunks) == 1
                and executor.optimizer is not None and executor.shard is None
                and executor.clip is None and executor.tied is None
                and not optimizers_.loss_scaled(executor.optimizer)
                and bool(executor.variables)
                # the sums then run on TensorFlow's thread
                and (replicas is None or replicas.Get_size() == 1
                     or comm_.any_thread_sends()))

    def runs(self, actions, global_batch):
        """Whether this step (this rank's `actions`, a batch of `global_batch` samples) runs
        here: one fused micro-batch on every replica (the call's m is 1, which every
        replica knows), and no replica without samples (which, in the executor's way,
        takes part in the sums with empty gradients)."""
        ex = self.executor
        return (ex.microbatches in (None, 1) and len(actions) == 1
                and actions[0].kind == schedule_.FUSED
                and global_batch >= ex.topology.replicas)

    def run(self, inputs, y, sw, scale, traced=lambda: None):
        """The step on one micro-batch (`Stage.forward_backward`'s arguments); returns this
        rank's contribution to the step's loss. `traced()` is called, the first time,
        after the function traced and before it runs (what the trace taught, checked
        before any weight moves)."""
        args = _as_tensors(inputs, y, sw, scale)
        self.worker._open(self._function, *args)
        if not self._ran:
            self._function.get_concrete_function(*args)
            traced()
            self._ran = True
        if self.executor.buckets is not None:
            self.executor.buckets.arm()  # this backward completes the sums
        with self.sums.raised() if self.sums is not None else contextlib.nullcontext():
            return float(self._function(*args))

    def _step_fn(self, inputs, y, sw, scale):
        ex = self.executor
        aux, _, grads = self.worker.fused_gradients(inputs, y, sw, scale, [])
        if ex.buckets is not None:
            grads = self._bucketed(grads)
        elif self.sums is not None:
            grads = self.sums(grads)
        if any(g is not None for g in grads):
            ex.optimizer.apply(grads, ex.variables)
        else:  # as the executor's way steps an optimizer without gradients
            ex.optimizer.iterations.assign_add(1)
        return aux

    def _bucketed(self, grads):
        """`grads` combined over the replicas, the dense ones by the gradient buckets (each
        handed over as the backward finishes it, `buckets.Reducer`), through the stage's
        sums as the executor's way takes them: read and put back to zero, then summed."""
        worker = self.worker
        _, added = worker.take_in(grads)
        positions = [k for k, total in enumerate(worker.sums) if total is not None]
        if not positions:  # every gradient sparse: no bucket
            return self.sums(grads)
        with tf.control_dependencies(added):  # read and reset, as `StageWorker.gradients`
            taken = worker._take_fn(len(positions))
        summed = self.sums.op(lambda *values: self._finish(positions, values), taken,
                              [t.dtype for t in taken], "buckets")
        out = self.sums([g if isinstance(g, tf.IndexedSlices) else None for g in grads])
        for k, total in zip(positions, summed):
            total.set_shape(worker.sums[k].shape)
            out[k] = total if grads[k] is not None else None  # (no gradient: None)
        return out

    def _finish(self, positions, values):
        ex, local = self.executor, dict(zip(positions, values))
        with ex.recorder.span("allreduce"):  # the wait for the buckets' sums
            out = ex.buckets.finish(self.worker.sums, lambda k: local[k].numpy(),
                                    ex.over_replicas("the gradient allreduce"))
        return [out[k] for k in positions]

    def _sum(self, arrays):
        ex = self.executor
        with ex.recorder.span("allreduce"):
            return comm_.allreduce_sum(arrays, ex.replicas,
                                       wait=ex.over_replicas("the gradient allreduce"))

    def _rows(self, indices, values):
        ex = self.executor
        with ex.recorder.span("allreduce"):
            return comm_.allgather_rows(
                [indices, values], ex.replicas,
                wait=ex.over_replicas("the gathering of sparse gradient rows"))
