"""CIFAR ResNets as plain Keras functional models:
v1 (He et al. 2015) and pre-activation v2 (2016)."""

import numbers
import sys

import keras
from keras import layers


def _check_depth(depth, step, smallest, name, examples):
    """n for a depth of the form step·n + 2, or a ValueError."""
    if (not isinstance(depth, numbers.Integral) or isinstance(depth, bool) or depth < smallest
            or (depth - 2) % step):
        raise ValueError(
            f"{name}: depth={depth!r} is not a valid depth; it must be {step}n+2 for a whole "
            f"number n ≥ {(smallest - 2) // step} ({examples}).")
    return (int(depth) - 2) // step


def _conv(x, filters, kernel, strides, name, batchnorm, weight_decay):
    """A convolution, 'same' padding, He initialisation, L2 on the kernel."""
    return layers.Conv2D(
        filters, kernel, strides=strides, padding="same", use_bias=not batchnorm,
        kernel_initializer="he_normal",
        kernel_regularizer=keras.regularizers.L2(weight_decay) if weight_decay else None,
        name=name)(x)


def _bn_relu(x, prefix, suffix, batchnorm):
    """BatchNormalization (when enabled) then ReLU, named
    `<prefix>_bn<suffix>` / `_relu<suffix>`."""
    if batchnorm:
        x = layers.BatchNormalization(name=f"{prefix}_bn{suffix}")(x)
    return layers.Activation("relu", name=f"{prefix}_relu{suffix}")(x)


def _model(inputs, outputs, name, depth):
    """keras.Model(inputs, outputs), with room for Keras' recursive walk of a very deep graph.

    Keras builds a functional model by recursing through its layer graph, a few
    frames per layer; past about ResNet-2000 that exceeds Python's default limit
    of 1000 frames, so the limit is raised with the depth (and left raised: later
    walks of the same graph, such as saving, recurse as deep). Plain Keras calls
    only, so the builders also run under Keras 2 (the Horovod peer's TensorFlow 2.15).
    """
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 80 * depth))
    return keras.Model(inputs, outputs, name=name)


def _head(x, classes, weight_decay):
    """Global average pooling and the softmax classifier."""
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    return layers.Dense(
        classes, activation="softmax", kernel_initializer="he_normal",
        kernel_regularizer=keras.regularizers.L2(weight_decay) if weight_decay else None,
        name="predictions")(x)


def resnet_v1(depth, input_shape=(32, 32, 3), classes=10, batchnorm=True, weight_decay=1e-4):
    """The CIFAR ResNet v1 of He et al. (2015), section 4.2: depth 6n+2 (20, 32, 44, 56, 110, ...).

    A 3×3 convolution with 16 filters, then three stages of n basic blocks
    (two 3×3 convolutions each) with 16, 32 and 64 filters, the first block of
    stages 2 and 3 halving the resolution; global average pooling and a softmax
    classifier. Blocks are conv-BN-ReLU, conv-BN, add, ReLU. Where the shape
    changes, the shortcut is a strided 1×1 convolution (the paper's option B,
    as in the Keras CIFAR-10 ResNet example); elsewhere it is the identity.

    Args:
        depth: layers with weights, 6n + 2.
        input_shape: shape of one image.
        classes: number of classes.
        batchnorm: include BatchNormalization after each convolution (convolutions
            then have no bias); False builds the same network without it.
        weight_decay: L2 factor on convolution and classifier kernels (0 for none).

    Returns:
        An uncompiled keras.Model named ``resnet{depth}_v1``.

    Raises:
        ValueError: depth is not 6n + 2 with n ≥ 1.
    """
    n = _check_depth(depth, 6, 8, "resnet_v1", "e.g. 20, 56 or 110")
    inputs = keras.Input(input_shape, name="image")
    x = _conv(inputs, 16, 3, 1, "stem_conv", batchnorm, weight_decay)
    x = _bn_relu(x, "stem", "", batchnorm)
    filters = 16
    for stage in range(1, 4):
        for block in range(1, n + 1):
            prefix = f"stage{stage}_block{block}"
            strides = 2 if stage > 1 and block == 1 else 1
            y = _conv(x, filters, 3, strides, f"{prefix}_conv1", batchnorm, weight_decay)
            y = _bn_relu(y, prefix, "1", batchnorm)
            y = _conv(y, filters, 3, 1, f"{prefix}_conv2", batchnorm, weight_decay)
            if batchnorm:
                y = layers.BatchNormalization(name=f"{prefix}_bn2")(y)
            shortcut = x
            if strides != 1 or x.shape[-1] != filters:
                shortcut = _conv(x, filters, 1, strides, f"{prefix}_shortcut", batchnorm,
                                 weight_decay)
                if batchnorm:
                    shortcut = layers.BatchNormalization(name=f"{prefix}_shortcut_bn")(shortcut)
            x = layers.Add(name=f"{prefix}_add")([shortcut, y])
            x = layers.Activation("relu", name=f"{prefix}_out")(x)
        filters *= 2
    outputs = _head(x, classes, weight_decay)
    return _model(inputs, outputs, f"resnet{depth}_v1", depth)


