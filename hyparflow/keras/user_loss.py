"""A model's own compute_loss and compute_metrics (or its add_loss losses alone) on a pipeline:
called on the last stage, with every stage's losses."""

import keras
import tensorflow as tf
from keras import tree

from hyparflow.keras import batch_values, keras_private
from hyparflow.mpi.guard import Guard

# Keras' words when a model has no loss at all (Trainer.compute_loss).
NO_LOSS = "No loss to compute. Provide a `loss` argument in `compile()`."


class UserLoss:
    """The loss and metrics of one stage of a model with its own loss logic, at P > 1.

    For a model that overrides `compute_loss` or `compute_metrics`, or that was
    compiled without a loss (it trains on its `add_loss` losses, as Keras' own
    step does): the last stage calls the model's `compute_loss(x, y, y_pred,
    sample_weight, training)` and `compute_metrics(x, y, y_pred, sample_weight)`
    as Keras' train and test steps do — with `x`, the model's inputs, which the
    last stage reads from the data for them. The losses of the other stages'
    layers (add_loss, regularizers) live on other ranks: each other stage sums
    its own per micro-batch and sends the sum to the last stage, where, inside
    the call, `model.losses` holds those sums (in stage order) and then the last
    stage's own losses — so compute_loss sees the values `model.fit` would, up
    to summation order, whatever it does with them. The derivative of the step's
    loss by each stage's sum goes back to that stage as the partial error of its
    sum (`StageWorker` treats the sum as one more output).

    What `compute_metrics` returns names the logs (`keys`): values of the model's
    metrics, combined over replicas from their state as compiled metrics are (a
    metric updated with one value per call counts by the micro-batch's share:
    `batch_values.by_share`).
    """

    @staticmethod
    def needed(model):
        """Whether `model`'s loss or metrics come from its own code (not from compile's alone)."""
        return bool(keras_private.overridden(model, keras_private.LOSS_METHODS)) or \
            _add_loss_only(model)

    @staticmethod
    def needs_no_targets(model):
        """Whether `model` may train without targets, as with Model.fit: its own compute_loss,
        or no compiled loss (add_loss losses alone)."""
        return bool(keras_private.overridden(model, ("compute_loss",))) or \
            _add_loss_only(model)

    def __init__(self, model, is_last, functional, structures=None, labelled=None):
        """`structures`: the (x, y, sample_weight) `data.Structure`s of the user's data, in
        which compute_loss and compute_metrics take them, as Keras' steps pass them;
        `labelled`: per output, whether it has a target (None: all have)."""
        self.model, self.is_last, self.functional = model, is_last, functional
        self.structures, self.labelled = structures, labelled
        own = keras_private.overridden(model, keras_private.LOSS_METHODS)
        self.own_loss = "compute_loss" in own
        self.own_metrics = "compute_metrics" in own
        # The last stage reads the model's inputs for an override (Keras' own ignore x).
        self.takes_x = is_last and bool(own)
        # Known once traced, per mode (training or not): whether this stage has losses; on
        # the last stage, the keys compute_metrics returns (or the name of the type it
        # returned instead of a dict).
        self.has_losses, self.returned = {}, {}
        self.keys = {}  # per mode, agreed on every rank (`settle`): the logs' keys, or None

    def contribution(self, losses, others, x, y, sw, outputs, scale, training):
        """This stage's share of the step's loss for one micro-batch (a float32 scalar): on
        other stages the sum of their `losses` (sent to the last stage); on the last stage
        the model's compute_loss scaled by `scale`, with `others` (those sums, in stage
        order) in `model.losses`, and the metrics updated (inside the compiled function)."""
        losses = list(losses)
        self.has_losses[training] = bool(losses)
        if not self.is_last:  # each loss summed to a scalar, as Keras aggregates add_loss's
            return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in losses]) \
                if losses else tf.zeros((), tf.float32)
        y_true, weights = self._as_given(y, 1), self._as_given(sw, 2)
        y_pred = keras_private.as_outputs(self.functional, outputs)
        if not self.takes_x:
            x = None
        elif self.structures is not None:
            x = self.structures[0].pack(list(x))
        else:
            x = tree.pack_sequence_as(keras_private.inputs_struct(self.functional), list(x))
        # In the dtype of this stage's losses (Keras' ops.sum of self.losses needs one).
        dtype = losses[0].dtype if losses else keras.backend.floatx()
        with batch_values.by_share(self.model, scale):  # a micro-batch's share of the batch
            total = keras_private.compute_loss(self.model, x, y_true, y_pred, weights,
                                               training,
                                               [tf.cast(t, dtype) for t in others] + losses)
            if self.own_metrics:
                returned = self.model.compute_metrics(x, y_true, y_pred, weights)
                self.returned[training] = list(flat_logs(returned)) \
                    if isinstance(returned, dict) else type(returned).__name__
            elif y_true is not None and keras_private.compiled_metrics(self.model) is not None:
                keras_private.compiled_metrics(self.model).update_state(y_true, y_pred, weights)
        total = tf.zeros((), tf.float32) if total is None else tf.cast(total, tf.float32)
        return total * scale

    def _as_given(self, arrays, k):
        """Targets (k = 1) or sample weights (k = 2), one per output, as the user gave them."""
        if arrays is None or self.structures is None:
            return None if arrays is None else keras_private.as_outputs(self.functional, arrays)
        return given(arrays, self.structures[k], self.labelled)

    def report(self, stage, training):
        """What this stage knows after tracing, for `settle`: on the last stage also the
        names of the metrics' results (what compute_metrics may return)."""
        returned = self.returned.get(training)
        names = None
        if isinstance(returned, list):
            names = []
            for m in self.model.metrics:
                r = m.result()
                names += list(r) if isinstance(r, dict) else [m.name]
        return (stage, self.has_losses.get(training, False), returned, names)

    def settle(self, reports, training):
        """Agree, from every stage's `report` (the same on every rank), which logs the step
        gives; raises the same error on every rank."""
        if not self.own_loss and not keras_private.has_compiled_loss(self.model) and not any(
                r[1] for r in reports):
            raise Guard.mark_agreed(ValueError(NO_LOSS))
        _, _, returned, names = max(reports, key=lambda r: r[0])  # the last stage's
        if isinstance(returned, str):
            raise Guard.mark_agreed(ValueError(
                f"model {self.model.name!r}'s compute_metrics returned {returned}: return a "
                "dict of logs (e.g. self.get_metrics_result()), as Keras' train_step does."))
        unknown = [k for k in returned or [] if names is not None and k not in names]
        if unknown:  # before the first step's update: refused before training
            raise not_metric_results(self.model, unknown, names, len(reports))
        self.keys[training] = returned


