"""Models with their own training logic,
as Keras users write them (shared by the 1-rank and MPI tests).

Every builder takes no argument and returns a compiled model; `twins` builds two
with the same initial weights, one for model.fit and one for hf.fit. Optimizers
are SGD with momentum, so that hf.fit must agree to float32 rounding.
"""

import keras
import numpy as np
from keras import ops

SAMPLES, BATCH = 64, 16
RTOL, ATOL = 1e-5, 1e-6  # SGD with momentum: hf.fit must agree to float32 rounding


def same_weights(ref, model, what=""):
    """`model`'s weights equal `ref`'s (model.fit's) to float32 rounding."""
    for u, v, w in zip(ref.get_weights(), model.get_weights(), ref.weights):
        np.testing.assert_allclose(v, u, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {w.path}")


def same_history(ha, hb, what=""):
    """Two Histories (model.fit's, hf.fit's) with the same keys and values."""
    assert sorted(ha.history) == sorted(hb.history), (what, sorted(ha.history),
                                                      sorted(hb.history))
    for k in ha.history:
        np.testing.assert_allclose(hb.history[k], ha.history[k], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: {k}")


def data(n=SAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, size=n)


def _body(x):
    h = keras.layers.Dense(12, activation="tanh", name="frozen")(x)
    h = keras.layers.Dense(12, activation="tanh", name="mid")(h)
    h = keras.layers.Dense(12, activation="tanh", name="top")(h)
    return keras.layers.Dense(3, activation="softmax", name="probs")(h)


class HeadOnly(keras.Model):
    """A train_step that trains every layer but the first (partial freezing by hand)."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        trained = [v for v in self.trainable_variables if not v.path.startswith("frozen")]
        grads = tape.gradient(loss, trained)
        self.optimizer.apply_gradients(zip(grads, trained))
        self._loss_tracker.update_state(loss, sample_weight=ops.shape(x)[0])
        return self.compute_metrics(x, y, y_pred)


class Penalised(keras.Model):
    """compute_loss adds a penalty on the predictions' squares; compute_metrics a metric."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.custom = keras.metrics.Mean(name="custom")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.5 * ops.mean(ops.square(y_pred))

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        self.custom.update_state(ops.max(y_pred, axis=-1))
        logs["custom"] = self.custom.result()
        return logs


class OnInputs(keras.Model):
    """compute_loss reads x (the distance of the predictions to a function of the inputs, as an
    autoencoder's reconstruction loss) and adds self.losses: trains from x alone."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        target = ops.softmax(x[:, :3])
        return ops.mean(ops.square(y_pred - target)) + ops.sum(self.losses)


class Ignoring(keras.Model):
    """compute_loss of its own that leaves self.losses (the regularizers) out."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return ops.mean(keras.losses.sparse_categorical_crossentropy(y, y_pred))


class Halved(keras.Model):
    """compute_loss that counts self.losses half."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss - 0.5 * ops.sum(self.losses)


class OddMetrics(keras.Model):
    """compute_metrics returning a value of no metric (a mean over the batch: at P = 1 combined
    over replicas by their shares; at P > 1, refused)."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return {"top": ops.mean(ops.max(y_pred, axis=-1))}


class Tracked(keras.Model):
    """compute_loss updating metrics of its own with the whole loss (the regularizers of
    every stage included): weighted by the batch's samples as Keras' own loss tracker is, and
    once per call as Keras' guides do (a batch cut into pieces of unequal sizes must still
    count once)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.total = keras.metrics.Mean(name="total")
        self.plain = keras.metrics.Mean(name="plain")
        self.summed = keras.metrics.Sum(name="summed")

    @property
    def metrics(self):
        """Its own metrics only, as Keras' guides list them: the logs hold these and no "loss"."""
        return [self.total, self.plain, self.summed]

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        self.total.update_state(loss, sample_weight=ops.shape(y_pred)[0])
        self.plain.update_state(loss)
        self.summed.update_state(loss)
        return loss


class Side(keras.layers.Layer):
    """Passes its input through; adds a loss on a weight of its own, which nothing else reads
    (a compute_loss leaving self.losses out gives it no gradient: weight decay leaves it)."""

    def build(self, shape):
        self.side = self.add_weight(shape=(3,), initializer="ones", name="side")

    def call(self, x):
        self.add_loss(0.01 * ops.sum(ops.square(self.side)))
        return x


def _regularized(x):
    """Four Dense layers, the first with a kernel and an activity regularizer, then a `Side`
    (their losses live on the first stage)."""
    h = keras.layers.Dense(12, activation="tanh", name="first",
                           kernel_regularizer=keras.regularizers.L2(0.01),
                           activity_regularizer=keras.regularizers.L2(0.001))(x)
    h = Side(name="side")(h)
    h = keras.layers.Dense(12, activation="tanh", name="second")(h)
    h = keras.layers.Dense(12, activation="tanh", name="third")(h)
    return keras.layers.Dense(3, activation="softmax", name="probs")(h)


# Models whose loss is their own code's, on regularized layers: what hf.fit is called with.
LOSS_KINDS = {"on_inputs": "x", "ignoring": "xy", "add_loss_only": "x", "halved": "xy",
              "tracked": "xy"}
# Models refused at P > 1: compute_metrics returns a value of no metric; no loss at all.
REFUSED_KINDS = ("odd_metrics", "no_loss")


class Steps(keras.Model):
    """test_step and predict_step of its own: a custom evaluation, a dict of predictions."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.compiled_loss_value = self.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
        self._loss_tracker.update_state(self.compiled_loss_value,
                                        sample_weight=ops.shape(x)[0])
        logs = self.compute_metrics(x, y, y_pred)
        logs["mean_prediction"] = ops.mean(y_pred)
        return logs

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        y_pred = self(x, training=False)
        return {"probs": y_pred, "top": ops.argmax(y_pred, axis=-1)}


class Gan(keras.Model):
    """GAN-style: a critic and a generator, each with its own optimizer, two updates per step,
    the gradients clipped by hand before they are applied (as GAN code often does) and their
    norm logged: both must see the whole batch's gradients, as in model.fit.

    The "noise" is a function of x, so that the samples of a batch decide the step
    whichever replica reads them.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, "tanh"),
                                           keras.layers.Dense(6)], name="generator")
        self.critic = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, "tanh"),
                                        keras.layers.Dense(1)], name="critic")
        self.c_tracker = keras.metrics.Mean(name="c_loss")
        self.g_tracker = keras.metrics.Mean(name="g_loss")

    def call(self, x):
        return self.critic(self.generator(x))

    def compile(self, c_optimizer, g_optimizer):
        super().compile()
        self.c_optimizer, self.g_optimizer = c_optimizer, g_optimizer

    def train_step(self, data):
        import tensorflow as tf

        real = data[0] if isinstance(data, tuple) else data
        noise = ops.flip(real, axis=-1) * 0.5
        with tf.GradientTape() as tape:
            fake = self.generator(noise)
            c_loss = ops.mean(ops.softplus(self.critic(fake))) + ops.mean(
                ops.softplus(-self.critic(real)))
        grads = tape.gradient(c_loss, self.critic.trainable_variables)
        norm = tf.linalg.global_norm(grads)
        grads, _ = tf.clip_by_global_norm(grads, 0.05)
        self.c_optimizer.apply_gradients(zip(grads, self.critic.trainable_variables))
        with tf.GradientTape() as tape:
            g_loss = ops.mean(ops.softplus(-self.critic(self.generator(noise))))
        grads = tape.gradient(g_loss, self.generator.trainable_variables)
        grads = [ops.clip(g, -0.01, 0.01) for g in grads]
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_variables))
        n = ops.shape(real)[0]
        self.c_tracker.update_state(c_loss, sample_weight=n)
        self.g_tracker.update_state(g_loss, sample_weight=n)
        return {"c_loss": self.c_tracker.result(), "g_loss": self.g_tracker.result(),
                "c_grad_norm": norm}