def resnet_v2(depth, input_shape=(32, 32, 3), classes=10, batchnorm=True, weight_decay=1e-4):
    """The pre-activation bottleneck ResNet v2 of He et al. (2016): depth 9n+2 (164, 1001),
    or any 3k+2.

    A 3×3 convolution with 16 filters (then BN-ReLU), then three stages of n
    bottleneck blocks (for a depth 3k + 2 that is not 9n + 2, e.g. 5000, the k
    blocks are shared out as evenly as possible, earlier stages taking the extra
    ones) of widths 16, 32 and 64 with 4× wider outputs (64, 128, 256), the
    first block of stages 2 and 3 halving the resolution. Each block is
    BN-ReLU-conv1×1, BN-ReLU-conv3×3, BN-ReLU-conv1×1 added to the shortcut,
    with nothing after the addition. The first block of each stage changes the
    shape: its shortcut is a strided 1×1 convolution of the block's
    pre-activation, which it shares with the residual branch (in stage 1 the
    stem's BN-ReLU serves). A final BN-ReLU, global average pooling and a
    softmax classifier end the network.

    Args:
        depth: layers with weights, 3k + 2 with k ≥ 3 blocks (9n + 2 gives n per stage).
        input_shape, classes, batchnorm, weight_decay: as in `resnet_v1`.

    Returns:
        An uncompiled keras.Model named ``resnet{depth}_v2``.

    Raises:
        ValueError: depth is not 3k + 2 with k ≥ 3.
    """
    k = _check_depth(depth, 3, 11, "resnet_v2", "e.g. 164, 1001 or 5000")
    blocks = [k // 3 + (1 if i < k % 3 else 0) for i in range(3)]
    inputs = keras.Input(input_shape, name="image")
    x = _conv(inputs, 16, 3, 1, "stem_conv", batchnorm, weight_decay)
    x = _bn_relu(x, "stem", "", batchnorm)
    width = 16
    for stage in range(1, 4):
        for block in range(1, blocks[stage - 1] + 1):
            prefix = f"stage{stage}_block{block}"
            first = block == 1
            strides = 2 if stage > 1 and first else 1
            if first and stage == 1:
                preact = x  # the stem's BN-ReLU is this block's pre-activation
            else:
                preact = _bn_relu(x, prefix, "1", batchnorm)
            y = _conv(preact, width, 1, strides, f"{prefix}_conv1", batchnorm, weight_decay)
            y = _bn_relu(y, prefix, "2", batchnorm)
            y = _conv(y, width, 3, 1, f"{prefix}_conv2", batchnorm, weight_decay)
            y = _bn_relu(y, prefix, "3", batchnorm)
            y = _conv(y, 4 * width, 1, 1, f"{prefix}_conv3", False, weight_decay)
            if first:
                shortcut = _conv(preact, 4 * width, 1, strides, f"{prefix}_shortcut", False,
                                 weight_decay)
            else:
                shortcut = x
            x = layers.Add(name=f"{prefix}_add")([shortcut, y])
        width *= 2
    x = _bn_relu(x, "final", "", batchnorm)
    outputs = _head(x, classes, weight_decay)
    return _model(inputs, outputs, f"resnet{depth}_v2", depth)
