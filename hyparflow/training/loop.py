"""The Keras loop on one rank: epochs, steps, validation and callbacks, as Model.fit runs them."""

import numpy as np

from hyparflow.data import batches as data_
from hyparflow.keras import keras_private
from hyparflow.keras import optimizers as optimizers_
from hyparflow.mpi import comm as comm_
from hyparflow.training import checkpoint, elastic, preemption


def should_validate(epoch, validation_freq):
    """Model.fit's rule: validate after (1-based) epoch e if e % freq == 0 or e is in the list."""
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq


def train(trainer, feed, epochs, initial_epoch, cbs, validation=None, validation_freq=1,
          watch=None, gather_each_batch=False, merge_each_batch=False):
    """Train `epochs` epochs from `initial_epoch`, calling `cbs` at Model.fit's hooks.

    Args:
        trainer: this rank's Trainer.
        feed: a `data.Feed` of the training batches.
        epochs, initial_epoch: as in Model.fit (a BackupAndRestore callback may
            move the start, as in Model.fit).
        cbs: the CallbackList.
        validation: a `data.Feed` of validation batches, or None.
        validation_freq: as in Model.fit.
        watch: a `preemption.Watch`: asked at every step boundary whether every rank
            stops there (a rank was signalled), then `preemption.stop` checkpoints and
            raises `Preempted`; or backs up there (an elastic job: `preemption.back_up`).
        gather_each_batch: give every rank every stage's weights before each
            `on_train_batch_end` (a callback of the user's own has training-batch hooks,
            which may read any weight: `callbacks.batch_readers` of the callbacks every
            rank was given — the same on every rank, whichever of them runs here).
        merge_each_batch: make the replicas' non-trainable state one after every step
            (an elastic job's, `elastic.merges_each_step`: a lost replica's share of it
            is not lost with it).

    Returns:
        The logs of the last epoch (None if no epoch ran).
    """
    model, executor = trainer.model, trainer.executor
    model.stop_training = False
    # where training stands, for an elastic job that loses ranks (`elastic.go_on`): the last
    # step every stage finished (its epoch, its index: -1 before the first), None before any
    trainer.position = None
    trainer.resumable = feed.rewindable and feed.per_execution == 1
    trainer.kept = elastic.keeps(trainer)
    trainer.added.clear()  # the replicas start from rank 0's model: nothing added yet
    feed.reset()  # as Model.fit resets its epoch iterator (a PyDataset's on_epoch_end runs)
    cbs.on_train_begin()
    preemption.check_restored(cbs, int(executor.optimizer.iterations.numpy()))
    initial_epoch = keras_private.restored_epoch(model) or initial_epoch
    feed.skip(initial_epoch)
    # a preempted run's backup: the steps of this epoch it trained (replayed data only)
    done = preemption.steps_done(cbs, initial_epoch) if feed.rewindable else 0
    logs, training_logs = {}, None
    stepped = False  # since every rank last got every stage's weights
    for epoch in range(initial_epoch, epochs):
        elastic.reached(trainer, (epoch, done - 1))
        trainer.logs.reset()
        cbs.on_epoch_begin(epoch)
        for begin, end, group in feed.epoch():  # steps_per_execution steps per group
            if end < done:  # trained before the preemption: read past it
                continue
            cbs.on_train_batch_begin(begin)
            with trainer.added.step():
                for batch in group:
                    sizes, xs, ys, sws = batch.parts()
                    contribution = executor.train_step(sizes, xs, ys, batch.size, sws)
                    elastic.reached(trainer, (epoch, trainer.position[1] + 1),
                                    settled=not merge_each_batch)
                    logs = trainer.logs.step(contribution, batch.size)
                    stepped = True
            if gather_each_batch:
                checkpoint.gather_weights(trainer)
                elastic.reached(trainer, trainer.position)  # (the state now one)
                stepped = False
            elif merge_each_batch:
                checkpoint.merge_replicas(trainer)
                elastic.reached(trainer, trainer.position)
            cbs.on_train_batch_end(end, logs)
            if model.stop_training:  # (a loss from here on resumes with nothing to train)
                elastic.reached(trainer, (epochs, -1))
            signalled = watch.step() if watch is not None else None
            steps = feed.steps or feed.num_batches
            if signalled:
                preemption.stop(trainer, cbs, epoch, end, steps, logs, signalled)
            # an elastic job's backup between two steps of an epoch (its end saves one anyway),
            # where a rerun replays the data to resume there
            if watch is not None and watch.backup_due and feed.rewindable and (
                    steps is None or end + 1 < steps):
                preemption.back_up(trainer, cbs, epoch, end)
            if model.stop_training:
                break
        done = 0
        trainer.logs.settle()  # the metrics' state of the whole batch, on every rank
        epoch_logs = dict(logs)
        # Callbacks may read or save the model: give every rank every stage's weights.
        checkpoint.gather_weights(trainer)
        stepped = False
        if validation is not None and should_validate(epoch, validation_freq):
            val_logs = evaluate(trainer, validation, cbs)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            checkpoint.gather_state(trainer)  # what a layer counted in validation, merged
        cbs.on_epoch_end(epoch, epoch_logs)
        elastic.reached(trainer, (epochs if model.stop_training else epoch + 1, -1))
        training_logs = epoch_logs
        if model.stop_training:
            break
    # (nothing left to train: the finalizing below is this rank's own, before any message)
    elastic.reached(trainer, (epochs, -1))
    if epochs > initial_epoch:
        # Model.fit's finalize_variable_values (EMA), on this stage's variables, listed as
        # the optimizer was built over them (the user's: the model's order)
        whole = executor.optimizer is trainer.user_optimizer
        executor.finalize(model.trainable_variables if whole else executor.variables)
        if stepped or optimizers_.finalizes(executor.optimizer):  # (else as the epoch left them)
            checkpoint.gather_weights(trainer)
    # no forward follows: a loss from here on goes on from the model as it is (the callbacks'
    # on_train_end may set its weights: EarlyStopping's best)
    trainer.kept = None
    return training_logs


