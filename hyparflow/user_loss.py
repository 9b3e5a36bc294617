"""A model's own compute_loss and compute_metrics (or its add_loss losses alone) on a pipeline: called on the last stage, the other stages' losses weighted as that code weighs them."""

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow import keras_private
from hyparflow.callbacks import flat_logs
from hyparflow.guard import Guard

# Keras' words when a model has no loss at all (Trainer.compute_loss).
NO_LOSS = "No loss to compute. Provide a `loss` argument in `compile()`."


class UserLoss:
    """The loss and metrics of one stage of a model with its own loss logic, at P > 1.

    For a model that overrides `compute_loss` or `compute_metrics`, or that was
    compiled without a loss (it trains on its `add_loss` losses, as Keras' own
    step does): the last stage calls the model's `compute_loss(x, y, y_pred,
    sample_weight, training)` and `compute_metrics(x, y, y_pred, sample_weight)`
    as Keras' train and test steps do — with `x`, the model's inputs, which the
    last stage reads from the data for them. Inside, `model.losses` holds the last
    stage's losses (its layers' `add_loss` and regularizers) and one more: a
    zero standing for the sum of every other stage's losses, which live on other
    ranks. Each other stage adds its losses to its own loss contribution, so
    their gradients flow where their variables are; how much they count is read
    off the code: the derivative of `compute_loss` by that stand-in. Keras'
    default and an override that adds ``sum(self.losses)`` (or calls `super()`)
    give 1: the other stages count their losses once, as in `model.fit`. An
    override that ignores `self.losses` gives none: the other stages drop theirs.
    Any other weight cannot be split over stages and is refused, on every rank.

    What `compute_metrics` returns names the logs (`keys`): values of the model's
    metrics, combined over replicas from their state as compiled metrics are.
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
        modes = (True, False)  # training, inference
        # Per mode: how much this stage's losses count (1, or 0 when the last stage's
        # compute_loss ignores them); on the last stage, the derivative by the stand-in
        # last seen, and its largest distance from 1 since `drift` last read it; whether
        # that must stay 0.
        self.weight = {t: tf.Variable(1.0, trainable=False) for t in modes}
        self.slope = {t: tf.Variable(1.0, trainable=False) for t in modes}
        self._drift = {t: tf.Variable(0.0, trainable=False) for t in modes}
        self.checked = {t: False for t in modes}
        # Known once traced, per mode: whether this stage has losses; on the last stage,
        # whether compute_loss ignores the stand-in, and the keys compute_metrics returns
        # (or the name of the type it returned instead of a dict).
        self.has_losses, self.ignores, self.returned = {}, {}, {}
        self.keys = {}  # per mode, agreed on every rank (`settle`): the logs' keys, or None

    def contribution(self, losses, x, y, sw, outputs, scale, training):
        """This stage's share of the step's loss for one micro-batch (a float32 scalar), and
        on the last stage the metrics updated (inside the stage's compiled function)."""
        losses = list(losses)
        self.has_losses[training] = bool(losses)
        if not self.is_last:  # each loss summed to a scalar, as Keras aggregates add_loss's
            total = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in losses]) \
                if losses else tf.zeros((), tf.float32)
            return total * scale * self.weight[training]
        from hyparflow.stage import as_outputs

        y_true, weights = self._as_given(y, 1), self._as_given(sw, 2)
        y_pred = as_outputs(self.functional, outputs)
        if not self.takes_x:
            x = None
        elif self.structures is not None:
            x = self.structures[0].pack(list(x))
        else:
            x = tree.pack_sequence_as(keras_private.inputs_struct(self.functional), list(x))
        # The stand-in for the other stages' losses, in the dtype of this stage's (Keras'
        # ops.sum of self.losses needs one dtype).
        others = tf.zeros((), losses[0].dtype if losses else keras.backend.floatx())
        with tf.GradientTape() as tape:
            tape.watch(others)
            total = keras_private.compute_loss(self.model, x, y_true, y_pred, weights,
                                               training, losses + [others])
            total = tf.zeros((), tf.float32) if total is None else tf.cast(total, tf.float32)
        slope = tape.gradient(total, others)
        self.ignores[training] = slope is None
        if slope is not None:
            slope = tf.cast(slope, tf.float32)
            self.slope[training].assign(slope)
            self._drift[training].assign(tf.maximum(self._drift[training],
                                                    tf.abs(slope - 1.0)))
        if self.own_metrics:
            returned = self.model.compute_metrics(x, y_true, y_pred, weights)
            self.returned[training] = list(flat_logs(returned)) \
                if isinstance(returned, dict) else type(returned).__name__
        elif y_true is not None and keras_private.compiled_metrics(self.model) is not None:
            keras_private.compiled_metrics(self.model).update_state(y_true, y_pred, weights)
        return total * scale

    def _as_given(self, arrays, k):
        """Targets (k = 1) or sample weights (k = 2), one per output, as the user gave them."""
        from hyparflow.stage import as_outputs

        if arrays is None or self.structures is None:
            return None if arrays is None else as_outputs(self.functional, arrays)
        return given(arrays, self.structures[k], self.labelled)

    def report(self, stage, training):
        """What this stage knows after tracing (and `prepare`'s run), for `settle`."""
        return (stage, self.has_losses.get(training, False), self.ignores.get(training),
                float(self.slope[training].numpy()) if self.is_last else None,
                self.returned.get(training))

    def settle(self, reports, partitions, training):
        """Agree, from every stage's `report` (the same on every rank), how the other stages'
        losses count and which logs the step gives; raises the same error on every rank."""
        last = next(r for r in reports if r[0] == partitions - 1)
        others = any(r[1] for r in reports if r[0] != partitions - 1)
        if not self.own_loss and not keras_private.has_compiled_loss(self.model) and not any(
                r[1] for r in reports):
            raise Guard.mark_agreed(ValueError(NO_LOSS))
        _, _, ignores, slope, returned = last
        if isinstance(returned, str):
            raise Guard.mark_agreed(ValueError(
                f"model {self.model.name!r}'s compute_metrics returned {returned}: return a "
                "dict of logs (e.g. self.get_metrics_result()), as Keras' train_step does."))
        if others and not ignores and not _one(slope):
            raise Guard.mark_agreed(ValueError(self.weighted(partitions, slope)))
        self.weight[training].assign(0.0 if others and ignores else 1.0)
        self.checked[training] = others and not ignores
        self._drift[training].assign(0.0)
        self.keys[training] = returned

    def drift(self, training):
        """On the last stage, how far from 1 the derivative by the stand-in strayed in the
        steps since the last call, where it must stay 1 (0.0 elsewhere); read and reset."""
        if not (self.is_last and self.checked[training]):
            return 0.0
        drift = float(self._drift[training].numpy())
        if drift:
            self._drift[training].assign(0.0)
        return 0.0 if _one(1.0 + drift) else drift

    def weighted(self, partitions, slope=None):
        """The refusal of a compute_loss that weighs the other stages' losses by `slope`."""
        by = "by other than 1 at this step" if slope is None else f"by {slope:.6g}"
        return (f"model {self.model.name!r}'s compute_loss weighs the losses in self.losses "
                f"(add_loss, regularizers) {by}: with partitions={partitions} they are "
                "computed on the stages where their layers are, and hyparflow can count "
                "them once (as Keras' compute_loss and sum(self.losses) do) or not at all. "
                "Scale them where they are made (the regularizer's factor, the add_loss "
                "term), or use partitions=1 (any replicas).")


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


def _one(slope):
    """Whether a derivative by the stand-in is 1 (to float32 rounding)."""
    return bool(np.isclose(slope, 1.0, rtol=0, atol=1e-6))
