"""Each stage's own copy of the user's optimizer:
its state taken from the user's before training, given back after.

A stage of a pipeline (P > 1) applies its updates with a copy of `model.optimizer`
built over the stage's variables only, so a rank holds optimizer slots for its
own stage; with one stage, the stage is the whole model and steps with the
user's optimizer itself. The
user's optimizer stays what Keras would have after `model.fit`: when `hf.fit`
returns it is built over all the model's trainable variables and holds every
stage's slots, the step count and the loss scale, on every rank, so that
`model.fit`, `model.save` or `hf.fit` at another P × R continue from it.
Slots are matched by name: Keras names a slot of a variable
``<variable path with _ for />_<slot>``, the same whatever else the optimizer
was built over.
"""

import numpy as np
import tensorflow as tf

from hyparflow.keras import keras_private
from hyparflow.keras import variables as variables_
from hyparflow.mpi import comm as comm_


def stage_copy(optimizer, variables, clip_here=True):
    """A new optimizer configured as `optimizer`, built over `variables` (None for None).

    With `clip_here` False, the copy does not clip by `global_clipnorm`: the norm
    over its own variables is not the model's (`clip_by_global_norm` clips for it).
    """
    if optimizer is None:
        return None
    copy = copy_of(optimizer)
    if not clip_here:
        updating(copy).global_clipnorm = None
    copy.build(list(variables))
    return copy


def copy_of(optimizer):
    """A new, unbuilt optimizer that updates as `optimizer` does.

    Made from its config, with what the config leaves out: a learning-rate schedule
    or callable is shared (it is not serialisable if it is a lambda, and is
    stateless), a LossScaleOptimizer gets a copy of its inner optimizer, and the
    variables excluded from weight decay (`exclude_from_weight_decay`) stay
    excluded.

    Raises:
        ValueError: the optimizer cannot be rebuilt from its config (a subclass whose
            `get_config` misses an `__init__` argument), naming the way out.
    """
    import keras

    try:
        inner = getattr(optimizer, "inner_optimizer", None)
        if inner is not None:
            config = optimizer.get_config()
            config.pop("inner_optimizer")
            copy = optimizer.__class__(copy_of(inner), **config)
        else:
            rate = keras_private.learning_rate_attribute(optimizer)
            shared = rate is not None and not isinstance(rate, keras.Variable)
            if shared:  # Keras would serialise it (a lambda cannot be); the copy shares it
                keras_private.set_learning_rate_attribute(optimizer, 0.0)
            try:
                config = optimizer.get_config()
            finally:
                if shared:
                    keras_private.set_learning_rate_attribute(optimizer, rate)
            if shared:
                config["learning_rate"] = rate
            copy = optimizer.__class__.from_config(config)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(
            f"model.optimizer ({type(optimizer).__name__}) cannot be rebuilt from its config "
            f"({type(exc).__name__}: {exc}). With partitions > 1 every stage steps with a copy "
            "made by from_config(get_config()): make get_config return every __init__ "
            "argument, or use partitions=1.") from None
    for name, value in vars(optimizer).items():
        if name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
            setattr(copy, name, value)
    return copy


def updating(optimizer):
    """The optimizer that clips and updates: a LossScaleOptimizer's inner one, else itself."""
    return getattr(optimizer, "inner_optimizer", None) or optimizer


def global_clipnorm(optimizer):
    """The optimizer's (or a LossScaleOptimizer's inner optimizer's) global_clipnorm, or None."""
    if optimizer is None:
        return None
    return getattr(updating(optimizer), "global_clipnorm", None) or None


