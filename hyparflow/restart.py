"""`hyparflow-run --elastic`: a job that lost a node or a rank runs again on what is left, from
its latest backup, up to a number of restarts.

The ranks back up and say where they run (`hyparflow.training.elastic`: ``job.json`` and
a backup per ``hf.fit`` call in the elastic folder); the launcher reads mpiexec's notice of
the loss (`run.Notices`) and chooses the next launch:

* a node lost: the job runs again on the other nodes (a host file of them replaces the
  host options given to mpiexec), on as many ranks as leave every stage a rank — a multiple
  of the partitions; the script's ``hf.fit`` trains with the replicas that fit;
* a rank killed by a signal on a node that lives (out of memory, a stray ``kill``): the job
  runs again at its size, on the same hosts; with an MPI that lets the others outlive it
  (ULFM: `hyparflow-run --elastic` asks for it) the survivors go on in place where they can
  (`elastic.go_on`: the job's end is then the launcher's), else they say which ranks they
  lost (``lost.json``), and the job runs again so;
* anything else (an exception, MPI_ABORT, the job stopped by a signal to the launcher,
  a preemption's exit code 75) ends the launcher with the job's status, as without
  ``--elastic``.

Each restart prints one line: what was lost, on how many ranks at which P × R the job runs
again, and the step its backup resumes from. A job that ends well removes what the elastic
folder holds; one that fails leaves its backups, and the same command resumes from them.
"""

import json
import os
import shutil
import sys
from dataclasses import dataclass

from hyparflow.mpi.placement import ranges
from hyparflow.training import elastic, preemption

RESTARTS = 3  # runs again after a loss, by default
# mpiexec's options that name the hosts (Open MPI and MPICH spellings)
HOST_OPTIONS = ("--hostfile", "-hostfile", "--machinefile", "-machinefile", "--host", "-host",
                "-H", "--default-hostfile", "-f")


class Refused(Exception):
    """Why a job that lost a node cannot run again (the launcher prints it, and exits with the
    job's status)."""


@dataclass
class Launch:
    """The next launch: `n` ranks, mpiexec's options `extra`, and the line that says why."""
    n: int
    extra: list
    line: str


