"""BatchNormalization trained as model.fit trains it over micro-batches and replicas: moving
statistics updated once a step from the moments pooled over the step's micro-batches
(torchgpipe's deferred batch norm), and a synchronized layer's moments summed over the
stage's replicas (as Keras' strategies sum them)."""

import contextlib
import types
import weakref

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from hyparflow.keras import keras_private
from hyparflow.mpi import comm as comm_


def of(models):
    """The BatchNormalization layers of `models` (nested ones included), each once."""
    found = {}
    for model in models:
        for layer in keras_private.all_layers(model):
            if isinstance(layer, keras.layers.BatchNormalization):
                found.setdefault(id(layer), layer)
    return list(found.values())


def refusal(layers, m, R):
    """The ValueError for a layer these rules cannot train as model.fit does, or None:
    BatchNormalization(renorm=True) at m > 1 (its moving statistics go with its own
    corrections, per micro-batch), or synchronized over R > 1 replicas."""
    renorm = [layer.name for layer in layers if layer.renorm and layer.trainable]
    if renorm and (m is None or m > 1):
        return ValueError(
            f"microbatches={m}: BatchNormalization layer(s) {', '.join(renorm)} use "
            "renorm=True, whose moving statistics and corrections hyparflow cannot pool over "
            "a step's micro-batches as model.fit computes them over the batch. Use "
            "microbatches=1, or renorm=False.")
    synced = [layer.name for layer in layers
              if layer.renorm and layer.trainable and layer.synchronized]
    if synced and R > 1:
        return ValueError(
            f"replicas={R}: synchronized BatchNormalization layer(s) {', '.join(synced)} use "
            "renorm=True, whose corrections hyparflow does not sum over replicas. Use "
            "renorm=False, or synchronized=False.")
    return None


def synced(layers, R):
    """The names of `layers` whose moments are summed over R > 1 replicas (`Norms`)."""
    return [layer.name for layer in layers if layer.synchronized and layer.trainable] \
        if R > 1 else []


def too_few(names, size, R):
    """The ValueError for a batch of `size` samples that leaves replicas without samples
    while synchronized layers `names` sum their moments over R replicas, or None: the
    replicas sum micro-batch by micro-batch, and one without samples would have none to
    sum (hyparflow gives every replica with samples the same number of micro-batches)."""
    if not names or size >= R:
        return None
    left = f"replica {size}" if size == R - 1 else f"replicas {size}..{R - 1}"
    return ValueError(
        f"replicas={R}: a batch of {size} sample{'s' * (size != 1)} leaves {left} "
        f"without samples, and synchronized BatchNormalization layer(s) "
        f"{', '.join(names)} sum their moments over every replica. Give every batch at "
        f"least {R} samples (batch_size ≥ {R}, and a last batch of ≥ {R}: drop the "
        "remainder, e.g. dataset.batch(..., drop_remainder=True)), or use "
        "synchronized=False.")


