"""A model's own train_step, test_step and predict_step, run as written on each replica's share,
its gradients combined over replicas."""

import contextlib

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow import trace as trace_
from hyparflow.data import batches
from hyparflow.engine.python_ops import GraphSums
from hyparflow.keras import batch_norm, batch_values
from hyparflow.keras import optimizers as optimizers_
from hyparflow.keras import variables as variables_
from hyparflow.mpi import comm as comm_
from hyparflow.mpi.guard import PeerFailed, WatchdogTimeout


def optimizers_of(model):
    """model.optimizer and every optimizer the model keeps in an attribute (a GAN's two)."""
    found = []

    def add(value):
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not o for o in found):
            found.append(value)

    add(getattr(model, "optimizer", None))
    for value in list(vars(model).values()):
        for v in (value.values() if isinstance(value, dict) else
                  value if isinstance(value, (list, tuple)) else [value]):
            add(v)
    return found


def _trainable_variable(value):
    return isinstance(value, (keras.Variable, tf.Variable)) and getattr(value, "trainable", False)


class Returned:
    """What one step of the model's own code returned on this rank: its logs, and this
    replica's share of the batch (the weight of its values in the combined logs)."""

    def __init__(self, logs, share):
        self.logs, self.share = logs, share


class OwnSteps:
    """The executor of one stage (P = 1) for a model that brings its own training logic.

    Each replica calls the model's `train_step` (or `test_step`, `predict_step`)
    as Model.fit does, on its share of each global batch: the user's code, or
    Keras' own steps, which call the model's `compute_loss` and
    `compute_metrics` (overridden, or a loss from `add_loss` alone). Whatever
    optimizer the step applies — `model.optimizer`, or optimizers the model keeps
    as attributes (a GAN's two) — first receives every replica's gradients, each
    weighted by its replica's share of the batch and summed, inside the step's
    graph: for a loss that is a mean over the samples, the gradient of the global
    batch's loss, as `model.fit` takes it on the whole batch. Clipping, loss
    scaling, EMA and gradient accumulation then happen in the optimizer, on those
    gradients, as in one process. Sparse gradients (IndexedSlices) stay sparse:
    their rows are gathered in replica order.

    A replica whose share of a (last, small) batch is empty still takes part:
    it runs the step on a sample of an earlier batch with weight zero, and puts
    back its metrics and non-trainable state afterwards.
    """

    def __init__(self, model, topology, replicas, guard, structures):
        """`replicas`: the communicator of the R ranks (None for one); `structures`: the
        (x, y, sample_weight) `Structure`s the steps take."""
        self.model, self.topology, self.replicas, self.guard = model, topology, replicas, guard
        self.pipeline = None
        self.optimizer = getattr(model, "optimizer", None)
        self.structures = structures
        self.recorder = trace_.SILENT  # hf.fit(trace=...) puts a Recorder here
        self.share = 1.0  # this replica's share of the current batch (read inside the graph)
        self._share = tf.Variable(1.0, trainable=False)  # the same, for the metrics (`_call`)
        self._functions = {}
        self._stand_in = None  # one sample of an earlier batch, for an empty share
        self._fed = 0  # replicas that have had samples (or a stand-in) in a step
        self._steps = 0
        self._multi = replicas is not None and replicas.Get_size() > 1
        # every replica's gradients, each weighted by its share, combined in the step's graph
        self.sums = GraphSums(self._sum, self._rows)
        # synchronized BatchNormalization's moments summed over the replicas (while hf.fit
        # defers it; one micro-batch a step: the moving statistics as Keras updates them)
        self.norms = batch_norm.Norms(
            batch_norm.of([model]), replicas, guard.bounded(
                "the synchronized BatchNormalization sums over the replicas"))

    def configure(self, schedule, recompute, step_graph=False, microbatches=None):
        """Nothing to schedule: one stage, the step as the model wrote it."""

    shard = None  # the model's own steps apply its optimizer to every variable

    def finalize(self, variables):
        """Model.fit's end of training (EMA) for `model.optimizer`, over `variables`."""
        optimizers_.finalize(self.optimizer, variables)

    def optimizer_state(self, wait=None):
        """{name: array}: `model.optimizer`'s state."""
        return optimizers_.stage_state(self.optimizer)

    # -- the steps --------------------------------------------------------------------------

    def train_step(self, sizes, x_micro, y_micro, global_batch, sw_micro=None):
        """One call of the model's train_step on this replica's share; returns `Returned`."""
        with self.recorder.span("train_step"):
            returned = self._run("train", sizes, x_micro, y_micro, sw_micro, global_batch)
            self.norms.apply()
        self.recorder.next_step()
        self._steps += 1
        self.guard.first_step = False
        return returned

    def infer_step(self, sizes, x_micro, y_micro, batch, keep_outputs=False, sw_micro=None):
        """test_step (evaluate) or, with `keep_outputs`, predict_step on this replica's share.

        Returns:
            (Returned or None, predictions): the predictions, with `keep_outputs`,
            as a one-element list of predict_step's structure of numpy arrays.
        """
        if not keep_outputs:
            returned = self._run("test", sizes, x_micro, y_micro, sw_micro, batch)
            self.guard.first_step = False
            return returned, []
        if not sizes:
            return None, []
        x = self.structures[0].pack(list(x_micro[0]))
        outputs = self._function("predict")(keras.utils.pack_x_y_sample_weight(x))
        self.guard.first_step = False
        return None, [tree.map_structure(lambda t: np.asarray(t), outputs)]

    def _run(self, kind, sizes, x_micro, y_micro, sw_micro, batch):
        if len(sizes) > 1:
            raise ValueError(f"a model's own {kind}_step takes each replica's share whole "
                             f"(microbatches=1), got {len(sizes)} micro-batches.")
        x_s, y_s, sw_s = self.structures
        R = self.topology.replicas
        # a batch that leaves replicas without samples before any batch gave them some:
        # replica 0 lends them its first sample (every rank knows when: `_fed`)
        fed = batches.fed(self._fed, batch, R)
        lend = self._multi and fed < R
        self._fed = R if lend else fed
        if sizes:
            data = (x_s.pack(list(x_micro[0])),
                    y_s.pack(list(y_micro[0]) if y_micro else None),
                    sw_s.pack(list(sw_micro[0]) if sw_micro else None))
            self._stand_in = tree.map_structure(lambda a: None if a is None else a[:1], data,
                                                none_is_leaf=True)
            if lend:
                self._stand_in_of(self._stand_in)
            self.share = sizes[0] / batch
            return Returned(self._call(kind, data), self.share)
        if lend and self._stand_in is None:
            self._stand_in = self._stand_in_of(None)
        # No samples: take part in the gradient exchange with weight zero, then put back
        # what the stand-in sample touched.
        self.share = 0.0
        kept = list(self.model.non_trainable_variables) + list(self.model.metrics_variables)
        before = [variables_.value(v) for v in kept]
        logs = self._call(kind, self._stand_in)
        variables_.assign(kept, before)
        return Returned(logs, 0.0)

    def _stand_in_of(self, mine):
        """Replica 0's stand-in sample (`mine` there), lent to every replica (collective)."""
        lent = comm_.allgather_objects(
            tree.map_structure(lambda a: None if a is None else np.asarray(a), mine,
                               none_is_leaf=True) if self.topology.replica == 0 else None,
            self.replicas, wait=self.guard.bounded("replica 0's sample, lent to the replicas "
                                                   "without samples"))
        return lent[0]

    def _call(self, kind, data):
        """The model's `kind` step on `data`; an exception it raises alike on every rank
        reaches every caller, the job healthy (`guard.Guard.agree_raise`). A metric the
        step updates with one value per call counts by this replica's share
        (`batch_values.by_share`)."""
        self._share.assign(self.share)
        counted = batch_values.by_share(self.model, self._share) if self._multi else \
            contextlib.nullcontext()
        with self._combining(), counted:
            try:
                with self.sums.raised():  # a peer's failure, a watchdog report: as itself
                    return self._function(kind)(keras.utils.pack_x_y_sample_weight(*data))
            except (PeerFailed, WatchdogTimeout):
                raise
            except Exception as exc:
                self.guard.agree_raise(exc, (f"{kind}_step", self._steps))
                raise

    def _function(self, kind):
        """The model's step as Model.fit compiles it (not converted by autograph, retracing
        relaxed; eager under run_eagerly; XLA only without an exchange inside)."""
        if kind not in self._functions:
            step = tf.autograph.experimental.do_not_convert(
                getattr(self.model, f"{kind}_step"))
            if not self.model.run_eagerly:
                step = tf.function(step, reduce_retracing=True,
                                   jit_compile=bool(self.model.jit_compile) and not self._multi)
            self._functions[kind] = step
        return self._functions[kind]

    # -- the gradient exchange ---------------------------------------------------------------

    @contextlib.contextmanager
    def _combining(self):
        """While the step traces (or runs eagerly): gradients the step takes of trainable
        variables (`tf.GradientTape.gradient`) are combined over the replicas as they are
        computed, so that whatever the step does with them before applying them (clipping
        by hand, a logged norm) sees the global batch's, as in `model.fit`; an optimizer of
        the model applying gradients of variables not combined so combines them first; any
        other optimizer's apply is an error."""
        if not self._multi:
            yield
            return
        found = optimizers_of(self.model)
        depth = [0]
        combined_variables = set()  # ids of the variables whose gradients this step combined
        base = keras.optimizers.Optimizer
        own = base.__dict__.get("apply")
        original = base.apply
        tape_gradient = tf.GradientTape.gradient

        def gradient(tape, target, sources, *args, **kwargs):
            grads = tape_gradient(tape, target, sources, *args, **kwargs)
            flat = tf.nest.flatten(sources)
            if not flat or not all(_trainable_variable(v) for v in flat):
                return grads  # of inputs (a gradient penalty) or the like: per sample
            combined_variables.update(id(v) for v in flat)
            return tf.nest.pack_sequence_as(grads, self.sums(tf.nest.flatten(grads)))

        def combined(bound):
            def apply(grads, trainable_variables=None):
                depth[0] += 1
                try:
                    if trainable_variables is not None:
                        done = all(id(v) in combined_variables for v in trainable_variables)
                    else:  # the optimizer's own variables: the step's tape combined them
                        done = bool(combined_variables)
                    return bound(list(grads) if done else self.sums(list(grads)),
                                 trainable_variables)
                finally:
                    depth[0] -= 1
            return apply

        def unknown(optimizer, grads, trainable_variables=None):
            if depth[0] == 0:
                raise ValueError(
                    f"the model's train_step applied optimizer {optimizer.name!r}, which is "
                    f"neither model.optimizer nor an attribute of the model: with replicas="
                    f"{self.topology.replicas} hyparflow must combine the replicas' gradients "
                    "before it applies them. Keep it on the model (e.g. self.g_optimizer = "
                    "g_optimizer in compile()).")
            return original(optimizer, grads, trainable_variables)

        for o in found:
            object.__setattr__(o, "apply", combined(o.apply))
        base.apply = unknown
        tf.GradientTape.gradient = gradient
        try:
            yield
        finally:
            tf.GradientTape.gradient = tape_gradient
            for o in found:
                object.__delattr__(o, "apply")
            if own is None:
                del base.apply
            else:
                base.apply = own

    def _wait(self, what):
        return lambda r: self.guard.wait(r, f"{what} of step {self._steps} over the "
                                            f"{self.topology.replicas} replicas")

    def _weighted(self, a):
        if a.dtype in (np.float32, np.float64):
            return a * a.dtype.type(self.share)
        return (a.astype(np.float32) * np.float32(self.share)).astype(a.dtype)  # 16-bit floats

    def _sum(self, grads):
        with self.recorder.span("allreduce"):
            return comm_.allreduce_sum([self._weighted(g) for g in grads], self.replicas,
                                       wait=self._wait("the gradient allreduce"))

    def _rows(self, indices, values):
        with self.recorder.span("allreduce"):
            return comm_.allgather_rows([indices, self._weighted(values)],
                                        self.replicas, wait=self._wait("the gathering of "
                                                                       "sparse gradient rows"))
