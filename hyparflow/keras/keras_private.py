"""Every private Keras name hyparflow relies on, behind one door
(tests/test_keras_private.py checks each on the installed Keras)."""

import json

import keras

# What a model may override to bring its own training logic, as Model.fit calls it.
STEP_METHODS = ("train_step", "test_step", "predict_step")
LOSS_METHODS = ("compute_loss", "compute_metrics")


def overridden(model, names=STEP_METHODS + LOSS_METHODS):
    """The methods of `names` that `model`'s class defines differently from keras.Model."""
    return [n for n in names if getattr(type(model), n, None) is not getattr(keras.Model, n)]


def compile_unbuilt(model):
    """Whether the compiled loss or metrics are still to be built (only predict ran)."""
    return any(c is not None and not c.built
               for c in (model._compile_loss, model._compile_metrics))


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
    built = all(layer.built for layer in model._flatten_layers())
    if not model.compiled and built:
        return  # Keras' predict builds nothing more for an uncompiled model
    if y is None and sample_weight is None and (
            model._compile_loss is not None or model._compile_metrics is not None):
        # predict on a compiled model: Keras builds the model alone (its loss and metrics
        # need targets; a model trained later builds them then)
        if not built:
            from keras.src import backend

            symbolic = keras.tree.map_structure(
                lambda v: keras.KerasTensor(v.shape, keras.backend.standardize_dtype(v.dtype)),
                x)
            backend.compute_output_spec(model, symbolic, training=False)
        return
    had = "optimizer" in vars(model)
    optimizer = getattr(model, "optimizer", None)
    model.optimizer = None
    try:
        if any(type(t).__name__ == "RaggedTensor" for t in keras.tree.flatten(y)):
            _build_for_ragged(model, x, y)
        else:
            model._symbolic_build(data_batch=(x, y, sample_weight))
    finally:
        if had:
            model.optimizer = optimizer
        else:
            del model.optimizer


def loss_tracker(model):
    """The compiled model's "loss" Mean, or None."""
    return model._loss_tracker


def output_loss_trackers(model):
    """The Means in which the compiled loss logs each output's loss (a model with several
    outputs; none before it is built)."""
    compiled = compiled_loss(model)
    return [] if compiled is None else [t for t in compiled.metrics if t is not None]


def has_compiled_loss(model):
    """Whether `model.compile` was given a loss."""
    return compiled_loss(model) is not None


def metrics_in_order(model, logs):
    """Model.evaluate's list form of `logs` (keras.Model._flatten_metrics_in_order)."""
    return model._flatten_metrics_in_order(logs)


def compiled_loss(model):
    """The model's CompileLoss (the loss given to `compile`), or None."""
    return model._compile_loss


def compile_call(model):
    """What stands for the model's last `compile` call (Keras makes it anew at every compile,
    whatever the arguments), or None before any."""
    return getattr(model, "_compile_config", None)


def compute_loss(model, x, y, y_pred, sample_weight, training, losses):
    """The model's `compute_loss` (its own, or Keras') as its train/test step calls it, with
    `model.losses` reading `losses` (a non-empty list) meanwhile.

    Keras' `_compute_loss` also calls an override written before compute_loss took
    `training`; `_losses_override` is what Keras' JAX trainer sets for the same purpose.
    """
    kept = model._losses_override
    model._losses_override = list(losses)
    try:
        return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                   training=training)
    finally:
        model._losses_override = kept


def loss_object(identifier, y_true, y_pred):
    """The keras.losses.Loss that `compile(loss=identifier)` makes for one output
    (keras.src.trainers.compile_utils.get_loss): a loss function is wrapped as Keras wraps it,
    which brings targets to the prediction's rank ((n,) for a (n, 1) output) before calling it,
    and "crossentropy" becomes the variant the data calls for."""
    from keras.src.trainers.compile_utils import get_loss

    return get_loss(identifier, y_true, y_pred)


def compiled_metrics(model):
    """The model's CompileMetrics (the metrics given to `compile`), or None."""
    return model._compile_metrics


def is_functional(model):
    """Whether `model` is a graph of layer calls (functional or Sequential)."""
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def nodes_by_depth(functional):
    """A functional model's layer-call nodes, by depth (the deepest, the inputs', first)."""
    return functional._nodes_by_depth


def inputs_struct(functional):
    """The structure (one tensor, list, dict) in which a functional model takes its inputs."""
    return functional._inputs_struct


