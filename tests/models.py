"""Small Keras models used by the tests, one per graph family the partitioner must split."""

import keras
from keras import layers


def chain(n=6, width=8, inputs=5, outputs=3):
    """Dense layers one after another."""
    x = inp = keras.Input((inputs,), name="x")
    for i in range(n):
        x = layers.Dense(width, activation="tanh", name=f"dense{i}")(x)
    out = layers.Dense(outputs, name="head")(x)
    return keras.Model(inp, out, name="chain")


def residual(blocks=3, width=8, inputs=5, outputs=3):
    """Dense residual blocks: x + f(x), skips crossing any cut."""
    x = keras.Input((inputs,), name="x")
    h = layers.Dense(width, activation="relu", name="stem")(x)
    for b in range(blocks):
        y = layers.Dense(width, activation="relu", name=f"b{b}_a")(h)
        y = layers.Dense(width, name=f"b{b}_b")(y)
        h = layers.Add(name=f"b{b}_add")([h, y])
        h = layers.Activation("relu", name=f"b{b}_relu")(h)
    out = layers.Dense(outputs, name="head")(h)
    return keras.Model(x, out, name="residual")


def conv_residual(blocks=2, filters=4, classes=3):
    """A tiny convolutional ResNet without BatchNormalization (16×16×3 inputs)."""
    x = keras.Input((16, 16, 3), name="image")
    h = layers.Conv2D(filters, 3, padding="same", activation="relu", name="stem")(x)
    for b in range(blocks):
        y = layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"b{b}_c1")(h)
        y = layers.Conv2D(filters, 3, padding="same", name=f"b{b}_c2")(y)
        h = layers.Activation("relu", name=f"b{b}_out")(layers.Add(name=f"b{b}_add")([h, y]))
    h = layers.GlobalAveragePooling2D(name="pool")(h)
    out = layers.Dense(classes, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="conv_residual")


def wide_mlp(depth=6, width=1024, inputs=64, classes=3):
    """Dense layers of 4 MiB weights each: several gradient buckets, and a backward long
    enough (~50 ms at 32 samples) for a bucket's allreduce to start inside it."""
    x = keras.Input((inputs,), name="x")
    h = layers.Dense(width, activation="relu", name="d0")(x)
    for k in range(1, depth):
        h = layers.Dense(width, activation="relu", name=f"d{k}")(h)
    out = layers.Dense(classes, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="wide_mlp")


def branch_merge(width=6, inputs=5, outputs=3):
    """Parallel paths concatenated, and a long skip from the stem to the head."""
    x = keras.Input((inputs,), name="x")
    stem = layers.Dense(width, activation="relu", name="stem")(x)
    a = layers.Dense(width, activation="relu", name="a1")(stem)
    a = layers.Dense(width, activation="relu", name="a2")(a)
    b = layers.Dense(width, activation="sigmoid", name="b1")(stem)
    c = layers.Dense(width, name="c1")(stem)
    m = layers.Concatenate(name="merge")([a, b, c])
    m = layers.Dense(width, activation="relu", name="mix")(m)
    h = layers.Concatenate(name="skip")([m, stem])
    out = layers.Dense(outputs, name="head")(h)
    return keras.Model(x, out, name="branch_merge")




def densenet(blocks=2, per_block=3, growth=4, classes=3):
    """DenseNet-style: each layer of a block consumes all earlier outputs of the block."""
    x = keras.Input((12, 12, 3), name="image")
    h = layers.Conv2D(2 * growth, 3, padding="same", activation="relu", name="stem")(x)
    for b in range(blocks):
        features = [h]
        for i in range(per_block):
            c = features[0] if len(features) == 1 else layers.Concatenate(
                name=f"d{b}_cat{i}")(features)
            features.append(layers.Conv2D(growth, 3, padding="same", activation="relu",
                                          name=f"d{b}_conv{i}")(c))
        h = layers.Concatenate(name=f"d{b}_out")(features)
        if b < blocks - 1:
            h = layers.Conv2D(2 * growth, 1, activation="relu", name=f"t{b}_conv")(h)
            h = layers.AveragePooling2D(2, name=f"t{b}_pool")(h)
    h = layers.GlobalAveragePooling2D(name="pool")(h)
    out = layers.Dense(classes, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="densenet")


def unet(filters=4, classes=3):
    """U-Net-style encoder/decoder: skips from each encoder level to its decoder level."""
    x = keras.Input((16, 16, 3), name="image")
    e1 = layers.Conv2D(filters, 3, padding="same", activation="relu", name="enc1")(x)
    e2 = layers.Conv2D(2 * filters, 3, padding="same", activation="relu", name="enc2")(
        layers.MaxPooling2D(2, name="down1")(e1))
    mid = layers.Conv2D(2 * filters, 3, padding="same", activation="relu", name="mid")(
        layers.MaxPooling2D(2, name="down2")(e2))
    d2 = layers.Concatenate(name="skip2")([layers.UpSampling2D(2, name="up2")(mid), e2])
    d2 = layers.Conv2D(2 * filters, 3, padding="same", activation="relu", name="dec2")(d2)
    d1 = layers.Concatenate(name="skip1")([layers.UpSampling2D(2, name="up1")(d2), e1])
    d1 = layers.Conv2D(filters, 3, padding="same", activation="relu", name="dec1")(d1)
    h = layers.GlobalAveragePooling2D(name="pool")(d1)
    out = layers.Dense(classes, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="unet")


