"""Elastic jobs, the ranks' side: hf.fit backs its training state up at agreed step boundaries
and, run again on fewer ranks after a loss, resumes from the backup with fewer replicas.

On when ``$HYPARFLOW_ELASTIC`` names a folder every node sees (`hyparflow-run --elastic` sets
it; a site ``mpirun`` user exports it). Then each ``hf.fit`` call of the script:

* without a ``BackupAndRestore`` of the user's, gets one in ``<folder>/fit-<k>`` (the script's
  k-th call), kept after the call ends, so that a script run again passes over the calls it
  finished (restored at their end) and resumes the one that was cut short;
* writes its backup every ``$HYPARFLOW_BACKUP_SECONDS`` (default 300) at a step boundary the
  ranks agree on (rank 0's clock, carried by the preemption watch's per-step agreement), with
  the steps of the epoch done, so that a rerun resumes at the next step (arrays: their order
  is replayed; other inputs resume at the epoch's start, as Keras does);
* at ``partitions × replicas`` larger than the job (a run again on the ranks left), trains
  with the replicas that fit: each takes a larger share of every batch, the optimizer steps
  are the same (resuming at another P × R is exact);
* tells the launcher, on rank 0, the partitions and where the ranks run (``job.json``), which
  it reads to choose the next launch (`hyparflow.restart`).
"""

import itertools
import json
import os
import sys
import time

import numpy as np

ENV = "HYPARFLOW_ELASTIC"  # the folder of the backups and of job.json
SECONDS_ENV = "HYPARFLOW_BACKUP_SECONDS"
DEFAULT_SECONDS = 300.0
JOB_FILE = "job.json"
_CALLS = [0]  # the ordinal of this process's next hf.fit call under elastic


def folder():
    """The elastic folder (absolute), or None: not an elastic job."""
    value = os.environ.get(ENV, "").strip()
    return os.path.abspath(value) if value else None


def interval():
    """Seconds between two backups, from ``$HYPARFLOW_BACKUP_SECONDS``."""
    value = os.environ.get(SECONDS_ENV, "").strip()
    if not value:
        return DEFAULT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"${SECONDS_ENV}={value!r}: use a number of seconds ≥ 0 between two "
                         "backups of an elastic job (0: at every step).")
    return seconds


def fitted(a, world_size):
    """The call `a` (an `arguments.Call` of hf.fit) as an elastic job runs it on `world_size`
    ranks: with the backup callback, and fewer replicas where the job lost ranks."""
    from keras import callbacks as callbacks_module

    from hyparflow.keras import keras_private
    from hyparflow.mpi import comm as comm_

    where = folder()
    if where is None:
        return a
    interval()  # (a bad value: its error on every rank, before any message)
    _mark_at_exit(where)
    call = _CALLS[0]
    _CALLS[0] += 1
    asked, a = a, resized(a, world_size)
    first = (comm_.world().Get_rank() if comm_.lost_world_ranks() else comm_.launched_rank()) == 0
    if a.replicas != asked.replicas and first:
        sys.stderr.write(
            f"hyparflow: elastic job on {world_size} ranks: hf.fit asked for partitions="
            f"{a.partitions} × replicas={asked.replicas}; training at {a.partitions} × "
            f"{a.replicas} (each replica takes a larger share of every batch).\n")
        sys.stderr.flush()
    if a.model is not None:  # (a call that has no backup yet starts at its first epoch)
        keras_private.forget_restored_epoch(a.model)
    listed = list(a.callbacks or [])
    if not any(isinstance(cb, callbacks_module.BackupAndRestore) for cb in listed):
        listed.append(callbacks_module.BackupAndRestore(
            os.path.join(where, f"fit-{call}"), save_freq="epoch", delete_checkpoint=False))
    return a.replace(callbacks=listed)


_MARKING = []


