"""Each replica's own random draws while hf.fit trains: the model's seed generators set apart by
replica, put back when training ends, and then the same on every rank."""

import contextlib

import numpy as np

from hyparflow.keras import keras_private
from hyparflow.mpi import comm as comm_

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


def agree(model, world, wait=None):
    """After training (collective): every rank's seed generators take the state of the rank
    that drew most from each, the one holding its layer's stage (the lowest such rank).

    A rank draws only from the generators of its own stage's layers; its copies
    of the other stages' layers keep the state they had before hf.fit, which a
    later call at another P × R would draw from again. (Each draws once per
    micro-batch, so a generator's counter is m times model.fit's.)
    """
    generators = keras_private.seed_generators(model)
    if world is None or world.Get_size() == 1 or not generators:
        return
    mine = [g.state.numpy() for g in generators]
    everyone = comm_.allgather_objects(mine, world, wait)
    for k, generator in enumerate(generators):
        drawn = [states[k] for states in everyone]
        most = max(range(len(drawn)), key=lambda r: (int(drawn[r][1]), -r))
        if not np.array_equal(drawn[most], mine[k]):
            generator.state.assign(drawn[most])