class Norms:
    """The BatchNormalization layers of the stages a rank holds, and while `training`, their
    training calls: each micro-batch normalizes by its own moments (a synchronized layer's
    summed over `replicas`, the stage's communicator of replicas, when it has several); with
    several micro-batches a step they go to the step's pool (`state`) and `apply` updates
    the moving statistics once from it, as model.fit does once a step from the whole
    batch's moments; with one, each call updates them, as Keras' does."""

    def __init__(self, layers, replicas=None, wait=None):
        self.layers = layers
        synced = replicas is not None and replicas.Get_size() > 1 and any(
            layer.synchronized for layer in layers)
        # (a communicator of their own: their sums never meet the stage's other messages)
        self.replicas = comm_.dup(replicas) if synced else None
        self.wait = wait
        self.pools = {id(layer): _Pool(layer) for layer in layers}
        self._apply = tf.function(self._apply_fn) if layers else None
        self._last = weakref.WeakKeyDictionary()  # graph → its last sum over the replicas
        self.deferred = False  # while training with several micro-batches a step

    def state(self, model):
        """The pool's variables of `model`'s layers (recomputation restores them as it
        restores the layers' own state)."""
        return [v for layer in of([model]) for v in self.pools[id(layer)].variables]

    @contextlib.contextmanager
    def training(self, deferred):
        """The layers' training calls as `Norms` describes, while inside (hf.fit), `deferred`
        with several micro-batches a step: put on the user's layers (when deferred, or to sum
        a synchronized layer's moments over replicas) and taken off again (a function traced
        inside keeps them)."""
        if not self.layers or not (deferred or self.replicas is not None):
            yield
            return
        for layer in self.layers:
            layer.__dict__["call"] = types.MethodType(self._call_fn(layer), layer)
        self.deferred = deferred
        try:
            yield
        finally:
            self.deferred = False
            for layer in self.layers:
                layer.__dict__.pop("call", None)

    def apply(self):
        """Update every layer's moving statistics from its pool, once (after a step)."""
        if self.deferred and self._apply is not None:
            self._apply()

    def _apply_fn(self):
        for layer in self.layers:
            self.pools[id(layer)].apply()

    def _call_fn(self, layer):
        original = type(layer).call
        pool = self.pools[id(layer)]

        def call(self_, inputs, training=None, mask=None):
            if not (training and self_.trainable) or self_.renorm:  # (renorm: `refusal`)
                return original(self_, inputs, training=training, mask=mask)
            # BatchNormalization.call's training branch, its moving statistics left alone
            if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
                return original(self_, inputs, training=training, mask=mask)  # (its error)
            compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
            inputs = ops.cast(inputs, compute_dtype)
            gamma = ops.cast(self_.gamma, inputs.dtype) if self_.scale else None
            beta = ops.cast(self_.beta, inputs.dtype) if self_.center else None
            if self_.synchronized and mask is None and self.replicas is not None:
                mean, variance, count = self._synced_moments(self_, inputs)
            else:
                mean, variance = keras_private.batch_norm_moments(self_, inputs, mask)
                count = _count(self_, inputs, mask)
            if self.deferred:
                pool.add(count, mean, variance)
            else:  # as BatchNormalization.call updates them
                pool.update(mean, variance)
            outputs = ops.batch_normalization(x=inputs, mean=mean, variance=variance,
                                              axis=self_.axis, offset=beta, scale=gamma,
                                              epsilon=self_.epsilon)
            return ops.cast(outputs, self_.compute_dtype)

        return call

    def _synced_moments(self, layer, x):
        """Keras' synchronized moments (`_compute_moments_sync`), the sums over the stage's
        replicas: (mean, variance, samples counted)."""
        axes = keras_private.batch_norm_axes(layer)
        need_cast = x.dtype in (tf.float16, tf.bfloat16)
        if need_cast:
            x = tf.cast(x, tf.float32)
        local_sum = tf.reduce_sum(x, axis=axes, keepdims=True)
        local_squared_sum = tf.reduce_sum(tf.square(x), axis=axes, keepdims=True)
        local_count = tf.reduce_sum(tf.ones_like(x, name="count"), axis=axes, keepdims=True)
        y_sum, y_squared_sum, count_sum = self._summed(
            [local_sum, local_squared_sum, local_count])
        mean = tf.math.divide_no_nan(y_sum, count_sum)
        y_squared_mean = tf.math.divide_no_nan(y_squared_sum, count_sum)
        variance = tf.maximum(y_squared_mean - tf.square(mean), 0.0)
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
        count = tf.reshape(count_sum, [-1])[0]
        if need_cast:
            mean = tf.cast(tf.clip_by_value(mean, tf.float16.min, tf.float16.max), x.dtype)
            variance = tf.cast(tf.clip_by_value(variance, tf.float16.min, tf.float16.max),
                               x.dtype)
        return mean, variance, count

    def _summed(self, tensors):
        """`tensors` summed over the stage's replicas, differentiably (the gradient of a sum
        over replicas is the sum of the gradients), each sum after the previous one in the
        traced function: every replica sums the same tensors in the same order, however
        TensorFlow orders the ops."""
        graph = tf.compat.v1.get_default_graph()

        def chained(values):
            previous = self._last.get(graph)
            with tf.control_dependencies([previous] if previous is not None else []):
                flat = tf.concat([tf.reshape(v, [-1]) for v in values], 0)
                total = tf.py_function(self._sum, [flat], flat.dtype)
            total.set_shape(flat.shape)
            self._last[graph] = total
            out, offset = [], 0
            for v in values:
                n = int(np.prod(v.shape))
                out.append(tf.reshape(total[offset:offset + n], tf.shape(v)))
                offset += n
            return out

        @tf.custom_gradient
        def summed(*values):
            def grad(*upstream):
                return chained([tf.zeros_like(v) if u is None else u
                                for u, v in zip(upstream, values)])
            return chained(list(values)), grad

        return summed(*tensors)

    def _sum(self, flat):
        (total,) = comm_.allreduce_sum([flat.numpy()], self.replicas, self.wait)
        return total