def outputs_struct(functional):
    """The structure in which a functional model returns its outputs."""
    return functional._outputs_struct


def mask_of(tensor):
    """The mask Keras attached to a tensor (a layer's output, also a functional model's
    symbolic output), or None."""
    return getattr(tensor, "_keras_mask", None)


def _build_for_ragged(model, x, y):
    """`symbolic_build` for ragged targets: the model on symbolic inputs, then its compiled
    loss and metrics made for the targets' structure without calling them (Keras' symbolic
    build would call the loss on a dense stand-in of a ragged target, which a loss written
    for ragged targets cannot take; Model.fit builds them as its train step traces)."""
    from keras.src import backend

    def symbolic(v):
        return keras.KerasTensor(v.shape, keras.backend.standardize_dtype(v.dtype))

    y_pred = backend.compute_output_spec(model, keras.tree.map_structure(symbolic, x),
                                         training=False)
    y_true = keras.tree.map_structure(symbolic, y)
    for compiled in (model._compile_loss, model._compile_metrics):
        if compiled is not None and not compiled.built:
            compiled.build(y_true, y_pred)


def all_layers(model):
    """`model`'s layers, those of nested models included, each once."""
    return list(model._flatten_layers(include_self=False))


def batch_norm_axes(layer):
    """The axes a BatchNormalization layer reduces its moments over."""
    return layer._reduction_axes


def batch_norm_moments(layer, inputs, mask):
    """A BatchNormalization layer's moments of `inputs` as its call computes them in
    training (synchronized ones summed over tf.distribute's replicas, if any)."""
    return layer._moments(inputs, mask)


def set_mask(tensor, mask):
    """Attach a Keras mask to a (backend) tensor, as a layer's call does."""
    tensor._keras_mask = mask


def producer_name(tensor):
    """The name of the layer (an InputLayer for a model input) that made a Keras tensor."""
    return tensor._keras_history.operation.name


def producing_node(tensor):
    """The Keras node (a layer's or an op's call) that made a Keras tensor, or None (one
    made otherwise, or not a Keras tensor)."""
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return None
    nodes = history.operation._inbound_nodes
    return nodes[history.node_index] if history.node_index < len(nodes) else None


def input_names(functional):
    """The names of a functional model's inputs (their InputLayers'), in order."""
    return [producer_name(t) for t in functional.inputs]


def class_weight_to_sample_weights(y, class_weight):
    """Keras' class weights → one weight per sample of `y`, as Model.fit turns them."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


def class_weight_map_fn(class_weight):
    """Keras' map of a tf.data element adding class weights as sample weights."""
    from keras.src.trainers.data_adapters import tf_dataset_adapter

    return tf_dataset_adapter.make_class_weight_map_fn(class_weight)


def is_tf_dataset(x):
    """Whether `x` is a tf.data.Dataset (as Keras' data adapters tell)."""
    from keras.src.trainers.data_adapters import is_tf_dataset as tell

    return tell(x)


def ragged_concat(arrays):
    """Model.predict's join of its batches' outputs (numpy arrays, or a ragged model output's
    tf.RaggedTensors): one array when they differ only in their number of samples, else
    Keras' tf.RaggedTensor (a sequence model's outputs of batches of different lengths)."""
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    joined = trainer.potentially_ragged_concat([
        a if isinstance(a, (tf.RaggedTensor, tf.SparseTensor)) else tf.convert_to_tensor(a)
        for a in arrays])
    return trainer.convert_to_np_if_not_ragged(joined)


def random_seed():
    """The seed given to keras.utils.set_random_seed, or None."""
    from keras.src.utils import rng_utils

    return rng_utils.get_random_seed()


def learning_rate_attribute(optimizer):
    """The optimizer's learning rate as given (a float, schedule or callable; Keras keeps a
    Variable for floats)."""
    return optimizer._learning_rate


def set_learning_rate_attribute(optimizer, rate):
    optimizer._learning_rate = rate


def redirect_checkpoint_saves(callback, save):
    """Make a ModelCheckpoint call `save(filepath, weights_only)` where it would save."""

    def save_model(epoch, batch, logs):
        filepath = callback._get_file_path(epoch, batch, logs)
        if callback._should_save_model(epoch, batch, logs, filepath):
            save(filepath, callback.save_weights_only)

    callback._save_model = save_model