class Drawing(keras.Model):
    """Its own train_step draws noise from a SeedGenerator of its own (as a GAN draws its latent
    vectors) and adds it to its inputs; the first sample's draw of the last step is kept in
    `drawn`, a variable kept out of the model's weights (hf.fit makes the replicas'
    non-trainable state one before a batch hook reads it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.noise = keras.random.SeedGenerator(7)
        object.__setattr__(self, "drawn", keras.Variable(  # (not tracked: not a weight)
            np.zeros(6, np.float32), trainable=False, name="drawn"))
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        z = keras.random.normal(ops.shape(x), seed=self.noise)
        self.drawn.assign(z[0])
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x + 0.1 * z))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.tracker.update_state(loss, sample_weight=ops.shape(x)[0])
        return {"loss": self.tracker.result()}


class Batches(keras.utils.PyDataset):
    """A keras.utils.PyDataset of (x, y) batches of `data`, counting its epoch hooks."""

    def __init__(self, x, y, batch_size=BATCH, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size
        self.begun = self.ended = 0

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, i):
        s = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return (self.x[s],) if self.y is None else (self.x[s], self.y[s])

    def on_epoch_begin(self):
        self.begun += 1

    def on_epoch_end(self):
        self.ended += 1


def generator(x, y=None, batch_size=BATCH, repeat=False):
    """A Python generator of (x, y) batches of `data` (once, or forever with `repeat`)."""
    while True:
        for k in range(0, len(x), batch_size):
            yield (x[k:k + batch_size],) if y is None else (x[k:k + batch_size],
                                                             y[k:k + batch_size])
        if not repeat:
            return


class Counting(keras.Model):
    """A subclassed model whose call() counts the samples it sees (state in call)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3, activation="softmax")
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    name="seen")

    def call(self, x):
        self.seen.assign_add(ops.cast(ops.shape(x)[0], "float32"))
        return self.out(self.hidden(x))