def clip_by_global_norm(grads, positions, total, clip_norm, divide_by, pipeline, wait):
    """`grads` clipped by the norm of every stage's gradients, as Keras' clip_by_global_norm.

    Keras sums the squared norm of each variable's gradient, stacked in the model's
    variable order; so does this: each stage computes its variables' squared norms
    (of the gradients divided by the loss scale, which Keras divides out before it
    clips), places them at their `positions` among the model's `total` trainable
    variables, and one sum-allreduce over the pipeline fills the rest (every entry
    comes from one stage: adding zeros keeps it exact). A variable without a
    gradient is left out, as Keras leaves out None. The same ops as Keras', on the
    same kinds of values (an IndexedSlices gradient included).

    Args:
        grads: this stage's gradients (arrays, tensors, IndexedSlices or None),
            summed over replicas.
        divide_by: the loss scale the gradients carry (a number or variable), or None.
    """
    from keras import ops

    grads = [_tensor(g) for g in grads]
    squared = np.zeros(2 * total, np.float32)
    for g, k in zip(grads, positions):  # (k None: another stage counts this weight)
        if g is not None and k is not None:
            if divide_by is not None:
                g = _map_values(g, lambda v: v / divide_by)
            squared[k] = np.asarray(ops.cast(ops.sum(ops.square(g)), "float32"))
            squared[total + k] = 1.0
    if pipeline is not None and pipeline.Get_size() > 1:
        comm_.allreduce(squared, pipeline, "sum", wait)
    present = [ops.convert_to_tensor(squared[k]) for k in range(total) if squared[total + k]]
    if not present:
        return grads
    use_norm = ops.sqrt(ops.sum(ops.stack(present)))
    scale = clip_norm * ops.minimum(1.0 / use_norm, 1.0 / clip_norm)
    scale = scale + (use_norm - use_norm)  # NaN for a non-finite norm, as in Keras
    return [None if g is None else g * scale for g in grads]


def _tensor(g):
    """A gradient as a tensor (numpy arrays converted; IndexedSlices and None kept)."""
    if g is None or isinstance(g, tf.IndexedSlices):
        return g
    return tf.convert_to_tensor(g)


def _map_values(g, f):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(f(g.values), g.indices, g.dense_shape)
    return f(g)


def loss_scaled(optimizer):
    """Whether `optimizer` scales the loss dynamically and skips steps with non-finite gradients."""
    import keras

    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and \
        getattr(optimizer, "dynamic_scale", None) is not None


def _by_name(optimizer):
    """{name: variable} of an optimizer's variables; raises if two share a name.

    A LossScaleOptimizer's own variables keep their names, its inner optimizer's
    get an "inner/" prefix (both have an 'iteration').
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    inner_ids = {id(v) for v in inner.variables} if inner is not None else set()
    out = {}
    for v in optimizer.variables:
        name = ("inner/" if id(v) in inner_ids else "") + v.name
        if name in out:
            raise ValueError(
                f"model.optimizer has two variables named {v.name!r}: two of the model's "
                "variables have the same path (layers with equal names in different nested "
                "models), so hyparflow cannot tell their optimizer slots apart. Give those "
                "layers distinct names.")
        out[name] = v
    return out


def take_state(stage_optimizer, user_optimizer):
    """Set the stage optimizer's slots, step count and scalars from the user's, by name.

    A user optimizer that was never built (a fresh model) has no state to give:
    the stage optimizer keeps its fresh state.
    """
    if stage_optimizer is None or user_optimizer is None or not user_optimizer.built \
            or stage_optimizer is user_optimizer:
        return
    _assign_by_name(stage_optimizer, _by_name(user_optimizer))


def _assign_by_name(optimizer, values):
    """Set each of `optimizer`'s variables to the value (an array or a variable) of its name in
    `values`, where there is one of its shape."""
    pairs = [(v, values[name]) for name, v in _by_name(optimizer).items()
             if name in values and tuple(np.shape(values[name])) == tuple(v.shape)]
    variables_.assign([v for v, _ in pairs], [value for _, value in pairs])


def stage_state(stage_optimizer):
    """{name: array} of every variable of the stage optimizer (slots, step count, scalars)."""
    if stage_optimizer is None:
        return {}
    return {name: variables_.value(v) for name, v in _by_name(stage_optimizer).items()}


def give_state(user_optimizer, model_variables, states, own):
    """Build the user's optimizer over `model_variables` if needed and load the gathered state.

    Args:
        states: every stage's `stage_state`, in stage order.
        own: this rank's stage (whose scalars, e.g. a learning rate a callback set,
            win; every stage holds the same ones).
    """
    if user_optimizer is None:
        return
    if not user_optimizer.built:
        user_optimizer.build(list(model_variables))
    merged = {}
    for s, state in enumerate(states):
        if s != own:
            merged.update(state)
    merged.update(states[own])
    _assign_by_name(user_optimizer, merged)


def gather_into_user(trainer):
    """Collective over the pipeline: every rank's `model.optimizer` gets every stage's state."""
    optimizer = trainer.executor.optimizer
    user = trainer.user_optimizer
    if optimizer is None or user is None or optimizer is user:
        return
    pipeline = trainer.executor.pipeline
    state = trainer.executor.optimizer_state(
        wait=trainer.guard.bounded("the optimizer state of every replica's share"))
    if pipeline is None or pipeline.Get_size() == 1:
        states, own = [state], 0
    else:
        states = comm_.allgather_objects(
            state, pipeline, wait=trainer.guard.bounded("the optimizer state of every stage"))
        own = trainer.topology.stage
    give_state(user, trainer.model.trainable_variables, states, own)


# The least magnitude float16 rounds to inf (its largest finite value is 65504).
HALF_LIMIT = 65520.0


def beyond_half(grads, half):
    """Whether a gradient that Keras computes as one float16 sum over the whole batch
    (`half`, per gradient: `StageWorker.in_half`) holds a value float16 cannot.

    hyparflow sums such a gradient's parts (micro-batches, replicas) in float32, where
    each part may be finite although Keras' whole sum was inf: Keras' loss scale
    optimizer then skips the step, and so must hyparflow.
    """
    def beyond(g):
        g = np.asarray(g)
        return g.size > 0 and max(g.max(), -g.min()) >= HALF_LIMIT  # no |g| copy

    return any(h and g is not None and not isinstance(g, tf.IndexedSlices) and beyond(g)
               for g, h in zip(grads, half))


def agreed_finite(grads, pipeline, wait, beyond=False):
    """Whether every stage's gradients are finite (collective over the pipeline).

    The gradients are already summed over replicas, so a non-finite value on any
    replica shows on every one; one max-allreduce of a flag over the stages gives
    every rank the same verdict. `beyond`: this rank's gradients hold a value that
    would have been inf in Keras (`beyond_half`).
    """
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
    bad = np.array([0 if not beyond and all(np.isfinite(v).all() for v in values) else 1],
                   np.int64)
    if pipeline is not None and pipeline.Get_size() > 1:
        comm_.allreduce(bad, pipeline, "max", wait)
    return not bad[0]


def poisoned(grads):
    """`grads` with the first gradient made NaN: the LossScaleOptimizer then skips the step
    and lowers its scale, as it would if this stage's own gradients had overflowed."""
    out = list(grads)
    for k, g in enumerate(out):
        if g is not None:
            out[k] = _map_values(_tensor(g), lambda v: tf.fill(tf.shape(v), np.nan))
            return out
    return out