def not_metric_results(model, unknown, names, P):
    """The agreed error for a compute_metrics returning `unknown`, which are not among the
    metrics' results `names`, at `P` > 1."""
    return Guard.mark_agreed(ValueError(
        f"model {model.name!r}'s compute_metrics returned {unknown}, which are not results "
        f"of the model's metrics ({sorted(names)}): with partitions={P} hyparflow combines "
        "the logs over replicas and micro-batches from the metrics' state. Keep the values in "
        "keras.metrics objects the model tracks (self.my_metric = keras.metrics.Mean(...)) and "
        "return their results, or use partitions=1 (any replicas)."))


def given(arrays, structure, labelled):
    """Targets or sample weights, one array per output (None for none), in the `structure`
    the user gave them (Keras passes them to compute_loss so): the labelled outputs' only
    (`labelled`: per output, whether it has a target; None: all have)."""
    has = labelled or [True] * len(arrays)
    if structure.kind == "dict":
        return {n: a for n, a, h in zip(structure.names, arrays, has) if h and a is not None}
    return structure.pack([a for a, h in zip(arrays, has) if h])


def _add_loss_only(model):
    """Whether `model` was compiled without a loss (it trains on its add_loss losses)."""
    return model.compiled and not keras_private.has_compiled_loss(model)


def flat_logs(logs):
    """Nested dicts of logs (a CompileMetrics' result) flattened, keys sorted, as Keras'
    callbacks receive them."""
    out = {}
    for k, v in sorted(logs.items()):
        if isinstance(v, dict):
            out.update(flat_logs(v))
        else:
            out[k] = v
    return out