def _functional(cls):
    x = keras.Input((6,), name="x")
    return cls(x, _body(x))


def _sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def build(kind):
    """A compiled model of `kind`: "plain", "head_only", "penalised", "steps", "gan", "drawing",
    "counting", or one of LOSS_KINDS and REFUSED_KINDS."""
    if kind == "drawing":
        model = Drawing()
        model.build((None, 6))
        model.compile(optimizer=_sgd(), loss="sparse_categorical_crossentropy")
        return model
    if kind == "gan":
        model = Gan()
        model.build((None, 6))
        model.compile(c_optimizer=_sgd(), g_optimizer=_sgd())
        return model
    if kind in LOSS_KINDS:
        x = keras.Input((6,), name="x")
        model = {"on_inputs": OnInputs, "ignoring": Ignoring, "add_loss_only": keras.Model,
                 "halved": Halved, "tracked": Tracked}[kind](x, _regularized(x))
        # (weight decay: moves a weight given a zero gradient, not one given None)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.01),
                      loss=None if kind in ("on_inputs", "add_loss_only")
                      else "sparse_categorical_crossentropy")
        return model
    model = Counting() if kind == "counting" else _functional(
        {"plain": keras.Model, "head_only": HeadOnly, "penalised": Penalised, "steps": Steps,
         "odd_metrics": OddMetrics, "no_loss": keras.Model}[kind])
    # (odd_metrics has no compiled metrics: Keras' fit cannot read them unbuilt.)
    model.compile(optimizer=_sgd(), loss=None if kind == "no_loss" else
                  "sparse_categorical_crossentropy",
                  metrics=None if kind == "odd_metrics" else ["accuracy"])
    return model


def twins(kind, seed=3):
    """Two compiled models of `kind` with the same initial weights."""
    return [seeded(kind, seed) for _ in range(2)]


def seeded(kind, seed=3):
    """A compiled model of `kind`, its initial weights those of every other of this seed."""
    keras.utils.set_random_seed(seed)
    return build(kind)


_REFERENCES = {}


def reference(key, train):
    """What `train()` returns — model.fit's trained model and its logs, the oracle — computed
    once per process for `key`: the launches run every scenario at several P × R, and the
    oracle of a scenario does not depend on them. The model it returns is only read."""
    if key not in _REFERENCES:
        _REFERENCES[key] = train()
    return _REFERENCES[key]


def heads(loss, depth=1):
    """Three outputs (a, b, c) after `depth` Dense layers, compiled with `loss` (partial labels:
    a loss on some only)."""
    keras.utils.set_random_seed(1)
    x = keras.Input((6,), name="x")
    h = x
    for _ in range(depth):
        h = keras.layers.Dense(8, activation="tanh")(h)
    outs = [keras.layers.Dense(2, name="a")(h), keras.layers.Dense(3, name="b")(h),
            keras.layers.Dense(1, name="c")(h)]
    model = keras.Model(x, outs)
    model.compile(optimizer=_sgd(), loss=loss)
    return model


