"""Preemption: a rank signalled during hf.fit makes
every rank checkpoint at a step boundary and stop.

A batch system warns a job before it ends it (Slurm: ``--signal=B:USR1@120``
reaching `hyparflow-run`, or SIGTERM): during `hf.fit` every rank catches
SIGUSR1 and SIGTERM and only notes it (a second one takes its usual course). At
every step boundary the ranks agree
(`Watch.step`: a nonblocking allreduce started at one boundary and completed at
the next, so no step waits for it) whether any rank was signalled; then all
stop after the same step, write the user's `BackupAndRestore` backup (with the
steps done in the epoch, so a rerun resumes at the next step, not at the
epoch's start) or, without one, the user's `ModelCheckpoint`s, and raise
`Preempted` — a `SystemExit` with code 75 (EX_TEMPFAIL: run it again) — on every
rank. A signal hf.fit caught but did not act on (it came after the last step
boundary) is raised again as hf.fit returns, to whatever handler the process had.
"""

import json
import os
import signal
import sys
import threading

import numpy as np

from hyparflow.mpi import comm as comm_

EXIT_CODE = 75  # os.EX_TEMPFAIL: the job was stopped to be run again
CAUGHT = (signal.SIGTERM, signal.SIGUSR1)
STEPS_KEY = "hyparflow_steps"  # in BackupAndRestore's metadata: steps of the epoch done
ITERATIONS_KEY = "hyparflow_iterations"  # ... and the optimizer's steps in its weights