def multi_io(width=8, classes=3):
    """Two inputs (one read only deep in the net), two outputs (one produced early)."""
    a = keras.Input((5,), name="a")
    b = keras.Input((3,), name="b")
    h = layers.Dense(width, activation="relu", name="a1")(a)
    h = layers.Dense(width, activation="relu", name="a2")(h)
    reg = layers.Dense(2, name="reg")(h)
    h = layers.Dense(width, activation="relu", name="a3")(h)
    side = layers.Dense(width, activation="tanh", name="b1")(b)
    h = layers.Concatenate(name="join")([h, side])
    h = layers.Dense(width, activation="relu", name="j1")(h)
    cls = layers.Dense(classes, activation="softmax", name="cls")(h)
    return keras.Model({"a": a, "b": b}, {"cls": cls, "reg": reg}, name="multi_io")


def nested(width=8, classes=3):
    """Functional and Sequential models used as layers, one nested inside another."""
    u = keras.Input((width,), name="u")
    v = layers.Dense(width, activation="relu", name="inner_a")(u)
    v = layers.Dense(width, name="inner_b")(v)
    block = keras.Model(u, layers.Add(name="inner_add")([u, v]), name="block")
    stack = keras.Sequential([keras.Input((width,)), layers.Dense(width, activation="tanh",
                                                                  name="seq_a"),
                              layers.Dense(width, name="seq_b")], name="stack")
    w = keras.Input((width,), name="w")
    outer = keras.Model(w, stack(block(w)), name="outer")
    x = keras.Input((5,), name="x")
    h = layers.Dense(width, activation="relu", name="stem")(x)
    h = outer(h)
    h = layers.Dense(width, activation="relu", name="mid")(h)
    h = keras.Sequential([layers.Dense(width, activation="relu", name="tail_a")], name="tail")(h)
    out = layers.Dense(classes, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="nested")


def with_ops(width=8, classes=3):
    """keras.ops calls on symbolic tensors, not layers, between the layers."""
    x = keras.Input((5,), name="x")
    h = layers.Dense(width, name="d0")(x)
    y = layers.Dense(width, name="d1")(keras.ops.relu(h))
    h = keras.ops.add(h, y) * 0.5
    h = keras.ops.concatenate([h, keras.ops.square(x)], axis=-1)
    out = layers.Dense(classes, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="with_ops")


def text(vocab=40, width=8, classes=3):
    """Token ids of any length (Input((None,))): a masked embedding, attention and
    position-wise layers on (batch, length, width) tensors, pooled over the kept tokens."""
    x = keras.Input((None,), dtype="int32", name="tokens")
    h = layers.Embedding(vocab, width, mask_zero=True, name="embed")(x)
    h = layers.Dense(width, activation="relu", name="d1")(h)
    a = layers.MultiHeadAttention(2, width // 2, name="attn")(h, h)
    h = layers.LayerNormalization(name="norm")(layers.Add(name="res")([h, a]))
    h = layers.Dense(width, activation="tanh", name="d2")(h)
    h = layers.GlobalAveragePooling1D(name="pool")(h)
    out = layers.Dense(classes, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="text")


def masked_encoder(vocab=40, width=8, classes=3):
    """`text`'s shape with its middle a nested functional model called on the masked
    embedding (Keras hands the nested model the mask; inside, Dense passes it on, the
    attention reads it, Concatenate makes a new one from its inputs', the LSTM consumes
    it), then pooled over the kept tokens."""
    t = keras.Input((None, width), name="seq")
    h = layers.Dense(width, activation="relu", name="d1")(t)
    a = layers.MultiHeadAttention(2, width // 2, name="attn")(h, h)
    h = layers.Concatenate(name="cat")([h, a])
    h = layers.LSTM(width, return_sequences=True, name="lstm")(h)
    encoder = keras.Model(t, layers.Dense(width, activation="tanh", name="d2")(h),
                          name="encoder")
    x = keras.Input((None,), dtype="int32", name="tokens")
    h = encoder(layers.Embedding(vocab, width, mask_zero=True, name="embed")(x))
    h = layers.GlobalAveragePooling1D(name="pool")(h)
    out = layers.Dense(classes, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="masked_encoder")


WORDS = "the quick brown fox jumps over a lazy dog and runs far away now".split()


def words(width=8, classes=3):
    """Raw strings in, read by the model's own TextVectorization (on the first stage: only
    numbers cross a cut), then an embedding over the tokens and their mean."""
    x = keras.Input((), dtype="string", name="sentence")
    h = layers.TextVectorization(max_tokens=30, output_sequence_length=5, vocabulary=WORDS,
                                 name="vectorize")(x)
    h = layers.Embedding(30, width, name="embed")(h)
    h = layers.Dense(width, activation="relu", name="d1")(h)
    h = layers.GlobalAveragePooling1D(name="pool")(h)
    h = layers.Dense(width, activation="tanh", name="d2")(h)
    out = layers.Dense(classes, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="words")


def tied(width=8, classes=3):
    """One Dense called at both ends of the model: the same weights read on the first stage
    and on the last (tied across the cut)."""
    x = keras.Input((width,), name="x")
    shared = layers.Dense(width, activation="tanh", name="shared")
    h = shared(x)
    h = layers.Dense(width, activation="relu", name="d1")(h)
    h = layers.Dense(width, activation="relu", name="d2")(h)
    h = shared(h)
    out = layers.Dense(classes, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="tied")


# keras-hub task models built from config with tiny sizes and random weights (no presets,
# no preprocessor: they take token ids and a padding mask). Their outputs are logits.
def gpt2():
    """keras-hub's GPT2CausalLM: its backbone's token embedding is called again, reversed,
    as the output head (weights tied across the model's ends)."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=40, num_layers=4, num_heads=2, hidden_dim=8, intermediate_dim=16,
        max_sequence_length=16, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def gemma():
    """keras-hub's GemmaCausalLM (tied embedding, RMS norms, rotary attention)."""
    import keras_hub

    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=40, num_layers=4, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=8, intermediate_dim=16, head_dim=4, dropout=0.0)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def bert():
    """keras-hub's BertTextClassifier (token, segment and position embeddings; a pooled
    head)."""
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=40, num_layers=4, num_heads=2, hidden_dim=8, intermediate_dim=16,
        max_sequence_length=16, dropout=0.0)
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3,
                                               preprocessor=None, dropout=0.0)