def read_job(folder):
    """What the job's last hf.fit call recorded in ``job.json`` (None: no call did)."""
    try:
        with open(os.path.join(folder, elastic.JOB_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def without_hosts(extra):
    """mpiexec's options `extra` without those that name the hosts."""
    out, skip = [], False
    for word in extra:
        if skip:
            skip = False
        elif word in HOST_OPTIONS:
            skip = True
        elif not word.startswith(tuple(f"{o}=" for o in HOST_OPTIONS)):
            out.append(word)
    return out


def resumes_from(job):
    """Where the job's backup resumes: "from the backup after epoch 2, step 3", …"""
    path = job.get("backup") if job else None
    try:
        with open(os.path.join(path, "training_metadata.json")) as f:
            meta = json.load(f)
    except (OSError, TypeError, ValueError):
        return "from the start"
    steps = meta.get(preemption.STEPS_KEY)
    if steps:
        return f"from the backup after epoch {meta['epoch'] + 1}, step {steps}"
    return f"from the backup after epoch {meta['epoch']}"


def read_lost(folder):
    """The ranks the job's survivors said they could not go on without (``lost.json``:
    {"ranks": [...], "nodes": [...]}; no ranks: they could not tell which), or None."""
    try:
        with open(os.path.join(folder, elastic.LOST_FILE)) as f:
            reported = json.load(f)
    except (OSError, ValueError):
        return None
    return reported if isinstance(reported, dict) and isinstance(reported.get("ranks"),
                                                                 list) else None


def unfinished(folder, n):
    """After a job of `n` ranks exited 0: the world ranks that neither ended their script
    (``done-<rank>``) nor were gone on without in place, lost or left (``in-place.json``) —
    a rank that died outside any hf call while the others, outliving it (ULFM), ended well.
    Empty where no rank marked its end (a script without an elastic hf.fit call)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    done = {int(name[len(elastic.DONE):]) for name in names
            if name.startswith(elastic.DONE) and name[len(elastic.DONE):].isdigit()}
    if not done:
        return []
    try:
        with open(os.path.join(folder, elastic.GONE_FILE)) as f:
            said = json.load(f)
        gone = set(said.get("ranks", [])) | set(said.get("left", []))
    except (OSError, ValueError, AttributeError):
        gone = set()
    return sorted(set(range(n)) - done - gone)


def next_launch(n, extra, notices, job, folder, attempt, restarts, reported=None):
    """The `Launch` after a loss `notices` read (`run.Notices`) of a job of `n` ranks launched
    with mpiexec's options `extra`, or the survivors `reported` (`read_lost`); `job`: its
    ``job.json`` (or None); `attempt` of `restarts`. Raises `Refused` where the ranks left
    cannot hold every stage, or the lost node's ranks are not known."""
    P = job["partitions"] if job else None
    if notices.lost:
        node = notices.node or "(not named)"
        if job is None or notices.node is None:
            raise Refused(
                f"hyparflow-run: node {node} was lost before any hf.fit call of the job said "
                "where its ranks run: not run again (--elastic).")
        nodes = job["nodes"]
        what = f"node {node} was lost (world ranks {ranges(nodes.get(node, []))})"
        left = {host: len(ranks) for host, ranks in nodes.items() if host != node}
        count = sum(left.values())
        if count < P:
            raise Refused(
                f"hyparflow-run: {what}: the model is cut into {P} stages, each needing a "
                f"rank, and {count} rank{'s' if count != 1 else ''} are left: not run "
                "again. Resume from the backups on more nodes: the same command, with "
                "hosts for them.")
        n = P * (count // P)
        hosts = os.path.join(folder, f"hosts-{attempt}")
        with open(hosts, "w") as f:
            f.writelines(f"{host} slots={slots}\n" for host, slots in left.items())
        extra = without_hosts(extra) + ["--hostfile", hosts]
        shape = f" ({P} × {n // P}, node{'s' if len(left) > 1 else ''} {', '.join(left)})"
    elif notices.killed or reported:
        if notices.killed:
            rank, node, signum = notices.killed
            what = f"world rank {rank} (node {node}) was killed by signal {signum}"
        elif reported["ranks"]:
            ranks, nodes = reported["ranks"], reported.get("nodes") or ["not named"]
            what = (f"world rank{'s' if len(ranks) > 1 else ''} {ranges(ranks)} (node"
                    f"{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}) failed")
        else:
            what = "a rank failed (the others could not tell which)"
        extra = list(extra)
        shape = f" ({P} × {n // P})" if P else ""
    else:
        raise Refused("hyparflow-run: the job failed, and lost no node or rank: not run again.")
    return Launch(n, extra, f"hyparflow-run: elastic restart {attempt} of {restarts}: {what}; "
                            f"running again on {n} ranks{shape}, {resumes_from(job)}.")


def supervise(n, extra, launch, folder, restarts, say):
    """Run the job (`launch(n, extra)` → (status, `run.Notices`, whether the launcher was told
    to stop it)), again after each loss, up to `restarts` times; returns the last status."""
    attempt = 0
    while True:
        _forget_launch(folder)  # (what this launch's ranks report)
        code, notices, stopped = launch(n, extra)
        missing = unfinished(folder, n) if code == 0 else []
        if code == 0 and not missing:
            clean(folder)
            return 0
        if missing:  # exit 0, a rank dead: run again (the calls that ended pass over)
            say(f"the job exited 0, but world rank{'s' if len(missing) > 1 else ''} "
                f"{ranges(missing)} did not end {'their' if len(missing) > 1 else 'its'} "
                "script.")
            code = 1
        reported = read_lost(folder) or ({"ranks": missing} if missing else None)
        lost = notices.lost or notices.killed is not None or reported is not None
        if stopped or not lost or attempt >= restarts:
            if lost and not stopped:
                say(f"the job lost a {'node' if notices.lost else 'rank'} after {attempt} "
                    f"restart{'s' if attempt != 1 else ''} (--restarts {restarts}): not run "
                    "again.")
            if backed_up(folder):
                say(f"the elastic backups stay in {folder}: the same command resumes from "
                    "them (remove it to start afresh).")
            else:
                clean(folder)
            return code
        attempt += 1
        try:
            chosen = next_launch(n, extra, notices, read_job(folder), folder, attempt, restarts,
                                 reported)
        except Refused as refused:
            print(refused, file=sys.stderr, flush=True)
            return code
        print(chosen.line, file=sys.stderr, flush=True)
        n, extra = chosen.n, chosen.extra


def backed_up(folder):
    """Whether an hf.fit call of the job wrote a backup in `folder`."""
    return os.path.isdir(folder) and any(
        name.startswith("fit-") and os.listdir(os.path.join(folder, name))
        for name in os.listdir(folder))


def clean(folder):
    """Remove what the elastic job wrote in `folder` (and `folder`, if that leaves it empty)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith("fit-") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(("hosts-", elastic.JOB_FILE) + elastic.LAUNCH_FILES):
            os.remove(path)
    try:
        os.rmdir(folder)
    except OSError:
        pass


def _forget_launch(folder):
    """Remove what the ranks of a launch report (lost ranks, ranks gone on without, ends)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(elastic.LAUNCH_FILES):
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass
