"""A stage's whole training step as one compiled function (the step graph): its actions chained
in the schedule's order, the messages between stages Python ops inside it."""

import time

import tensorflow as tf

from hyparflow.engine import schedule as schedule_
from hyparflow.engine.python_ops import PythonOps
from hyparflow.engine.stage import _as_tensors, open_axes, relaxed, to_numpy
from hyparflow.mpi import comm as comm_


class StepGraph:
    """Runs one stage's actions of a training step as one `tf.function`.

    The executor's way runs each action as its own compiled function and hands
    a non-last stage's forward to its backward through a tape: every
    intermediate tensor the backward needs leaves the forward's graph, so
    TensorFlow's graph optimiser (Grappler's remapper) cannot fuse across a
    forward and its backward. Here every forward, backward and fused action of
    the step is traced into one graph, in the schedule's order: each action
    starts after the previous one ended (control dependencies), so the stage
    runs exactly the executor's sequence of actions and messages, and the same
    arithmetic (the forward, `tape.gradient`, the sums), compiled together.

    Receives and sends are `tf.py_function`s calling the executor's own code:
    the receives the executor posted before the step, waited for through the
    watchdog; the sends, nonblocking, completed after the step. An error raised
    in one (a watchdog report, a peer's failure) is kept and raised again as
    itself once TensorFlow has stopped the step. The gradient buckets are armed
    from one more such op before the step's last accumulation.

    Each (schedule, m, micro-batch sizes) is traced once, and again for new
    input shapes, except along the axes the model leaves unknown (a sequence's
    length: traced open, as Keras traces a dataset's batches); the first run
    compiles (for a deep stage, seconds per micro-batch), worth it over many
    steps, and its waits get the watchdog's first-step allowance.

    A backward split in B and W (ZB-H1) runs B as `_Taped.split_backward` and W,
    later, from what B kept (`_Weights`).

    The timeline records each receive's wait, and each action's compute as the
    time from the end of its receives to the start of its sends (a W's: to its end).
    """

    def __init__(self, executor):
        self.executor = executor
        self._functions = {}  # the lowered actions of a step → its tf.function
        self._ops = PythonOps()  # what a Python op raised, raised again after the step
        self._running = None  # (posted receives, Messages) of the step that runs
        self._clock = 0.0  # when the last Python op of the step ended (the timeline)
        self._opened = set()  # the keys of `_functions` traced with unknown axes open

    def run(self, actions, sizes, x_micro, y_micro, sw_micro, global_batch, posted, messages,
            final):
        """Run the step's `actions` (this stage's, lowered) as one graph.

        Args:
            actions: this stage's actions of the step.
            sizes, x_micro, y_micro, sw_micro, global_batch: as `Executor.train_step`
                takes them (y_micro, sw_micro: a list per micro-batch, Nones included).
            posted: the receives the executor posted ({(kind, i): [...]}), taken as the
                actions need them.
            messages: the step's `comm.Messages` (its sends are completed by the caller).
            final: the micro-batch whose accumulation completes the step's sums (the
                gradient buckets are armed before it), or None.

        Returns:
            This rank's contribution to the step's loss, summed in action order.
        """
        key = (tuple(actions), final, tuple(sizes))
        function = self._functions.get(key)
        if function is None:
            # traced and compiled as it first runs, on every rank at once (the sizes are
            # every rank's): its waits get the watchdog's first-step allowance
            self.executor.guard.first_step = True
            function = self._functions[key] = tf.function(
                lambda xs, ys, sws, scales: self._step(actions, final, sizes, xs, ys, sws,
                                                       scales))
        xs, ys, sws, scales = [], [], [], []
        for xm, ym, swm, n in zip(x_micro, y_micro, sw_micro, sizes):
            inputs, y, sw, scale = _as_tensors(xm, ym, swm, n / global_batch)
            xs.append(inputs)
            ys.append(y)
            sws.append(sw)
            scales.append(scale)
        if key not in self._opened and any(c.worker.open for c in self.executor.chunks):
            self._opened.add(key)
            function.get_concrete_function(*self._specs(xs, ys, sws, scales))
        self._running, self._clock = (posted, messages), time.perf_counter()
        try:
            with self._ops.raised():  # raised in a Python op: as itself
                losses, rows = function(xs, ys, sws, scales)
        finally:
            self._running = None
        for stage, held in rows.items():
            for i, kept in held.items():
                self.executor.chunk(stage).worker._keep_rows(i, kept)
        return sum(float(loss) for loss in losses)

    def _specs(self, xs, ys, sws, scales):
        """The step function's argument specs, the axes the model leaves unknown open: the
        data read here (model inputs, `Executor.reads`), the last stage's targets and
        sample weights."""
        ex = self.executor
        functional = ex.partition.graph.functional
        axes = [open_axes(functional.inputs[k]) for k in ex.reads]
        last = ex.chunks[-1].worker
        specs = [[relaxed(t, a) for t, a in zip(x, axes)] for x in xs]
        targets = [last.specs([], y, sw)[1:] if last.is_last else (y, sw)
                   for y, sw in zip(ys, sws)]
        return (specs, [t[0] for t in targets], [t[1] for t in targets],
                [tf.TensorSpec((), tf.float32)] * len(scales))

    def _step(self, actions, final, sizes, xs, ys, sws, scales):
        """The graph of the step: (each forward's loss in action order, {stage: {micro-batch:
        its sparse rows per variable}})."""
        ex = self.executor
        ended = []  # the previous action's end: the next starts after it
        kept, losses, rows = {}, [], {}
        split = {(a.stage, a.i) for a in actions if a.kind == schedule_.WEIGHT}
        for a in actions:
            i, c = a.i, ex.chunk(a.stage)
            worker = c.worker
            with tf.control_dependencies(ended):
                if a.kind == schedule_.BACKWARD:
                    seeds, received = self._receive_errors(a, sizes[i])
                elif a.kind != schedule_.WEIGHT:
                    inputs = self._receive_inputs(a, xs[i], sizes[i])
                # the accumulation that completes the sums (a split backward's: its W)
                armed = [self._python(self._arm, [], "arm")] if ex.buckets is not None and \
                    i == final and a.kind != schedule_.FORWARD and not (
                        a.kind == schedule_.BACKWARD and (a.stage, i) in split) else []
            y = ys[i] if c.is_last else None
            sw = sws[i] if c.is_last else None
            if a.kind == schedule_.FORWARD:
                record = kept[a.stage, i] = worker.taped(worker._forward_fn, inputs, y, sw,
                                                         scales[i], (a.stage, i) in split)
                losses.append(record.aux)
                ended = [self._python(self._sender(a, "forward"), record.outputs, "send",
                                      after=[record.aux])]
                continue
            if a.kind == schedule_.WEIGHT:
                with tf.control_dependencies(ended + armed):
                    _, added = kept.pop((a.stage, i)).backward(worker)
                ended = [self._python(self._recorded(a), [], "weights", after=added)]
                continue
            # a backward starts once its partial errors came (the last stage's, which takes
            # none, after its receive all the same: after the forward's sends, on the timeline)
            with tf.control_dependencies(armed + ([received] if a.kind == schedule_.BACKWARD
                                                  else [])):
                if a.kind == schedule_.FUSED:
                    loss, input_grads, rows.setdefault(a.stage, {})[i], added = \
                        worker.fused_parts(inputs, y, sw, scales[i], [])
                    losses.append(loss)
                    added = added + [loss]
                elif (a.stage, i) in split:  # B: W computes the weight gradients later
                    input_grads, rows.setdefault(a.stage, {})[i], added, \
                        kept[a.stage, i] = kept.pop((a.stage, i)).split_backward(worker, seeds)
                else:
                    input_grads, rows.setdefault(a.stage, {})[i], added = \
                        kept.pop((a.stage, i)).backward(worker, seeds)
            kind = "forward+backward" if a.kind == schedule_.FUSED else "backward"
            ended = [self._python(self._sender(a, kind), input_grads, "send", after=added)]
        with tf.control_dependencies(ended):
            return [tf.identity(loss) for loss in losses], rows

    def _python(self, body, tensors, name, out=tf.int32, after=()):
        """A Python op running `body(*tensors)` (after the `after` tensors and ops): what it
        raises is kept for `run` to raise as itself."""
        def call(*args):
            try:
                return body(*args)
            finally:
                self._clock = time.perf_counter()
        return self._ops.op(call, tensors, out, name, after)

    def _receive_inputs(self, action, xs, n):
        """A forward's (or fused action's) inputs as `Executor.arrange` gives them, in the
        graph: the data read here, ordered after the previous action; the boundary tensors
        and loss sums from a Python op that waits for them."""
        ex = self.executor
        c = ex.chunk(action.stage)
        data = [tf.nest.map_structure(tf.identity, xs[k], expand_composites=True)
                if k in c.picks or k in c.x_order else None for k in range(len(xs))]
        routes = c.receives + c.loss_receives
        received = {}
        if routes:
            def receive():
                return ex.received(
                    action, self._running[0].pop(("F", action.stage, action.i))) + [0]
            dtypes = [tf.as_dtype(c.input_specs[j][1]) for j, _, _ in routes]
            got = self._python(receive, [], "receive", out=dtypes + [tf.int32])
            for (j, _, _), t in zip(routes, got):
                t.set_shape(comm_.message_shape(n, c.input_specs[j][0]))
                received[j] = t
        return ex.arrange(action.stage, data, received)

    def _receive_errors(self, action, n):
        """A backward's partial errors (`Executor.partial_errors`), from a Python op that
        waits for them, and that op's own output (what the backward then starts after)."""
        ex = self.executor
        c = ex.chunk(action.stage)
        slots = c.worker.targets

        def receive():
            return ex.partial_errors(
                action, self._running[0].pop(("B", action.stage, action.i)), n) + [0]
        got = self._python(receive, [], "receive",
                           out=[tf.as_dtype(c.output_specs[s][1]) for s in slots] + [tf.int32])
        for s, t in zip(slots, got):
            t.set_shape(comm_.message_shape(n, c.output_specs[s][0]))
        return list(got[:len(slots)]), got[-1]

    def _sender(self, action, kind):
        """The body of `action`'s sends: its outputs (a forward) or the partial errors of
        its inputs; the action's compute, from its receives to here, on the timeline."""
        ex = self.executor

        def send(*tensors):
            ex.recorder.add(kind, action.i, self._clock, time.perf_counter(), stage=action.stage)
            messages = self._running[1]
            if action.kind == schedule_.FORWARD:
                ex.send_outputs(action, tensors, messages)
            else:
                ex.send_partial_errors(action, [to_numpy(t) for t in tensors], messages)
            return 0
        return send

    def _recorded(self, action):
        """The body of the op after a W: its compute on the timeline."""
        def record():
            self.executor.recorder.add("weights", action.i, self._clock, time.perf_counter(),
                                       stage=action.stage)
            return 0
        return record

    def _arm(self):
        self.executor.buckets.arm()
        return 0