def _count(layer, x, mask):
    """The samples each moment of a micro-batch counts (the unmasked ones with a mask)."""
    axes = keras_private.batch_norm_axes(layer)
    if mask is None:
        shape = tf.shape(x)
        return tf.cast(tf.reduce_prod(tf.gather(shape, axes)), tf.float64)
    weights = ops.broadcast_to(ops.expand_dims(mask, axis=-1), ops.shape(x))
    return tf.reduce_sum(tf.cast(weights, tf.float64)) / tf.cast(
        tf.reduce_prod(tf.gather(tf.shape(x), [a for a in range(len(x.shape))
                                                if a not in axes])), tf.float64)


class _Pool:
    """One layer's moments of a step's micro-batches, pooled as they come (Chan's parallel
    variance: the whole batch's mean and variance, without cancellation), in float64."""

    def __init__(self, layer):
        self.layer = layer
        shape = layer.moving_mean.shape
        self.count = tf.Variable(tf.zeros((), tf.float64), trainable=False)
        self.mean = tf.Variable(tf.zeros(shape, tf.float64), trainable=False)
        self.m2 = tf.Variable(tf.zeros(shape, tf.float64), trainable=False)
        self.variables = [self.count, self.mean, self.m2]

    def add(self, count, mean, variance):
        n_b = tf.cast(count, tf.float64)
        mean_b = tf.cast(tf.reshape(mean, self.mean.shape), tf.float64)
        var_b = tf.cast(tf.reshape(variance, self.m2.shape), tf.float64)
        n_a = self.count.read_value()
        n = n_a + n_b
        delta = mean_b - self.mean.read_value()
        self.mean.assign_add(delta * tf.math.divide_no_nan(n_b, n))
        self.m2.assign_add(var_b * n_b + tf.square(delta) * tf.math.divide_no_nan(n_a * n_b, n))
        self.count.assign(n)

    def update(self, mean, variance, seen=None):
        """The moving statistics moved once toward `mean` and `variance`, as
        BatchNormalization.call moves them (`seen`, a boolean tensor: only where it holds)."""
        layer = self.layer
        for moving, value in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
            current = ops.cast(moving, value.dtype)
            moved = current * layer.momentum + value * (1.0 - layer.momentum)
            moving.assign(ops.cast(moved if seen is None else tf.where(seen, moved, current),
                                   moving.dtype))

    def apply(self):
        """The moving statistics updated once from the pool (if it holds a sample), which is
        then emptied."""
        dtype = self.layer.moving_mean.dtype
        self.update(tf.cast(self.mean, dtype),
                    tf.cast(tf.math.divide_no_nan(self.m2, self.count), dtype),
                    seen=self.count > 0)
        for v in self.variables:
            v.assign(tf.zeros_like(v))
