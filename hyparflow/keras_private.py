"""Every private Keras name hyparflow relies on, behind one door (tests/test_keras_private.py checks each on the installed Keras)."""

import keras

# What a model may override to bring its own training logic, as Model.fit calls it.
STEP_METHODS = ("train_step", "test_step", "predict_step")
LOSS_METHODS = ("compute_loss", "compute_metrics")


def overridden(model, names=STEP_METHODS + LOSS_METHODS):
    """The methods of `names` that `model`'s class defines differently from keras.Model."""
    return [n for n in names if getattr(type(model), n, None) is not getattr(keras.Model, n)]


def symbolic_build(model, x, y=None, sample_weight=None):
    """Build the model, its compiled loss and its metrics as Model.fit does, on symbolic tensors.

    Keras' `Trainer._symbolic_build`: nothing runs on real samples (state a
    model's call() updates is not touched), and metrics that make their state at
    their first update (F1Score) get it. The optimizer is left unbuilt: the
    caller builds it over the variables it trains.

    Args:
        x, y, sample_weight: one batch (a few samples), structured as the model
            and its loss take them.
    """
    if not model.compiled and all(layer.built for layer in model._flatten_layers()):
        return  # Keras' predict builds nothing more for an uncompiled model
    had = "optimizer" in vars(model)
    optimizer = getattr(model, "optimizer", None)
    model.optimizer = None
    try:
        model._symbolic_build(data_batch=(x, y, sample_weight))
    finally:
        if had:
            model.optimizer = optimizer
        else:
            del model.optimizer


def input_names(functional):
    """The names of a functional model's inputs (their InputLayers'), in order."""
    return [t._keras_history.operation.name for t in functional.inputs]


def loss_tracker(model):
    """The compiled model's "loss" Mean, or None."""
    return model._loss_tracker


def has_compiled_loss(model):
    """Whether `model.compile` was given a loss."""
    return model._compile_loss is not None


def metrics_in_order(model, logs):
    """Model.evaluate's list form of `logs` (keras.Model._flatten_metrics_in_order)."""
    return model._flatten_metrics_in_order(logs)


# Every private attribute above, for the test that checks them on the installed Keras.
NAMES = {"keras.Model": ("_symbolic_build", "_flatten_metrics_in_order", "_flatten_layers"),
         "compiled model": ("_loss_tracker", "_compile_loss", "_compile_metrics"),
         "functional input": ("_keras_history",)}