def step_without_variables(optimizer, finite):
    """What the optimizer's step does to its own state on a stage with no variables.

    The step count advances with every applied step (as on the other stages), and
    a LossScaleOptimizer's scale follows the agreed verdict (its loss scale is
    what this stage's partial errors are scaled by).
    """
    if optimizer is None:
        return
    if loss_scaled(optimizer):
        if finite:
            if int(optimizer.step_counter.numpy()) == optimizer.dynamic_growth_steps - 1:
                optimizer.step_counter.assign(0)
                optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 2.0)
            else:
                optimizer.step_counter.assign_add(1)
        else:
            optimizer.step_counter.assign(0)
            optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
    if finite:
        optimizer.iterations.assign_add(1)


def finalizes(optimizer):
    """Whether `finalize` may change the variables: the optimizer keeps moving averages (EMA),
    or finalizes in code of its own."""
    import keras

    inner = updating(optimizer)
    return inner is not None and (bool(getattr(inner, "use_ema", False)) or (
        type(inner).finalize_variable_values
        is not keras.optimizers.Optimizer.finalize_variable_values))


def finalize(optimizer, variables):
    """Model.fit's end of training: with EMA, the variables take their moving averages."""
    if optimizer is not None and variables:
        optimizer.finalize_variable_values(list(variables))


def compiled_apply(optimizer, variables):
    """`optimizer`'s update of `variables` as one compiled function of their gradients (a
    list, in their order), the optimizer built over them first if it is not yet."""
    variables = list(variables)
    if not optimizer.built:
        optimizer.build(variables)
    return tf.function(lambda gs: optimizer.apply(gs, variables), reduce_retracing=True)


def as_tensors(grads):
    """Gradients for `optimizer.apply`: tensors, IndexedSlices kept sparse, None kept."""
    return [_tensor(g) for g in grads]