BUILDERS = {"text": text, "words": words, "tied": tied,
            "chain": chain, "residual": residual,
            "branch_merge": branch_merge, "wide_mlp": wide_mlp, "conv_residual": conv_residual,
            "densenet": densenet,
            "unet": unet, "multi_io": multi_io, "nested": nested, "with_ops": with_ops}
def hub_encoder(vocab=40, width=16, classes=3):
    """keras-hub's TransformerEncoder layers in a nested functional model called on a
    masked embedding: each reads the mask it is handed at run time and gives its output
    the same one (Keras' compute_mask is not asked), deleting its input's on the way."""
    import keras_hub

    t = keras.Input((None, width), name="seq")
    h = keras_hub.layers.TransformerEncoder(2 * width, 2, name="block0")(t)
    h = keras_hub.layers.TransformerEncoder(2 * width, 2, name="block1")(h)
    encoder = keras.Model(t, layers.Add(name="skip")([t, h]), name="encoder")
    x = keras.Input((None,), dtype="int32", name="tokens")
    h = encoder(layers.Embedding(vocab, width, mask_zero=True, name="embed")(x))
    h = layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(x, layers.Dense(classes, name="head")(h), name="hub_encoder")


def ragged_targets(n=48, seed=0):
    """x: 6 features; y: a tf.RaggedTensor, 1 to 4 numbers a sample; the loss pads the
    model's 4 outputs' targets and counts the given ones only (`padded_mse`)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    lengths = rng.integers(1, 5, size=n)
    y = tf.RaggedTensor.from_row_lengths(rng.normal(size=int(lengths.sum())).astype("float32"),
                                         lengths)
    return x, y


def padded_mse(y_true, y_pred):
    """The mean squared error over each sample's given targets (a ragged row of 1 to 4)."""
    import tensorflow as tf

    given = tf.sequence_mask(y_true.row_lengths(), 4, dtype=y_pred.dtype)
    error = tf.square(y_true.to_tensor(shape=[None, 4]) - y_pred) * given
    return tf.reduce_sum(error, axis=1) / tf.reduce_sum(given, axis=1)


def regressor():
    """Six features in, four numbers out (`ragged_targets`' model)."""
    h = x = keras.Input((6,))
    for _ in range(3):  # (4 calls: 4 stages)
        h = keras.layers.Dense(8, activation="tanh")(h)
    return keras.Model(x, keras.layers.Dense(4)(h))


# not in BUILDERS (whose every model the partition tests cut at every count): slow to walk
def wider_mlp():
    """`wide_mlp` of 16 MiB layers: whole on a rank it needs ~130 MB more than half of it
    (weights, gradient sums and momentum), which a memory limit can fall between."""
    return wide_mlp(width=2048)


MORE = {"masked_encoder": masked_encoder, "wider_mlp": wider_mlp}
# not in BUILDERS: they need keras-hub
HUB = {"gpt2": gpt2, "gemma": gemma, "bert": bert, "hub_encoder": hub_encoder}
