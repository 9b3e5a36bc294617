"""Keras callbacks on every rank, logs combined over replicas, the progress bar on one rank."""

import numpy as np
from keras import callbacks as callbacks_module

from hyparflow import comm as comm_


def callback_list(model, callbacks, verbose, epochs, steps, is_logging_rank):
    """A Keras CallbackList with History on every rank and the progress bar on one."""
    if verbose == "auto":
        verbose = 1
    return callbacks_module.CallbackList(
        callbacks, add_history=True, add_progbar=bool(verbose) and is_logging_rank,
        model=model, verbose=verbose if is_logging_rank else 0, epochs=epochs, steps=steps)


class StepLogs:
    """Combines the loss and metrics of all ranks into the logs `Model.fit` would show.

    The loss of a step is the sum of every rank's contribution (data loss on last
    stages, regularisation anywhere). Metrics live on the last stage; their state
    variables (totals and counts) are summed over replicas, which reproduces the
    metric of the whole global batch exactly for Keras' built-in metrics. One
    allreduce and one broadcast per step give every rank the same logs.
    """

    def __init__(self, model, topology, world, is_last, guard):
        self.model = model
        self.guard = guard
        self.topology = topology
        self.world = world
        self.is_last = is_last
        self.tracker = model._loss_tracker
        self.metrics = self.state = self.names = None

    def _prepare(self):
        """Find the metric state and agree on the logs' layout (collective; once).

        Deferred to the first `reset`, when the last stage has built its compiled
        loss and metrics, so that `predict` never needs them.
        """
        self.metrics = [m for m in self.model.metrics if m is not self.tracker]
        self.state = [v for m in self.metrics for v in m.variables] if self.is_last else []
        layout = None
        if self.topology.rank == self.topology.logging_rank:
            layout = (sum(int(np.prod(v.shape)) for v in self.state), list(self._results()))
        if self.world is not None and self.world.Get_size() > 1:
            layout = self.world.bcast(layout, root=self.topology.logging_rank)
        self.state_size, self.names = layout

    def _wait(self, request, what):
        self.guard.context = None
        self.guard.wait(request, what)

    def reset(self):
        """Start an epoch (or an evaluation): zero the running loss and every metric."""
        if self.names is None:
            self._prepare()
        self.total = 0.0
        self.count = 0
        if self.tracker is not None:
            self.tracker.reset_state()
        for m in self.metrics:
            m.reset_state()

    def _results(self):
        out = {}
        for m in [self.tracker] + self.metrics if self.tracker is not None else self.metrics:
            r = m.result()
            if isinstance(r, dict):
                out.update({k: float(v) for k, v in r.items()})
            else:
                out[m.name] = float(r)
        return out

    def step(self, contribution, batch_size):
        """Combine one step's contributions; returns the running logs of the epoch."""
        vec = np.zeros(1 + self.state_size, np.float64)
        vec[0] = contribution
        if self.state:
            vec[1:] = np.concatenate([np.ravel(v.numpy()) for v in self.state])
        multi = self.world is not None and self.world.Get_size() > 1
        if multi:
            self._wait(self.world.Iallreduce(comm_.mpi().IN_PLACE, vec, op=comm_.mpi().SUM),
                       "the allreduce of the step's loss and metrics over all ranks")
        self.total += float(vec[0]) * batch_size
        self.count += batch_size
        values = np.zeros(len(self.names), np.float64)
        if self.topology.rank == self.topology.logging_rank:
            local = [v.numpy() for v in self.state]
            offset = 0
            for v in self.state:
                n = int(np.prod(v.shape))
                v.assign(vec[1 + offset:1 + offset + n].reshape(v.shape).astype(v.dtype))
                offset += n
            if self.tracker is not None:
                self.tracker.total.assign(self.total)
                self.tracker.count.assign(self.count)
            results = self._results()
            values[:] = [results[k] for k in self.names]
            for v, value in zip(self.state, local):
                v.assign(value)
        if multi:
            self._wait(self.world.Ibcast(values, root=self.topology.logging_rank),
                       "the step's logs from the logging rank")
        return dict(zip(self.names, (float(v) for v in values)))
