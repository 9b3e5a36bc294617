"""Small Keras models used by the tests: a chain, a residual net, a branch-and-merge net."""

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


BUILDERS = {"chain": chain, "residual": residual, "branch_merge": branch_merge,
            "conv_residual": conv_residual}