class Preempted(SystemExit):
    """hf.fit stopped at a step boundary because a rank was signalled (exit code 75)."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


_WATCHING = []  # the Watch whose handlers are installed (hf.fit is running), if any


def _forget_in_child():
    """In a process forked while hf.fit runs (a PyDataset's worker): the handlers it had, so
    that SIGTERM ends it (`Pool.terminate`) instead of being noted for a fit it is not in."""
    for watch in _WATCHING:
        try:
            watch.restore()
        except ValueError:  # forked from a thread other than the main one
            pass
    _WATCHING.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class Watch:
    """Catches SIGTERM and SIGUSR1 while hf.fit trains; `step` says when every rank stops,
    and (`backup_due`) when an elastic job backs up.

    Args:
        world: hyparflow's communicator (None or size 1: this rank alone).
        guard: the job's `guard.Guard`, which bounds the waits.
        clock: an `elastic.Clock` (rank 0's asks for a backup ride on the same agreement),
            or None.
    """

    def __init__(self, world, guard, clock=None):
        self.caught = None  # the signal this rank caught, not yet acted on
        self.world = world if world is not None and world.Get_size() > 1 else None
        self.comm = comm_.dup(self.world) if self.world is not None else None
        self.guard = guard
        self.request = None
        self.clock = clock
        self.backup_due = False  # every rank backs up at this boundary (an elastic job)
        # (signal, rank + 1) of this rank, or zeros; then 1 where it asks for a backup
        self.sent = np.zeros(3, np.int64)
        self.heard = np.zeros(3, np.int64)
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._note) for s in CAUGHT}
            _WATCHING.append(self)
        return self

    def _note(self, signum, frame):
        if self.caught:  # a second signal: the sender insists (or the job is stuck): as before
            self.restore()
            signal.raise_signal(signum)
            return
        self.caught = signum

    def step(self):
        """At a step boundary, on every rank: (signal, rank) if every rank stops now, else None.

        The answer covers the signals caught before the previous boundary: the
        agreement runs while the step between them computes.
        """
        asks = self.clock is not None and self.clock.due()
        if asks:
            self.clock.written()  # (the next ask comes a whole interval later)
        if self.comm is None:
            self.backup_due = asks
            return (self.caught, 0) if self.caught else None
        self.backup_due = False
        if self.request is not None:
            self._complete()
            if self.heard[0]:
                return int(self.heard[0]), int(self.heard[1]) - 1
            self.backup_due = bool(self.heard[2])
        if self.caught:
            self.sent[:2] = (int(self.caught), self.world.Get_rank() + 1)
        self.sent[2] = int(asks)
        self.request = comm_.start_allreduce(self.sent, self.comm, "max", out=self.heard)
        return None

    def __exit__(self, kind, exc, tb):
        from hyparflow.mpi.guard import Guard

        healthy = exc is None or isinstance(exc, Preempted) or Guard.agreed(exc)
        if self.request is not None and healthy:  # every rank started it: complete it
            self._complete()
        if self.comm is not None and healthy:
            comm_.free(self.comm)
        self.restore()
        if self in _WATCHING:
            _WATCHING.remove(self)
        return False

    def _complete(self):
        self.guard.bounded("every rank's word on a preemption signal")(self.request)
        self.request = None

    def restore(self):
        """The handlers the process had before hf.fit."""
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def deliver(self):
        """After hf.fit's last hook: a signal that came too late to stop training goes to the
        handler the process had (by default, SIGTERM then ends it)."""
        if self.caught:
            caught, self.caught = self.caught, None
            signal.raise_signal(caught)


def stop(trainer, cbs, epoch, step, steps, logs, signalled):
    """Every rank, after step `step` of `epoch`: checkpoint as the user's callbacks would, then
    raise `Preempted` (marked as raised alike on every rank)."""
    from keras import callbacks as callbacks_module

    from hyparflow.keras import keras_private
    from hyparflow.mpi.guard import Guard

    signum, rank = signalled
    top = trainer.topology
    listed = cbs.callbacks.callbacks
    backups = _backups(cbs)
    savers = backups or [cb for cb in listed
                         if isinstance(cb, callbacks_module.ModelCheckpoint)]
    _save(trainer, savers, epoch, step, logs)
    name = signal.Signals(signum).name
    where = top.where(rank)
    done = f"stopped after epoch {epoch + 1}, step {step + 1}" + (f" of {steps}" if steps else "")
    if backups:
        saved = ("saved the training state through BackupAndRestore("
                 + ", ".join(repr(cb.backup_dir) for cb in backups)
                 + "): run the same script again to resume at the next step")
    elif savers:
        saved = ("saved through ModelCheckpoint(" + ", ".join(
            repr(keras_private.checkpoint_path(cb, epoch, step, logs)) for cb in savers)
                 + ") (add a BackupAndRestore callback to resume where it stopped)")
    else:
        saved = ("nothing was saved: add keras.callbacks.BackupAndRestore(backup_dir) to "
                 "hf.fit's callbacks to resume where it stopped")
    message = f"hyparflow: {name} on {where}: {done}; {saved}. Exit code {EXIT_CODE}."
    if top.rank == top.logging_rank:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    _finalize_under_mpi4py()
    raise Guard.mark_agreed(Preempted(message))


def back_up(trainer, cbs, epoch, step):
    """Every rank, after step `step` of `epoch` (an elastic job's agreed boundary): the user's
    BackupAndRestore, or the one the elastic job added, writes the training state with the
    steps of the epoch done."""
    _save(trainer, _backups(cbs), epoch, step, None)


def _backups(cbs):
    from keras import callbacks as callbacks_module

    return [cb for cb in cbs.callbacks.callbacks
            if isinstance(cb, callbacks_module.BackupAndRestore)]


def _save(trainer, savers, epoch, step, logs):
    """Every rank: each of `savers` (BackupAndRestore: its backup, as it writes one every few
    batches, with the steps of the epoch done; ModelCheckpoint: its file) saves as after
    `step` of `epoch`; an error in one is raised on every rank, once every file is complete."""
    from keras import callbacks as callbacks_module

    from hyparflow.keras import keras_private
    from hyparflow.training import checkpoint

    top = trainer.topology
    checkpoint.gather_weights(trainer)
    iterations = int(trainer.executor.optimizer.iterations.numpy())
    error = None
    for cb in savers:  # each save is collective: an error in it is raised on every rank
        try:
            if isinstance(cb, callbacks_module.BackupAndRestore):
                keras_private.save_backup(cb, epoch, step, top.rank == top.logging_rank,
                                          {STEPS_KEY: step + 1, ITERATIONS_KEY: iterations})
            else:
                keras_private.save_checkpoint(cb, epoch, step, logs)
        except OSError as exc:  # the backup's metadata, written on the logging rank alone
            error = exc
    # no rank leaves (and exits) before the files are complete
    comm_.agree(error, trainer.world,
                wait=trainer.guard.bounded("every rank to finish the checkpoint"))


def _finalize_under_mpi4py():
    """Let an uncaught Preempted end MPI normally under `python -m mpi4py` (how hyparflow-run
    starts a script), which otherwise aborts the job at a non-zero SystemExit and has Open MPI
    print its MPI_ABORT banner: every rank agreed to stop here, so none waits for another."""
    run = sys.modules.get("mpi4py.run")
    original = getattr(run, "set_abort_status", None)
    if original is None or getattr(original, "preempted_exits_cleanly", False):
        return

    def set_abort_status(status):
        if not isinstance(status, Preempted):
            original(status)

    set_abort_status.preempted_exits_cleanly = True
    run.set_abort_status = set_abort_status


def check_restored(cbs, iterations):
    """Refuse a backup whose weights and record come from two saves (a job killed between
    Keras' two writes of one backup: the weights are renamed into place, then the record is
    written): resuming from it would train some steps twice, silently. `iterations`: the
    optimizer's steps the restored weights hold. (Where the record says none, as Keras'
    own saves at an epoch's end: nothing to compare.)"""
    from keras import callbacks as callbacks_module

    from hyparflow.keras import keras_private
    from hyparflow.mpi.guard import Guard

    for cb in cbs.callbacks.callbacks:
        if not isinstance(cb, callbacks_module.BackupAndRestore):
            continue
        path = keras_private.backup_metadata_path(cb)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            recorded = json.load(f).get(ITERATIONS_KEY)
        if recorded is not None and int(recorded) != iterations:
            raise Guard.mark_agreed(ValueError(
                f"BackupAndRestore(backup_dir={cb.backup_dir!r}): its weights hold "
                f"{iterations} optimizer steps, but its record ({os.path.basename(path)}) was "
                f"written after {recorded}: the job was stopped between the two writes of one "
                "backup, and resuming would train steps twice. Remove the folder to start "
                "afresh (or resume by hand from a ModelCheckpoint)."))


def steps_done(cbs, epoch):
    """Steps of `epoch` a preempted run finished, from the user's BackupAndRestore backup (0:
    none, or a backup written at an epoch's end)."""
    from keras import callbacks as callbacks_module

    from hyparflow.keras import keras_private

    for cb in cbs.callbacks.callbacks:
        if isinstance(cb, callbacks_module.BackupAndRestore):
            path = keras_private.backup_metadata_path(cb)
            if os.path.exists(path):
                with open(path) as f:
                    meta = json.load(f)
                if meta.get("epoch") == epoch and meta.get(STEPS_KEY):
                    return int(meta[STEPS_KEY])
    return 0
