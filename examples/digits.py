"""Train a small BatchNormalization ResNet on scikit-learn's 8×8 digits; print the test accuracy.

Run it on partitions × replicas ranks, for example::

    hyparflow-run -n 4 python examples/digits.py --partitions 2 --replicas 2

or, with the defaults P = R = 1, as plain ``python examples/digits.py``.
Needs scikit-learn (``pip install "hyparflow[test]"``), which ships the data set.
"""

import argparse

import hyparflow as hf  # isort: skip  (before TensorFlow, so that each rank's thread share applies)

import keras
import numpy as np
from mpi4py import MPI


def load_digits():
    """(x_train, y_train), (x_test, y_test): 8×8×1 images in [0, 1], a stratified 20% for test."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., np.newaxis]
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y,
                                                        random_state=0)
    return (x_train, y_train), (x_test, y_test)


def conv_bn_relu(h, filters, name, relu=True):
    h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv")(h)
    h = keras.layers.BatchNormalization(momentum=0.9, name=f"{name}_bn")(h)
    return keras.layers.Activation("relu", name=f"{name}_relu")(h) if relu else h


def build_model(seed, steps, blocks=3, filters=32):
    """A compiled ResNet: a stem, `blocks` residual blocks, global average pooling, softmax.

    The learning rate decays to 0 over `steps` optimizer steps, for a stable final accuracy.
    """
    keras.utils.set_random_seed(seed)  # the same initial weights on every rank
    inputs = keras.Input((8, 8, 1), name="image")
    h = conv_bn_relu(inputs, filters, "stem")
    for b in range(blocks):
        r = conv_bn_relu(h, filters, f"block{b}a")
        r = conv_bn_relu(r, filters, f"block{b}b", relu=False)
        h = keras.layers.Add(name=f"block{b}_add")([h, r])
        h = keras.layers.Activation("relu", name=f"block{b}_relu")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    outputs = keras.layers.Dense(10, activation="softmax", name="digit")(h)
    model = keras.Model(inputs, outputs, name="digits_resnet")
    learning_rate = keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=steps)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=1, help="pipeline stages P")
    parser.add_argument("--replicas", type=int, default=1, help="pipeline copies R")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="micro-batches per replica's share (default: hyparflow's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the shuffle")
    parser.add_argument("--verbose", type=int, default=0, choices=(0, 1, 2))
    args = parser.parse_args(argv)
    P, R = args.partitions, args.replicas

    (x_train, y_train), (x_test, y_test) = load_digits()
    steps = args.epochs * -(-len(x_train) // args.batch_size)
    model = build_model(args.seed, steps)
    hf.fit(model, x_train, y_train, partitions=P, replicas=R, microbatches=args.microbatches,
           batch_size=args.batch_size, epochs=args.epochs, validation_data=(x_test, y_test),
           verbose=args.verbose)  # (shuffled from build_model's keras.utils.set_random_seed)
    loss, accuracy = hf.evaluate(model, x_test, y_test, partitions=P, replicas=R,
                                 batch_size=args.batch_size, verbose=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"TEST ACCURACY {accuracy:.4f} P={P} R={R}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