def evaluate(trainer, feed, cbs):
    """Forwards only over one epoch of `feed`; returns the logs (loss and metrics)."""
    feed.reset()  # every evaluation starts at the first batch, as Model.evaluate does
    trainer.logs.reset()
    cbs.on_test_begin()
    logs = {}
    for begin, end, group in feed.epoch():
        cbs.on_test_batch_begin(begin)
        with trainer.added.step():  # (a layer may count what it sees in inference too)
            for batch in group:
                sizes, xs, ys, sws = batch.parts()
                contribution, _ = trainer.executor.infer_step(sizes, xs, ys, batch.size,
                                                              sw_micro=sws)
                logs = trainer.logs.step(contribution, batch.size)
        cbs.on_test_batch_end(end, dict(logs))
    trainer.logs.settle()
    cbs.on_test_end(dict(logs))
    return logs


def predict(trainer, feed, cbs, world):
    """Forwards only over one epoch of `feed`; every rank gets every prediction, in order."""
    kept = []
    cbs.on_predict_begin()
    for begin, end, group in feed.epoch():
        cbs.on_predict_batch_begin(begin)
        with trainer.added.step():
            for j, batch in enumerate(group):
                sizes, xs, _, _ = batch.parts()
                _, outputs = trainer.executor.infer_step(sizes, xs, None, batch.size,
                                                         keep_outputs=True)
                kept += [(idx, outs, (begin, j))
                         for idx, outs in zip(batch.positions(), outputs)]
        cbs.on_predict_batch_end(end, {})
    cbs.on_predict_end()
    return _assemble(trainer, kept, world)


def _assemble(trainer, kept, world):
    """Predictions of every rank → arrays in sample order, in the structure the step returns.

    `kept` holds (sample positions, predictions, batch) per micro-batch, the predictions
    in the model's output structure (or that of its own predict_step).
    """
    from keras import tree

    pieces = kept if world is None or world.Get_size() == 1 else [
        p for rank_pieces in comm_.allgather_objects(
            kept, world, trainer.guard.bounded("every rank's predictions"))
        for p in rank_pieces]
    n = sum(len(idx) for idx, _, _ in pieces)
    if pieces:
        structure = pieces[0][1]
        if any(data_.is_ragged(a) for a in tree.flatten(structure)):  # a ragged output
            return _by_batch(pieces, structure)
        specs = [(a.shape[1:], a.dtype) for a in tree.flatten(structure)]
        if any(tuple(np.shape(a)[1:]) != tuple(shape)
               for _, outs, _ in pieces for a, (shape, _) in zip(tree.flatten(outs), specs)):
            return _by_batch(pieces, structure)
    elif trainer.partition.graph is not None:
        structure = keras_private.outputs_struct(trainer.partition.graph.functional)
        specs = [(tuple(t.shape[1:]), np.dtype(t.dtype))
                 for t in trainer.partition.graph.functional.outputs]
    else:
        return []
    arrays = [np.empty((n,) + tuple(shape), dtype) for shape, dtype in specs]
    for idx, outs, _ in pieces:
        for a, o in zip(arrays, tree.flatten(outs)):
            a[idx] = o
    return tree.pack_sequence_as(structure, arrays)


def _joined(pieces):
    """One batch's predictions from its micro-batches' (ragged ones too), in order."""
    if data_.is_ragged(pieces[0]):
        import tensorflow as tf

        return tf.concat(list(pieces), axis=0)
    return np.concatenate(pieces)


def _by_batch(pieces, structure):
    """Predictions whose shapes differ from batch to batch (a sequence's length): each
    batch's in sample order, joined as Model.predict joins them (`ragged_concat`)."""
    from keras import tree

    batches = {}
    for idx, outs, batch in pieces:
        batches.setdefault(batch, []).append((idx[0] if len(idx) else 0, outs))
    joined = []
    for batch in sorted(batches):
        parts = [tree.flatten(outs) for _, outs in sorted(batches[batch], key=lambda p: p[0])]
        joined.append([_joined(column) for column in zip(*parts)])
    return tree.pack_sequence_as(structure, [keras_private.ragged_concat(list(column))
                                             for column in zip(*joined)])
