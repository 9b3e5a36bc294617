"""Each replica's own random draws while hf.fit trains: the model's seed generators set apart by
replica, and put back when training ends."""

import contextlib

import numpy as np

from hyparflow import keras_private

# How far apart two replicas' seeds lie (a prime above any seed a script is likely to pick
# by hand, so that replica r's stream is no other generator's).
SPREAD = 1_000_003


@contextlib.contextmanager
def apart(model, replica):
    """While inside, every seed generator of `model` on this rank draws replica `replica`'s
    own stream; on leaving, each has its own seed back.

    A generator's state is (seed, counter), and each draw advances the counter
    only. Replica r's seed is moved by r · `SPREAD` for the training and back
    afterwards: a GAN's noise, dropout's masks and augmentation layers differ
    between replicas, as they differ between the samples of one batch under
    model.fit, and each generator ends with the seed it had and the counter its
    draws advanced (a model's own train_step draws once per step on every
    replica, as model.fit does). Replica 0 draws as before.
    """
    generators = keras_private.seed_generators(model) if replica else []
    _move(generators, replica)
    try:
        yield
    finally:
        _move(generators, -replica)


def _move(generators, by):
    for generator in generators:
        state = generator.state
        step = np.array([by * SPREAD, 0]).astype(np.dtype(str(state.dtype)))
        state.assign(state.value + step)