def _mark_at_exit(where):
    """At this rank's normal exit, ``done-<world rank>`` in `where`: a job whose ranks
    outlive one that dies (ULFM) exits 0 without it, and the launcher, seeing a rank that
    neither ended its script nor was gone on without, runs the job again."""
    from hyparflow.mpi import comm as comm_

    if _MARKING or not comm_.launched():
        return
    _MARKING.append(where)
    rank = comm_.launched_rank()  # (now: at exit, MPI may be finalized)

    def mark():
        try:
            os.makedirs(where, exist_ok=True)
            open(os.path.join(where, f"{DONE}{rank}"), "w").close()
        except OSError:
            pass
        if comm_.lost_world_ranks():
            # After a rank's death, Open MPI 5.0.11's MPI_Finalize (after this, in mpi4py's exit)
            # hangs now and then under ULFM (2 of 6 runs of a bare mpi4py script that kills a
            # rank, shrinks and acknowledges; it completes in < 1 s otherwise): the script is
            # done, the kernel ends the process if it does (SIGALRM; under ULFM mpiexec then
            # still exits 0, and the mark is here).
            import signal

            signal.alarm(FINALIZE_WAIT)

    import atexit

    atexit.register(mark)


def resized(a, world_size):
    """`a` with ``replicas = world_size / partitions`` where an elastic job runs on fewer ranks
    than ``partitions × replicas`` and a multiple of ``partitions`` (else as given: the
    launch's usual error follows)."""
    P, R = a.partitions, a.replicas
    if folder() is None or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                   for v in (P, R)):
        return a
    if world_size < P * R and world_size >= P and world_size % P == 0:
        return a.replace(replicas=world_size // P)
    return a


class Clock:
    """Rank 0's say on when the next backup is due (the others follow the agreement)."""

    def __init__(self, leads):
        self.every = interval() if folder() is not None else None
        self.leads = leads
        self.last = time.monotonic()

    def due(self):
        """Whether this rank asks for a backup at this boundary."""
        return (self.every is not None and self.leads
                and time.monotonic() - self.last >= self.every)

    def written(self):
        self.last = time.monotonic()


def record(trainer, callbacks):
    """Rank 0 writes the job's partitions, replicas, where its ranks run (by their number in
    MPI_COMM_WORLD, as mpiexec names them: the placement the trainer gathered) and this
    call's backup folder into ``job.json``."""
    from keras import callbacks as callbacks_module

    from hyparflow.mpi import placement

    where = folder()
    top = trainer.topology
    if where is None or top.rank != 0:
        return
    entries = trainer.placement or [{"node": placement.node_name(), "world_rank": 0}]
    nodes = {}
    for e in sorted(entries, key=lambda e: e["world_rank"]):
        nodes.setdefault(e["node"], []).append(e["world_rank"])
    backups = [os.path.abspath(cb.backup_dir) for cb in callbacks or ()
               if isinstance(cb, callbacks_module.BackupAndRestore)]
    job = {"partitions": top.partitions, "replicas": top.replicas, "nodes": nodes,
           "backup": backups[0] if backups else None}
    _write_json(os.path.join(where, JOB_FILE), job)


LOST_FILE = "lost.json"  # the ranks a job could not go on without, for the launcher
GONE_FILE = "in-place.json"  # the ranks it went on without
DONE = "done-"  # + a world rank: that rank's script ended (read when the job exits 0)
LAUNCH_FILES = (LOST_FILE, GONE_FILE, DONE)  # what one launch's ranks tell the launcher
FINALIZE_WAIT = 10  # seconds a rank that went on in place gives MPI_Finalize
SURVIVORS_WAIT = 120.0  # seconds the survivors of a loss wait for each other to agree on it


def fault_tolerant():
    """Whether this job's ranks outlive one that dies (Open MPI's ``--with-ft ulfm``, which
    `hyparflow-run --elastic` asks for): then an elastic job may go on in place."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "") == "1"


def merges_each_step(trainer):
    """Whether the replicas make their non-trainable state one at every step (as for a batch
    hook that reads weights): where a job that may go on in place has state each replica
    updates on its own samples (BatchNormalization's statistics), so that a lost replica's
    share of it is not lost with it."""
    from hyparflow.keras import replica_state

    top = trainer.topology
    return (refusal(trainer, training=True) is None and top.replicas > 1
            and bool(replica_state.held(trainer.partition, top)))


def refusal(trainer, training=False):
    """Why this call cannot go on in place after a loss (None: it can), on every rank alike
    (`training`: judge the trainer as if it trained now)."""
    if folder() is None:
        return "not an elastic job (start it with hyparflow-run --elastic)"
    if not fault_tolerant():
        return "its MPI does not let the ranks outlive one that dies (mpiexec --with-ft ulfm)"
    if trainer is None or trainer.resumable is None and not training:
        return "the loss came before hf.fit began training"
    top = trainer.topology
    if top.partitions > 1 and top.replicas == 1:
        return f"at partitions={top.partitions} the lost rank's stage has no copy left"
    if getattr(trainer.executor, "shard", None) is not None:
        return "with shard_optimizer=True the lost replicas held a share of the optimizer"
    if not trainer.resumable and not training:
        return ("its input is not replayed from a step: a generator, a tf.data.Dataset, a "
                "PyDataset, or steps_per_execution > 1")
    return None


class Kept:
    """What a step's forward changes before the step is known finished — the non-trainable
    state (BatchNormalization's statistics, a layer's counters) and the seed generators'
    counters — of the stages this rank holds (`models`), as of the last step it finished
    (`reached`): a survivor's model then holds that step's weights beside the next step's
    statistics, which going on in place would count twice."""

    def __init__(self, models):
        from hyparflow.keras import keras_private

        self.variables, self.counters, listed = [], set(), set()
        for model in models:
            # (a frozen layer's weights, and BatchNormalization's statistics in one, stay as
            # they are: not kept, at no cost)
            still = {id(v) for v in model.trainable_variables} | {
                id(v) for layer in model._flatten_layers(include_self=False)
                if not layer.trainable for v in layer.variables}
            # (their seeds are this replica's while it trains, `streams.apart`: counters only)
            generators = keras_private.seed_generators(model)
            self.counters |= {id(g.state) for g in generators}
            for v in list(model.variables) + [g.state for g in generators]:
                if id(v) not in still and id(v) not in listed:
                    listed.add(id(v))
                    self.variables.append(v)
        self.values = {}

    def take(self):
        self.values = {id(v): np.array(v.numpy()) for v in self.variables}

    def of(self, variable):
        """`variable`'s value as of the last step finished (its current one if not kept)."""
        now = np.array(variable.numpy())
        kept = self.values.get(id(variable))
        if kept is None:
            return now
        if id(variable) in self.counters:
            now[1] = kept[1]
            return now
        return kept


def keeps(trainer):
    """A `Kept` of the model `trainer` trains, where an elastic job could go on in place from
    it, else None (nothing to keep: no cost)."""
    if refusal(trainer, training=True) is not None or not trainer.resumable:
        return None
    return Kept([trainer.partition.stages[s].model for s in trainer.topology.stages])


def reached(trainer, position, settled=True):
    """`trainer` finished the step at `position` (epoch, index; `Trainer.position`);
    `settled=False`: its replicas have yet to make their state one (`merges_each_step`), so
    that a loss before they do leaves this rank's state that step short of the others'."""
    trainer.position = position
    trainer.settled = settled
    if trainer.kept is not None:
        trainer.kept.take()


def _nodes_of(ranks):
    from hyparflow.mpi import placement

    names = placement.NODES
    return sorted({names[r] for r in ranks if r < len(names)})


def _write_json(path, obj, replace=True):
    """`obj` into `path` in one rename (the folder made if missing); `replace=False`: not over
    a file there already (returns whether it was written)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    if replace:
        os.replace(tmp, path)
        return True
    try:
        os.link(tmp, path)
        return True
    except OSError:
        return False
    finally:
        os.remove(tmp)


def _who(lost):
    """The MPI_COMM_WORLD ranks `lost` in words: "rank 3 (c102)", "ranks 2, 3 (c101, c102)"."""
    nodes = ", ".join(_nodes_of(lost)) or "its node"
    return f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} ({nodes})"


def _tell_launcher(lost, replace=False):
    """Write ``lost.json`` for the launcher: the MPI_COMM_WORLD ranks `lost` (empty: not
    known which); unless one is there already (`replace`: the survivors' agreed word)."""
    where = folder()
    if where is None:
        return
    path = os.path.join(where, LOST_FILE)
    if os.path.exists(path) and not replace:
        return
    # (never over the survivors' agreed word, written meanwhile)
    _write_json(path, {"ranks": lost, "nodes": _nodes_of(lost)}, replace=replace)


def _on_loss(exc):
    """A rank ends on a loss no hf call went on from (`guard.LOSS_HOOKS`): the launcher is told
    which ranks it knows lost, so that it runs the job again."""
    from hyparflow.mpi import comm as comm_

    try:
        known = comm_.failed_world_ranks(comm_.mpi().COMM_WORLD)
    except Exception:
        known = []
    known = set(known) - set(comm_.left_world_ranks())  # (those that left: not failed)
    if known:  # (none known: another rank's MPI_Abort, say, whose job must not run again)
        _tell_launcher(sorted(known | set(comm_.lost_world_ranks())))


def ended(exc, trainer, world, why=None):
    """A loss this job cannot go on from in place (`refusal`, or `why`): the survivors agree
    on the ranks lost, and the first of them tells the launcher (``lost.json``: it runs the
    script again on what is left) and says it in the one line returned (a `RanksLost` whose
    ``speaks`` is False on the others; ``agreed``: every survivor took part, and ends on it)."""
    from hyparflow.mpi import comm as comm_
    from hyparflow.mpi import guard as guard_

    why = why or refusal(trainer)
    agreed = False
    try:  # (bounded: a survivor that never comes leaves it to what each knows)
        survivors, lost = comm_.shrink(SURVIVORS_WAIT)
        first, agreed = survivors.Get_rank() == 0, True
    except Exception:
        try:
            lost = comm_.failed_world_ranks(world) if world is not None else []
        except Exception:
            lost = []
        everyone = set(range(comm_.mpi().COMM_WORLD.Get_size()))
        first = comm_.launched_rank() == min(everyone - set(lost) - set(
            comm_.lost_world_ranks()) - set(comm_.left_world_ranks()))
    lost = sorted(set(lost) | set(comm_.lost_world_ranks()))  # (and those an earlier loss took)
    where = folder()
    if first:
        _tell_launcher(lost, replace=True)
    who = _who(lost) if lost else "a rank"
    after = (" hyparflow-run --elastic runs it again from its backup."
             if where is not None else "")
    told = guard_.RanksLost(f"hyparflow: {who} of the job failed; training cannot go on in "
                           f"place: {why}. The job ends.{after}")
    told.speaks = first
    told.agreed = agreed  # (every survivor ends on it: `Guard.fail`)
    return told


class NotInPlace(Exception):
    """The survivors of a loss cannot go on in place; its text says why."""


def _key(position):
    return (-1, -1) if position is None else tuple(position)


def holders(stands, partitions):
    """From each survivor's word (its last finished step, `Trainer.position`, its place in
    the pipeline, `Topology.stage`, and whether its replicas' state is one at that step,
    `Trainer.settled`), the step to go on from — the furthest one some survivor of every
    stage finished and settled — and per stage the first survivor that did (by rank in
    `stands`). Raises `NotInPlace` where a stage has no survivor, or no step is one every
    stage's survivors reached alike (a stage updated for a step another never finished; a
    loss while the replicas made their state one: the lost replica's share of it is gone)."""
    at, positions, unsettled = {}, {}, set()
    for rank, (position, stage, settled) in enumerate(stands):
        if not settled:
            unsettled.add(stage)
            continue
        at.setdefault(stage, {}).setdefault(_key(position), rank)
        positions[_key(position)] = position
    missing = [q for q in range(partitions) if q not in at]
    if missing and missing[0] in unsettled:
        raise NotInPlace(f"the loss came while stage {missing[0]}'s replicas made their "
                         "state one (BatchNormalization's statistics): the lost replica's "
                         "share of it is gone")
    if missing:
        raise NotInPlace(f"stage {missing[0]} of {partitions} has no copy left")
    common = set.intersection(*(set(at[q]) for q in range(partitions)))
    if not common:
        raise NotInPlace("no step is one every stage's survivors finished alike (the loss came "
                         "between two stages' updates)")
    best = max(common)
    return positions[best], [at[q][best] for q in range(partitions)]


def _stage_state(trainer, q, holder, world, wait):
    """Stage `q`'s weights (its `Kept` state as of the step gone on from) and its optimizer's
    state, from survivor `holder` to every survivor of `world` (collective): its weights set in
    this rank's model, its optimizer's returned ({name: array})."""
    from hyparflow.engine.stage import to_tensor
    from hyparflow.keras import optimizers as optimizers_
    from hyparflow.keras import variables as variables_
    from hyparflow.mpi import comm as comm_

    top, mine = trainer.topology, world.Get_rank() == holder
    variables, seen = [], set()
    for stage in trainer.partition.stages[q::top.partitions]:  # (the stages place q holds)
        for v in stage.model.variables:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
    state = optimizers_.stage_state(trainer.executor.optimizer) if mine else {}
    specs = comm_.broadcast_object(  # (dtype objects: bfloat16's str, "<V2", is no dtype)
        [(name, np.shape(a), np.asarray(a).dtype) for name, a in state.items()],
        holder, world, wait)
    kept = trainer.kept if mine and trainer.kept is not None and trainer.kept.values else None
    arrays = itertools.chain(
        ((kept.of(v) if kept is not None else variables_.value(v)) for v in variables),
        (state[name] if mine else np.empty(shape, dtype) for name, shape, dtype in specs))
    done, optimizer = 0, []
    for group in comm_.broadcast_chunks(arrays, holder, world, wait):  # (a message at a time)
        now = variables[done:done + len(group)]
        variables_.assign(now, map(to_tensor, group[:len(now)]))
        optimizer += [np.array(a) for a in group[len(now):]]  # (a view of the message: copied)
        done += len(now)
    return {name: a for (name, _, _), a in zip(specs, optimizer)}


class Went:
    """Where a job that went on in place stands: its world (None on a survivor that leaves:
    no stage for it), the ranks lost and those that left (MPI_COMM_WORLD's numbers), and the
    step it goes on after."""

    def __init__(self, world, lost, left, position):
        self.world, self.lost, self.left, self.position = world, lost, left, position


def go_on(model, trainer, callbacks):
    """After a loss (every survivor, collectively): the job without the failed ranks, every
    stage's model and optimizer from the survivor of that stage that finished the step
    every stage reached (`holders`) on every survivor (`model`: the user's, trained by
    `trainer`), and a backup at that step, from which the call resumes at the next step
    (`hyparflow.api.fit` runs it again at the replicas left). Survivors beyond
    partitions × the replicas left leave the job (`leave`). Returns a `Went`."""
    from keras import callbacks as callbacks_module

    from hyparflow.keras import keras_private
    from hyparflow.keras import optimizers as optimizers_
    from hyparflow.mpi import comm as comm_
    from hyparflow.mpi import guard as guard_
    from hyparflow.training import preemption

    world, lost = comm_.shrink(SURVIVORS_WAIT)
    top = trainer.topology
    wait = guard_.bounded(world, "every survivor's word on where training stands (elastic)")
    stands = comm_.allgather_objects((trainer.position, top.stage, trainer.settled), world,
                                     wait)
    position, holding = holders(stands, top.partitions)
    states = [_stage_state(trainer, q, holder, world, guard_.bounded(
        world, f"survivor {holder}'s model and optimizer of stage {q} (elastic)"))
        for q, holder in enumerate(holding)]
    optimizers_.give_state(trainer.user_optimizer, model.trainable_variables, states, top.stage)
    if position is not None and world.Get_rank() == 0:
        epoch, step = position
        iterations = int(trainer.user_optimizer.iterations.numpy()) \
            if trainer.user_optimizer is not None else 0
        for cb in callbacks or ():
            if isinstance(cb, callbacks_module.BackupAndRestore):
                # Keras' own save of the whole model and optimizer (here as on every survivor),
                # not hf.fit's, whose collective is the lost world's (a rank that did not write
                # joined the writer's: `callbacks._follow`)
                training = cb.model
                keras_private.undo_redirected_saves(cb)  # (`callback_list` redoes it anew)
                cb.set_model(model)
                try:
                    keras_private.save_backup(cb, epoch, step, True, {
                        preemption.STEPS_KEY: step + 1, preemption.ITERATIONS_KEY: iterations})
                finally:
                    cb.set_model(training)
    stay = top.partitions * (world.Get_size() // top.partitions)
    left = sorted(comm_.world_order(world)[stay:])
    if world.Get_rank() == 0 and folder() is not None:  # (for the launcher's count, `DONE`)
        _write_json(os.path.join(folder(), GONE_FILE), {
            "ranks": comm_.lost_world_ranks(),
            "left": sorted(set(comm_.left_world_ranks()) | set(left))})
    comm_.barrier(world, guard_.bounded(world, "the survivors' backup (elastic)"))
    guard_.forget_job()
    narrowed = comm_.keep_first(world, stay) if stay < world.Get_size() else world
    if narrowed is None:
        leave()
    return Went(narrowed, lost, left, position)


def leave():
    """A survivor with no stage in the job that goes on (more survivors than partitions ×
    the replicas left) ends its process here, its script done for the launcher (``done-``):
    the others train on, as a job run again on the ranks left would leave it out."""
    from hyparflow.mpi import comm as comm_

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    where = folder()
    if where is not None:
        try:
            open(os.path.join(where, f"{DONE}{comm_.launched_rank()}"), "w").close()
        except OSError:
            pass
    # (without MPI_Finalize, which would wait for the others' end, and hang if they end on a
    # later loss; to the others' receives from any rank, a failure of a rank known to have
    # left, `guard.check_left`; an exit 0 lets their MPI_Finalize complete, where an exit 1
    # was seen to hang it)
    os._exit(0)


def went_on_line(went, top, epochs):
    """The line rank 0 prints when a job went on in place (`top`: the topology before the loss,
    `epochs`: the call's)."""
    position, size = went.position, went.world.Get_size()
    after = ("from the call's start" if position is None else
             "with nothing left to train" if position[0] >= epochs else
             f"from epoch {position[0] + 1}, step {position[1] + 2}")
    n = len(went.left)
    leaving = (f"; {_who(went.left)} leave{'s' if n == 1 else ''} the job (no stage for "
               f"{'it' if n == 1 else 'them'})" if n else "")
    return (f"hyparflow: elastic job: {_who(went.lost)} lost; "
            f"training goes on in place at {top.partitions} × {size // top.partitions} "
            f"on {size} ranks {after} (the lost replicas' share of each batch taken by "
            f"the others){leaving}.")


def joined(earlier, later):
    """`later` (a History) with the epochs of `earlier` (the History of the same call before a
    loss: the epochs that ended before it) in front: the call's whole history."""
    if earlier is None or later is None or earlier is later:
        return later
    later.history = {k: list(earlier.history.get(k, [])) + list(later.history.get(k, []))
                     for k in dict.fromkeys(list(earlier.history) + list(later.history))}
    later.epoch = list(earlier.epoch) + list(later.epoch)
    return later


def _register():
    from hyparflow.mpi import guard as guard_

    if _on_loss not in guard_.LOSS_HOOKS:
        guard_.LOSS_HOOKS.append(_on_loss)


_register()