class DictInputs(keras.Model):
    """A subclassed model whose call() takes a dict of inputs by key."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, inputs):
        return self.out(self.hidden(ops.concatenate([inputs["b"] * 2.0, inputs["a"]],
                                                    axis=-1)))


def dict_inputs_model():
    keras.utils.set_random_seed(1)
    model = DictInputs()
    model.compile(optimizer=_sgd(), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def sparse_case(kind, depth=1):
    """A compiled model taking "scipy" / "tf.sparse" sparse or "ragged" inputs, with `depth`
    Dense layers, and its data (x, y): 72 samples."""
    import scipy.sparse
    import tensorflow as tf

    rng = np.random.default_rng(4)
    keras.utils.set_random_seed(1)
    if kind == "ragged":
        x = tf.ragged.constant([[1, 2, 3], [4], [5, 6], [7, 8, 9, 1]] * 18)
        inputs = keras.Input((None,), ragged=True, dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 4)(inputs))
    else:
        dense = ((rng.random((72, 20)) < 0.1) * rng.normal(size=(72, 20))).astype("float32")
        x = scipy.sparse.csr_matrix(dense) if kind == "scipy" else tf.sparse.from_dense(dense)
        inputs = h = keras.Input((20,), sparse=True)
    for _ in range(depth):
        h = keras.layers.Dense(8, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
    model.compile(optimizer=_sgd(), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model, x, rng.integers(0, 3, 72)


def reduced(kind, seed=1):
    """A compiled model whose loss reduces as `kind` says, and data for it: "sum", "sum_heads"
    (two outputs, both summed), "mixed" (one summed, one averaged), "masked" (a
    sequence loss over an Embedding's mask), "masked_subclassed", "weighted_mean"
    (reduction="mean_with_sample_weight"), "mean" (the default, on the masked model's
    last step only: no mask left), "sum_own" ("sum" with a compute_loss override).
    Returns (model, x, y, sample_weight or None)."""
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    sgd = keras.optimizers.SGD(0.05, momentum=0.9)
    if kind.startswith("masked") or kind == "mean":
        x = rng.integers(1, 10, size=(SAMPLES, 6))
        for k, n in enumerate(rng.integers(1, 7, size=SAMPLES)):
            x[k, n:] = 0  # padding: masked out
        y = rng.integers(0, 3, size=(SAMPLES, 6) if kind != "mean" else SAMPLES)
        if kind == "masked_subclassed":
            model = Tagger()
        else:
            i = keras.Input((6,), dtype="int32", name="tokens")
            h = keras.layers.Embedding(10, 4, mask_zero=True)(i)
            h = keras.layers.LSTM(5, return_sequences=kind != "mean")(h)
            h = keras.layers.Dense(5, activation="tanh")(h)  # masks pass through
            model = keras.Model(i, keras.layers.Dense(3, name="tags")(h))
        model.compile(sgd, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model, x, y, None
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    y = rng.normal(size=(SAMPLES, 2)).astype("float32")
    i = keras.Input((4,), name="x")
    h = i
    for _ in range(3):  # deep enough for four stages
        h = keras.layers.Dense(8, activation="tanh")(h)
    summed = keras.losses.MeanSquaredError(reduction="sum")
    if kind in ("sum_heads", "mixed"):
        model = keras.Model(i, [keras.layers.Dense(2, name="a")(h),
                                keras.layers.Dense(2, name="b")(h)])
        model.compile(keras.optimizers.SGD(0.005, momentum=0.9),
                      loss=[summed, summed if kind == "sum_heads" else "mse"])
        return model, x, [y, -y], None
    model = (SummedOwn if kind == "sum_own" else keras.Model)(
        i, keras.layers.Dense(2, name="y")(h))
    if kind in ("sum", "sum_own"):
        model.compile(keras.optimizers.SGD(0.005, momentum=0.9), loss=summed)
        return model, x, y, None
    model.compile(sgd, loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    return model, x, y, rng.uniform(0.1, 2.0, size=SAMPLES).astype("float32")


class Tagger(keras.Model):
    """A subclassed sequence tagger whose outputs carry the Embedding's mask."""

    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(10, 4, mask_zero=True)
        self.rnn = keras.layers.LSTM(5, return_sequences=True)
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.rnn(self.embed(x)))


class SummedOwn(keras.Model):
    """A compute_loss override over a loss summed over the batch."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(x, y, y_pred, sample_weight, training) * 0.5


class GivenTargets(keras.Model):
    """Two outputs, a loss on the first only (partial labels): compute_loss reads y and
    sample_weight as given (one array each), as Keras passes them."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        per_sample = ops.mean(ops.square(y - y_pred[0]), axis=-1)
        return ops.mean(per_sample * sample_weight)


def given_targets():
    """A GivenTargets model, and (x, y, sample_weight) for it."""
    keras.utils.set_random_seed(2)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh")(x)
    h = keras.layers.Dense(8, activation="tanh")(h)
    # Outputs of one shape: a list of targets would broadcast against either silently.
    model = GivenTargets(x, [keras.layers.Dense(2, name="a")(h),
                             keras.layers.Dense(2, name="b")(h)])
    model.compile(optimizer=_sgd(), loss=["mse", None])
    rng = np.random.default_rng(4)
    return model, (rng.normal(size=(SAMPLES, 6)).astype("float32"),
                   rng.normal(size=(SAMPLES, 2)).astype("float32"),
                   rng.uniform(0.5, 1.5, size=SAMPLES).astype("float32"))