def redirect_backup_saves(callback, save):
    """Make a BackupAndRestore call `save(filepath)` where it would write its backup."""
    callback._save_model = lambda: save(callback._weights_path)


def undo_redirected_saves(callback):
    """A ModelCheckpoint's or BackupAndRestore's own saves again (undo `redirect_*_saves`)."""
    callback.__dict__.pop("_save_model", None)


def save_backup(callback, epoch, step, writes, extra):
    """Make a BackupAndRestore write its backup now, as after `step` of `epoch` (its save every
    few batches), adding `extra` to its metadata on the rank that `writes` it."""
    callback._current_epoch, callback._last_batch_seen = epoch, step
    callback._save_model()
    if writes:
        path = callback._training_metadata_path
        with open(path) as f:
            meta = json.load(f)
        with open(path, "w") as f:
            json.dump({**meta, **extra}, f)


def backup_metadata_path(callback):
    """Where a BackupAndRestore keeps its epoch (and our steps) beside the weights."""
    return callback._training_metadata_path


def save_checkpoint(callback, epoch, step, logs):
    """Make a ModelCheckpoint save now, as after `step` of `epoch` (save_best_only still
    compares)."""
    callback._save_model(epoch=epoch, batch=step, logs=logs)


def checkpoint_path(callback, epoch, step, logs):
    """The file a ModelCheckpoint writes after `step` of `epoch`."""
    return callback._get_file_path(epoch, step, logs)


def seed_generators(model):
    """Every keras.random.SeedGenerator of `model` and its layers (Dropout's, a preprocessing
    layer's, one a model keeps for its own train_step), each once."""
    found, seen = [], set()
    for layer in [model] + list(model._flatten_layers(include_self=False)):
        for generator in getattr(layer, "_seed_generators", ()):
            if id(generator) not in seen:
                seen.add(id(generator))
                found.append(generator)
    return found


def sequential_graph(model):
    """The functional graph a built Sequential keeps, or None (not built from an input
    shape)."""
    return model._functional


def distribute_strategy(model):
    """The tf.distribute strategy `model` was built under, or None."""
    return model._distribute_strategy


def restored_epoch(model):
    """The epoch a BackupAndRestore callback set `model` to resume from, or None."""
    return model._initial_epoch


def forget_restored_epoch(model):
    """Forget the epoch an earlier call's BackupAndRestore set `model` to resume from (Keras
    keeps it: the model's next fit would start there too)."""
    model._initial_epoch = None


def as_outputs(functional, tensors):
    """Flat list of per-output tensors → the structure of the model's outputs (`functional`:
    the model's graph; None for a subclassed model: one tensor, or a list)."""
    if functional is None:
        return tensors[0] if len(tensors) == 1 else list(tensors)
    return keras.tree.pack_sequence_as(outputs_struct(functional), list(tensors))


# Every private attribute above, for the test that checks them on the installed Keras.
NAMES = {"keras.Model": ("_symbolic_build", "_flatten_metrics_in_order", "_flatten_layers",
                         "_compute_loss"),
         "compiled model": ("_loss_tracker", "_compile_loss", "_compile_metrics",
                            "_losses_override", "_compile_config", "_initial_epoch",
                            "_distribute_strategy"),
         "functional model": ("_nodes_by_depth", "_inputs_struct", "_outputs_struct"),
         "functional input": ("_keras_history",),
         "masked output": ("_keras_mask",),
         "layer": ("_seed_generators", "_inbound_nodes"),
         "keras.Sequential": ("_functional",),
         "BatchNormalization": ("_reduction_axes", "_moments"),
         "optimizer": ("_learning_rate",),
         "keras.callbacks.ModelCheckpoint": ("_get_file_path", "_should_save_model",
                                             "_save_model"),
         "keras.callbacks.BackupAndRestore": ("_save_model",),
         "BackupAndRestore": ("_weights_path", "_training_metadata_path", "_current_epoch",
                              "_last_batch_seen")}
# Private modules, imported by the functions above: each must import.
MODULES = ("keras.src.models.functional", "keras.src.trainers.compile_utils",
           "keras.src.trainers.data_adapters",
           "keras.src.trainers.data_adapters.data_adapter_utils",
           "keras.src.trainers.data_adapters.tf_dataset_adapter", "keras.src.utils.rng_utils",
           "keras.src.backend", "keras.src.backend.tensorflow.trainer")
