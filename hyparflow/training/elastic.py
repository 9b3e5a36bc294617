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

import json
import os
import sys
import time

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
    call = _CALLS[0]
    _CALLS[0] += 1
    asked, a = a, resized(a, world_size)
    if a.replicas != asked.replicas and comm_.launched_rank() == 0:
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
    os.makedirs(where, exist_ok=True)
    path = os.path.join(where, JOB_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(job, f)
    os.replace(path + ".tmp", path)
