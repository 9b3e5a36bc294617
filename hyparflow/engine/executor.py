"""Walks this rank's actions: receive → compute → send; then allreduce and apply."""

import numpy as np
import tensorflow as tf

from hyparflow import trace as trace_
from hyparflow.data import batches
from hyparflow.engine import buckets as buckets_
from hyparflow.engine import schedule as schedule_
from hyparflow.engine.stage import StageWorker, differentiable, to_numpy
from hyparflow.engine.step_graph import StepGraph
from hyparflow.engine.tied import Tied
from hyparflow.engine.whole_step import WholeStep
from hyparflow.keras import batch_norm, reduction
from hyparflow.keras import optimizers as optimizers_
from hyparflow.keras.user_loss import UserLoss
from hyparflow.mpi import comm as comm_
from hyparflow.mpi import sums
from hyparflow.mpi.guard import Guard

# The spec of a stage's loss sum (the model's own loss logic): one float32, no batch axis.
LOSS_SPEC = (None, np.dtype(np.float32))


def _spec(array):
    """The TensorSpec of a micro-batch's input (a sparse or ragged one's own spec)."""
    if isinstance(array, np.ndarray):
        return tf.TensorSpec(np.shape(array), tf.as_dtype(array.dtype))
    return tf.type_spec_from_value(array)


class Chunk:
    """One stage a rank holds (`Topology.stages`): its worker, where its inputs come from and
    its outputs go, and their specs.

    Stages are numbered along the model; with the interleaved schedule a rank holds
    several (stage c·P + p on rank p), otherwise its own place in the pipeline.
    """

    def __init__(self, partition, index, model, optimizer, functional, tensors, structures,
                 labelled):
        V = len(partition.stages)
        self.index = index
        self.stage = st = partition.stages[index]
        self.is_last = index == V - 1
        self.worker = StageWorker(st, model, self.is_last, functional,
                                  scale_loss=None if optimizer is None else optimizer.scale_loss,
                                  structures=structures, labelled=labelled,
                                  others=V - 1 if self.is_last else 0,
                                  find_half=optimizers_.loss_scaled(optimizer))
        # Where each received input comes from: (input position, producer stage, producer slot).
        self.receives = []
        for j, (key, src) in enumerate(zip(st.input_keys, st.sources)):
            if src is not None:
                slot = partition.stages[src].output_keys.index(key)
                self.receives.append((j, src, slot))
        n = len(st.input_keys)
        # The other stages' loss sums, received after the inputs (`StageWorker.others`).
        self.loss_receives = [(n + k, k, len(partition.stages[k].output_keys))
                              for k in range(self.worker.others)]
        watched = set(self.worker.watched)
        # The received inputs partial errors go back through, in the worker's order.
        self.error_routes = [r for r in self.receives + self.loss_receives if r[0] in watched]
        self.sends_errors = [True] * len(self.error_routes)
        spec = {k: (tuple(tensors[k].shape[1:]), np.dtype(tensors[k].dtype))
                for k in st.input_keys + st.output_keys
                if k in tensors and str(tensors[k].dtype) != "string"}  # (data inputs only)
        self.input_specs = [spec.get(k) for k in st.input_keys] + \
            [LOSS_SPEC] * len(self.loss_receives)
        self.output_specs = [spec.get(k) for k in st.output_keys]
        # Where each output slot goes (the loss sum's: to the last stage).
        self.destinations = list(st.destinations)
        if self.worker.sends_loss:
            self.destinations.append([V - 1])
            self.output_specs.append(LOSS_SPEC)
        # Partial errors that are never sent: (output slot, consumer stage) pairs whose
        # consumer's loss does not depend on that tensor; agreed once (`_agree_errors`).
        self.silent = set()
        self.picks = []  # where the stage's data inputs are among the rank's reads
        self.x_order = []  # where each model input is among them, to pass them as x
        self.traced = None  # (specs, y, sw) of the last micro-batch prepared
        # micro-batch → the shapes of its outputs as its forward made them, where an output's
        # length is unknown (a partial error that never comes is zeros of that shape)
        self.shapes = {} if any(s is not None and comm_.dynamic(s[0])
                                for s in self.output_specs) else None


class Executor:
    """Trains the stages one rank holds of one replica (one, or with the interleaved schedule
    several: `Chunk`), exchanging boundary tensors with MPI.

    Message shapes and dtypes come from the stage models and the micro-batch
    sizes, which every rank derives alike, so no shapes are negotiated; a tensor
    with an axis the model leaves unknown (a sequence's length, which may change
    from batch to batch) carries its shape in a message before it
    (`comm.Messages.send_shaped`). Each boundary tensor is identified by its
    position in the producing stage's outputs; its MPI tag also carries the
    micro-batch and the direction.
    """

    def __init__(self, partition, topology, pipeline_comm, stage_comm, model, optimizer, guard,
                 clip_norm=None, structures=None, labelled=None, shard=None, job=None,
                 bucket_bytes=None):
        """`optimizer` is this stage's own optimizer (`optimizers.stage_copy`), or None;
        `clip_norm` the user's global_clipnorm when the stage optimizer does not clip;
        `structures` the (x, y, sample_weight) `data.Structure`s the user gave and `labelled`
        which outputs have targets (how the model's compute_loss takes them). With `shard`
        (`shard.Shard` of this stage's variables over its replicas) the optimizer is built
        over this rank's share of them and `job` is the communicator of every rank (global
        norms and finite checks span the owners). `bucket_bytes`: the gradient buckets'
        size when the stage has replicas (`buckets.cap`: None hyparflow's choice, 0 one
        allreduce after the backward)."""
        self.partition = partition
        self.topology = topology
        self.pipeline = pipeline_comm
        self.replicas = stage_comm
        V = len(partition.stages)
        functional = partition.graph.functional if partition.graph else None
        # The model's own loss logic: each other stage sends its loss sum to the last
        # stage as one more boundary tensor, in the slot after its outputs (`UserLoss`).
        sums = UserLoss.needed(model) and V > 1
        self.slots = max(len(st.output_keys) for st in partition.stages) + int(sums) or 1
        tensors = partition.graph.tensors if partition.graph is not None else {}
        self.chunks = [Chunk(partition, s, model, optimizer, functional, tensors, structures,
                             labelled) for s in topology.stages]
        self._chunk_of = {c.index: c for c in self.chunks}
        # BatchNormalization as model.fit trains it over micro-batches and replicas (while
        # hf.fit defers it): the pools recomputation restores with the stages' own state
        self.norms = batch_norm.Norms(
            batch_norm.of([c.stage.model for c in self.chunks]), stage_comm,
            lambda r: self._wait(r, f"the synchronized BatchNormalization sums of step "
                                    f"{self._steps} over the stage's replicas", None, None))
        for c in self.chunks:
            c.worker.state += self.norms.state(c.stage.model)
        self.optimizer = optimizer
        self.shard = shard
        # The gradient sums reduced bucket by bucket, overlapping the step's last backward
        # (one stage a rank: a rank holding several reduces them after its last backward).
        self.buckets = None
        if optimizer is not None and shard is None and stage_comm is not None and \
                stage_comm.Get_size() > 1 and bucket_bytes != 0 and len(self.chunks) == 1:
            self.buckets = buckets_.Reducer(stage_comm, bucket_bytes, record=self._record)
            self.chunks[0].worker.buckets = self.buckets
        # global_clipnorm at P > 1 or sharded: the norm is combined over the stages (and
        # owners) here, the stage optimizer does not clip; each variable's place in the
        # model's order. The ranks that hold a share of the gradients: the pipeline, or
        # (sharded) every rank.
        self.clip = clip_norm
        self._holders = job if shard is not None else pipeline_comm
        # Weights several stages hold (a layer called on each): their gradients summed over
        # the pipeline after the replicas' (`Tied`); one stage a rank, not sharded.
        self.tied = None
        if partition.tied and pipeline_comm is not None and pipeline_comm.Get_size() > 1:
            layers = sorted(partition.tied_layers())
            if len(self.chunks) > 1 or shard is not None:
                raise Guard.mark_agreed(ValueError(  # (the same partition on every rank)
                    f"{'schedule=interleaved' if len(self.chunks) > 1 else 'shard_optimizer=True'}"
                    f" with weights that several stages hold ({', '.join(layers)}: a layer "
                    "called on each): their gradients are summed over one stage a rank, "
                    "unsharded. Use schedule='1f1b' (or 'gpipe', 'zb-h1') and "
                    "shard_optimizer=False, or a split that keeps the layer's calls together."))
            self.tied = Tied(partition, topology.stage, self.variables)
        where = {id(v): k for k, v in enumerate(model.trainable_variables)}
        self.positions = self._share([  # (a tied weight's norm counted by its first holder)
            None if self.tied is not None and j in self.tied.unreported else where[id(v)]
            for j, v in enumerate(self.variables)])
        # The model inputs this rank reads from the data, in the order it gets them: each
        # stage's it holds, then (for the model's own loss logic on the last stage) the others.
        self.reads = []
        for c in self.chunks:
            self.reads += [k for k in c.stage.data_positions if k not in self.reads]
        last = self.chunks[-1]
        if last.worker.user is not None and last.worker.user.takes_x and last.is_last:
            n = len(partition.graph.functional.inputs)
            self.reads += [k for k in range(n) if k not in self.reads]
            last.x_order = [self.reads.index(k) for k in range(n)]
        for c in self.chunks:  # where each stage's data inputs are among the reads
            c.picks = [self.reads.index(k) for k in c.stage.data_positions]
        self._training = True  # the mode of the last step
        self.total_variables = len(where)
        self.guard = guard  # bounded waits (hyparflow.mpi.guard)
        self._apply = None
        self._masks_checked = False
        self._steps = 0
        self._full = None
        self._tags_checked = set()
        self.recorder = trace_.SILENT  # hf.fit(trace=...) puts a Recorder here
        self._pool = comm_.BufferPool()
        self.schedule = schedule_.by_name("gpipe")
        self.recompute = False
        self.step_graph = None  # a `StepGraph` when each step runs as one graph
        self.microbatches = None  # the call's m (None: each batch's default)
        self._valid = set()
        self._prepared = set()  # (stage, micro-batch size, function) traced ahead (`_prepare`)
        self._errors_agreed = False  # which partial errors are sent (`_agree_errors`)
        # Replicas whose stages know what a backward teaches (the first `_fed`), and a
        # communicator of the stage's replicas of its own, on which a replica that has not
        # yet run a backward learns what one teaches (`_adopt`) while the gradients'
        # allreduces may already run on the stage's.
        self._fed = 0
        self._aside = comm_.dup(stage_comm) if stage_comm is not None and \
            stage_comm.Get_size() > 1 else None
        # Who sends to whom, for validating schedules against this partition.
        producers = {st.index: {p for p in st.sources if p is not None}
                     for st in partition.stages}
        consumers = {st.index: {d for ds in st.destinations for d in ds}
                     for st in partition.stages}
        for k in range(V - 1) if sums else ():  # every stage's loss sum goes to the last
            producers[V - 1].add(k)
            consumers[k].add(V - 1)
        self.producers = {k: sorted(v) for k, v in producers.items()}
        self.consumers = {k: sorted(v) for k, v in consumers.items()}
        # one stage: a step whose gradients Python need not see, one compiled function
        self.whole = WholeStep(self) if WholeStep.usable(self) else None

    def chunk(self, stage):
        """The `Chunk` of `stage`, one this rank holds."""
        return self._chunk_of[stage]

    @property
    def variables(self):
        """The trainable variables of the stages this rank holds, in stage order."""
        return self._per_variable("variables")

    def _per_variable(self, name):
        """A list over `variables` of each worker's `name` list."""
        return [x for c in self.chunks for x in getattr(c.worker, name)]

    def configure(self, schedule, recompute, step_graph=False, microbatches=None):
        """The `schedule.Traits` (a chunked one for a rank holding several stages), whether
        the stage's forwards keep only their inputs, recomputed in the backward, whether
        each training step runs as one graph (`StepGraph`; not with `recompute`; needed by
        a schedule that splits its backwards in B and W), and the call's `microbatches`
        (None: each batch's default; every replica knows it, `WholeStep.runs`), for the
        next steps."""
        schedule.refuse_without_step_graph(
            step_graph, f"schedule={schedule.name!r} with step_graph={step_graph!r}")
        self.schedule = schedule
        self.recompute = recompute
        self.microbatches = microbatches
        if not step_graph:
            self.step_graph = None
        elif self.step_graph is None:
            self.step_graph = StepGraph(self)

    def _lowered(self, m):
        """Every stage's actions for m micro-batches as they run (`schedule.lower`), checked
        once per schedule and m against the partition's wiring."""
        full = schedule_.lower(schedule_.build(self.schedule, self.topology.partitions, m,
                                               self.topology.chunks))
        key = (self.schedule, m)
        if key not in self._valid:
            schedule_.simulate(full, self.producers, self.consumers)  # raises if it cannot run
            self._valid.add(key)
        return full

    def _check_tags(self, m):
        """Every message tag of m micro-batches must fit under the MPI's largest tag."""
        if self.pipeline is None or self.pipeline.Get_size() == 1 or m in self._tags_checked:
            return
        v = self.topology.chunks
        largest = comm_.tag(m - 1, self.slots - 1, comm_.BACKWARD_TAG, self.slots, v * v - 1,
                            v * v)
        bound = sums.reserved_tag_floor() - 1  # above: the replicas' rings (`sums`)
        if largest > bound:
            raise ValueError(
                f"microbatches={m} with {self.slots} boundary tensors per stage needs MPI tags "
                f"up to {largest}, but this MPI allows at most {bound}. Use fewer micro-batches "
                f"(at most {bound // (2 * self.slots * v * v)}) or fewer partitions.")
        self._tags_checked.add(m)

    def _tag(self, i, slot, direction, producer, consumer):
        """The MPI tag of `producer`'s output `slot` for `consumer` (or of its partial error
        coming back), micro-batch `i`."""
        P, v = self.topology.partitions, self.topology.chunks
        return comm_.tag(i, slot, direction, self.slots, producer // P * v + consumer // P, v * v)

    def _post_receives(self, messages, schedule, sizes, losses=True):
        """Post every receive this rank's actions will need (`losses` False: no stage's loss
        sum, when predicting); returns {(kind, stage, i): [...]}."""
        posted = {}
        P = self.topology.partitions
        for a in schedule:
            n, c = sizes[a.i], self.chunk(a.stage)
            if a.kind == schedule_.WEIGHT:  # computed from what its B kept: no message
                continue
            if a.kind in (schedule_.FORWARD, schedule_.FUSED):  # a fused action's: none back
                reqs = []
                for j, src, slot in c.receives + (c.loss_receives if losses else []):
                    shape, dtype = c.input_specs[j]
                    req, buf = self._recv(
                        messages, n, shape, dtype, src % P,
                        self._tag(a.i, slot, comm_.FORWARD_TAG, src, a.stage),
                        ("F", a.stage, a.i, j))
                    reqs.append((j, req, buf))
                posted[("F", a.stage, a.i)] = reqs
            else:
                reqs = []
                for slot, dsts in enumerate(c.destinations):
                    shape, dtype = c.output_specs[slot]
                    if not dsts or not differentiable(dtype):
                        continue
                    for d in dsts:
                        if (slot, d) in c.silent:
                            continue
                        req, buf = self._recv(
                            messages, n, shape, dtype, d % P,
                            self._tag(a.i, slot, comm_.BACKWARD_TAG, a.stage, d),
                            ("B", a.stage, a.i, slot, d))
                        reqs.append((slot, d, req, buf))
                posted[("B", a.stage, a.i)] = reqs
        return posted

    def _recv(self, messages, n, shape, dtype, source, tag_, key):
        """Post the receive of a boundary tensor of `n` samples (`shape` without the batch
        axis), or of its shape first when an axis of it is unknown (`comm.Shaped`)."""
        if comm_.dynamic(shape):
            return messages.recv_shaped(1 + len(shape), dtype, source, tag_, self._pool, key)
        return messages.recv(comm_.message_shape(n, shape), dtype, source, tag_, self._pool,
                             key)

    def _send(self, messages, buffer, shape, dest, tag_):
        """Send a boundary tensor (numpy), its shape first when the model leaves an axis of
        it (`shape`) unknown."""
        if comm_.dynamic(shape):
            messages.send_shaped(buffer, dest, tag_)
        else:
            messages.send(buffer, dest, tag_)

    def _arrived(self, request, buffer, what, peer, action, i):
        """Wait for a posted receive (`_recv`) through the watchdog: its buffer (a shaped
        message's after its shape came, and then the tensor)."""
        with self.recorder.span("recv wait", i, peer=peer):
            self._wait(request, what, peer, action)
            if isinstance(buffer, comm_.Shaped):
                request, buffer = buffer.payload()
                self._wait(request, what, peer, action)
        return buffer

    def train_step(self, sizes, x_micro, y_micro, global_batch, sw_micro=None):
        """One optimizer step over this replica's micro-batches.

        Args:
            sizes: samples in each of this replica's micro-batches.
            x_micro: per micro-batch, the list of model-input arrays this stage reads.
            y_micro: per micro-batch, the list of target arrays (last stage), else None.
            global_batch: samples in the whole global batch (all replicas).
            sw_micro: per micro-batch, the list of sample-weight arrays per output
                (last stage, when weighted), else None.

        Returns:
            This rank's contribution to the step's loss (summed over all ranks it
            gives the mean loss of the global batch).
        """
        m = len(sizes)
        self._check_tags(m)
        self._full = self._lowered(m)
        actions = self._full[self.topology.stage]
        self._prepare(actions, sizes, x_micro, y_micro, sw_micro)
        self._settled(True)
        messages = comm_.Messages(self.pipeline)
        posted = self._post_receives(messages, actions, sizes)
        y_micro = y_micro or [None] * m
        sw_micro = sw_micro or [None] * m
        # the micro-batch whose accumulation completes the step's sums (None: no samples here)
        final = next((a.i for a in reversed(actions) if a.kind != schedule_.FORWARD), None)
        whole = self.whole is not None and self.whole.runs(actions, global_batch)
        try:
            if whole:  # forward, backward, the sum over replicas and the update: one graph
                loss = self._whole_step(actions[0], x_micro[0], y_micro[0], sw_micro[0],
                                        sizes[0] / global_batch,
                                        posted.pop(("F", actions[0].stage, actions[0].i)))
            else:
                run = self._run_actions if self.step_graph is None else self.step_graph.run
                loss = run(actions, sizes, x_micro, y_micro, sw_micro, global_batch, posted,
                           messages, final)
            self.norms.apply()  # the moving statistics, once a step
            with self.recorder.span("send wait"):
                messages.wait_sends(lambda reqs: self._wait(
                    reqs, f"its sends of step {self._steps} to complete", None, None))
            self._adopt(global_batch)
            self._check_masks(m, any(w is not None for w in sw_micro))
            if not whole:
                self._step()
        finally:  # an error every rank raised alike leaves nothing armed or running
            if self.buckets is not None:
                self.buckets.abort()
        self.recorder.next_step()
        self._steps += 1
        self.guard.first_step = False
        return loss

    def _adopt(self, global_batch):
        """After a step whose batch of `global_batch` samples leaves replicas that never had
        samples without any (fewer samples than replicas; every rank knows which), those
        take what replica 0's backward taught its stages (`Worker.record`: which gradients
        exist, which are sparse, ...), so that they exchange their empty gradients as the
        others exchange theirs. Once: they are then as the others."""
        R = self.topology.replicas
        if self._aside is None or self._fed == R:
            return
        self._fed = batches.fed(self._fed, global_batch, R)
        if self._fed == R:
            return
        records = comm_.allgather_objects(
            [c.worker.record() for c in self.chunks] if self.topology.replica == 0 else None,
            self._aside, wait=lambda r: self._wait(
                r, f"replica 0's record of its backward (step {self._steps})", None, None))
        for c, record in zip(self.chunks, records[0]):
            c.worker.adopt(record)
        self._fed = R

    def _run_actions(self, actions, sizes, x_micro, y_micro, sw_micro, global_batch, posted,
                     messages, final):
        """This rank's actions of a training step, one compiled function each (`StepGraph.run`
        takes the same arguments); returns the step's loss contribution."""
        loss = 0.0
        for a in actions:
            scale = sizes[a.i] / global_batch
            if self.buckets is not None and a.i == final and a.kind != schedule_.FORWARD:
                self.buckets.arm()  # this action's accumulation completes the sums
            if a.kind == schedule_.FUSED:
                loss += self._forward_backward(a, x_micro[a.i], y_micro[a.i], sw_micro[a.i],
                                               scale, posted.pop(("F", a.stage, a.i)), messages)
            elif a.kind == schedule_.FORWARD:
                loss += self._forward(a, x_micro[a.i], y_micro[a.i], sw_micro[a.i], scale,
                                      posted.pop(("F", a.stage, a.i)), messages)
            else:
                self._backward(a, posted.pop(("B", a.stage, a.i)), messages, sizes[a.i])
        return loss

    def _prepare(self, actions, sizes, x_micro, y_micro, sw_micro, infer=False, loss=True):
        """Trace, on every rank at once, what this step's micro-batch sizes run for the first time.

        With `infer`, the inference function of `infer_step` (evaluate; predict
        without `loss`).
        One stage has no chain of stages waiting on each other's first run to break:
        nothing is prepared, the first micro-batch traces as it runs.
        """
        if self.topology.partitions == 1 or not sizes:
            # (no samples here: this replica's pipeline agrees on its partial errors and
            # logs when it has some; `_adopt` tells it the gradients meanwhile)
            return
        for a in actions:
            if a.kind in (schedule_.BACKWARD, schedule_.WEIGHT):
                continue
            n, c = sizes[a.i], self.chunk(a.stage)
            kind = ("infer" if loss else "predict") if infer else \
                "traced" if self.step_graph is not None else \
                "fused" if a.kind == schedule_.FUSED else \
                "recompute" if self.recompute else "forward"
            key = (a.stage, n, kind)
            if key in self._prepared:
                continue
            self._prepared.add(key)
            specs = [None] * len(c.stage.input_keys)
            for j, k in zip(c.stage.data_inputs, c.picks):
                specs[j] = _spec(x_micro[a.i][k])
            for j, _, _ in c.receives:
                shape, dtype = c.input_specs[j]
                specs[j] = tf.TensorSpec((n,) + shape, tf.as_dtype(dtype))
            if loss:
                specs += [tf.TensorSpec((), tf.float32)] * len(c.loss_receives)
            specs += [_spec(x_micro[a.i][k]) for k in c.x_order]
            ys = y_micro[a.i] if c.is_last and y_micro else None
            sws = sw_micro[a.i] if ys is not None and sw_micro else None
            c.worker.prepare(specs, ys, sws, kind)
            c.traced = (specs, ys, sws)
        settled = True  # which variables have gradients is known (not if outputs were dropped)
        if not infer and not self._errors_agreed:
            settled = not self._agree_errors()
        user = self.chunks[-1].worker.user
        if user is not None and loss and (not infer) not in user.keys:
            reports = comm_.allgather_objects(
                [c.worker.user.report(c.index, not infer) for c in self.chunks],
                self.pipeline,
                wait=lambda r: self._wait(r, "every stage's report on its losses", None, None))
            reports = [r for held in reports for r in held]
            for c in self.chunks:
                c.worker.user.settle(reports, not infer)
        has_gradient = self._per_variable("has_gradient")
        if not infer and settled and any(has_gradient) and self._apply is None:
            has = self._share(has_gradient)  # perhaps nothing with a gradient
            if any(has):
                self._optimizer_step().get_concrete_function(
                    [tf.TensorSpec(v.shape, v.dtype) if g else None
                     for v, g in zip(self.updated_variables, has)])

    def _agree_errors(self):
        """Which partial errors carry a gradient, agreed over the pipeline once (collective);
        returns whether a stage here stopped differentiating any output.

        Each stage has traced its backward (`prepare`) and knows which received inputs
        its loss depends on. From the last stage back, each stage tells the others
        (one small broadcast per stage); a producer stops differentiating a tensor no
        consumer's loss depends on (it feeds only an output compiled with loss None),
        finds again what its remaining outputs depend on, and tells the stages before
        it in turn. Such a partial error is neither sent nor waited for, and the
        variables that only it feeds get None, as in Keras (zeros would still move
        them under weight decay or momentum).
        """
        self._errors_agreed = True
        P, V = self.topology.partitions, len(self.partition.stages)
        dropped = False
        for s in range(V - 1, 0, -1):
            mine = None
            if s in self._chunk_of:
                c = self.chunk(s)
                mine = [(src, slot, has) for (_, src, slot), has in
                        zip(c.error_routes, c.worker.input_has_gradient)]
                c.sends_errors = [has for _, _, has in mine]
            report = comm_.allgather_objects(
                mine, self.pipeline,
                wait=lambda r: self._wait(r, f"stage {s}'s list of the partial errors it sends",
                                          None, None))[s % P]
            for src, slot, has in report:
                if src in self._chunk_of and not has:
                    self.chunk(src).silent.add((slot, s))
            if s - 1 in self._chunk_of:  # every later stage (all its consumers) has reported
                c = self.chunk(s - 1)
                dead = [slot for slot in c.worker.targets
                        if all((slot, d) in c.silent for d in c.destinations[slot])]
                if dead:
                    c.worker.drop_targets(dead, *c.traced)
                    dropped = True
        return dropped

    def infer_step(self, sizes, x_micro, y_micro, batch, keep_outputs=False, sw_micro=None):
        """Forwards only, in inference mode, over this replica's micro-batches.

        Args:
            sizes, x_micro: as for `train_step`.
            y_micro: per micro-batch the targets (last stage, evaluating), else None.
            batch: samples in the whole batch (all replicas).
            keep_outputs: return the last stage's outputs (predict).
            sw_micro: per micro-batch the sample weights with `y_micro`, else None.

        Returns:
            (loss contribution, outputs): outputs is, on the last stage with
            `keep_outputs`, per micro-batch the model's outputs as numpy arrays in
            its output structure; else empty.
        """
        with self.recorder.paused():  # a trace's steps are training steps
            return self._infer(sizes, x_micro, y_micro, batch, keep_outputs, sw_micro)

    def _infer(self, sizes, x_micro, y_micro, batch, keep_outputs, sw_micro):
        m = len(sizes)
        self._check_tags(m)
        self._full = schedule_.forward_only(self.topology.partitions, m, self.topology.chunks)
        messages = comm_.Messages(self.pipeline)
        actions = self._full[self.topology.stage]
        self._prepare(actions, sizes, x_micro, y_micro, sw_micro, infer=True,
                      loss=not keep_outputs)
        if not keep_outputs:
            self._settled(False)
        posted = self._post_receives(messages, actions, sizes, losses=not keep_outputs)
        loss, kept = 0.0, []
        for a in actions:
            c = self.chunk(a.stage)
            inputs = self._inputs(a, x_micro[a.i], posted.pop(("F", a.stage, a.i)),
                                  losses=not keep_outputs)
            ys = y_micro[a.i] if c.is_last and y_micro is not None else None
            sws = sw_micro[a.i] if ys is not None and sw_micro is not None else None
            with self.recorder.span("forward", a.i, stage=a.stage):
                outputs, aux = c.worker.infer(inputs, ys, sws, sizes[a.i] / batch,
                                              loss=not keep_outputs)
            self.send_outputs(a, outputs, messages)
            if keep_outputs and c.is_last:
                kept.append(c.worker.pack([o if isinstance(o, tf.RaggedTensor) else np.array(o)
                                           for o in outputs]))  # (a ragged output as it is)
            loss += float(aux)
        messages.wait_sends(lambda reqs: self._wait(
            reqs, "its sends of an inference step to complete", None, None))
        if not keep_outputs:
            self._check_masks(m, sw_micro is not None)
        self.guard.first_step = False
        return loss, kept

    def _check_masks(self, m, weighted):
        """Refuse, alike on every replica, a loss averaged over the entries a mask keeps when
        the batch is cut (`reduction.check`): a subclassed model's masks are seen only as
        its last stage traces (a graph's are checked before any message)."""
        worker = self.chunks[-1].worker  # the last stage's, if this rank holds it
        if not worker.masked or self._masks_checked:
            return
        names = list(getattr(worker.model, "output_names", None) or ["output"])
        try:
            reduction.check(worker.model, names, [True] * len(names), weighted, False,
                            self.topology.partitions, self.topology.replicas, m)
        except ValueError as exc:  # refused again at every later call
            raise Guard.mark_agreed(exc)
        self._masks_checked = True

    def _settled(self, training):
        """Steps of this mode follow (what `metric_keys` reads)."""
        self._training = training

    @property
    def metric_keys(self):
        """The logs' keys the model's own compute_metrics gives steps of the last step's mode
        (`user_loss.UserLoss.keys`, agreed on every rank), or None."""
        user = self.chunks[-1].worker.user
        return None if user is None else user.keys.get(self._training)

    def _inputs(self, action, xs, reqs, losses=True):
        """The inputs of `action`'s stage model (a forward, or a fused one), once its posted
        receives (`reqs`) have arrived (`arrange`)."""
        got = self.received(action, reqs)
        return self.arrange(action.stage, xs, {j: buf for (j, _, _), buf in zip(reqs, got)},
                            losses)

    def arrange(self, stage, xs, received, losses=True):
        """The inputs of `stage`'s model from the data this rank reads (`xs`, in `reads`
        order) and the boundary tensors received ({input position: tensor}); then, for the
        model's own loss logic on the last stage, the other stages' loss sums (unless
        `losses` is False: predicting) and the model's inputs."""
        c = self.chunk(stage)
        n = len(c.stage.input_keys)
        inputs = [None] * (n + (len(c.loss_receives) if losses else 0))
        for j, k in zip(c.stage.data_inputs, c.picks):
            inputs[j] = xs[k]
        for j, tensor in received.items():
            inputs[j] = tensor
        return inputs + [xs[k] for k in c.x_order]

    def received(self, action, reqs):
        """The buffers of `action`'s posted receives (`reqs`: (input position, request,
        buffer)), once each has arrived."""
        c = self.chunk(action.stage)
        i, n = action.i, len(c.stage.input_keys)
        got = []
        for j, req, buf in reqs:
            if j < n:
                src, what = c.stage.sources[j], f"the activations {c.stage.input_names[j]!r}"
            else:
                src = j - n
                what = f"the sum of stage {src}'s losses (add_loss, regularizers)"
            got.append(self._arrived(req, buf, f"{what} of micro-batch {i}", src, action, i))
        return got

    def _forward_backward(self, action, xs, ys, sws, scale, reqs, messages):
        i = action.i
        inputs = self._inputs(action, xs, reqs)
        with self.recorder.span("forward+backward", i, stage=action.stage):
            aux, grads = self.chunk(action.stage).worker.forward_backward(i, inputs, ys, sws,
                                                                          scale)
        self.send_partial_errors(action, grads, messages)
        return float(aux)

    def _whole_step(self, action, xs, ys, sws, scale, reqs):
        inputs = self._inputs(action, xs, reqs)
        with self.recorder.span("forward+backward", action.i, stage=action.stage):
            # (a loss the cut batch cannot average is refused before any weight moves)
            return self.whole.run(inputs, ys, sws, scale,
                                  traced=lambda: self._check_masks(1, sws is not None))

    def send_partial_errors(self, action, grads, messages):
        """Send `action`'s partial errors (numpy, in its worker's watched order) to the stages
        that produced those inputs."""
        c, P = self.chunk(action.stage), self.topology.partitions
        for (j, src, slot), g, sent in zip(c.error_routes, grads, c.sends_errors):
            if sent:
                self._send(messages, g, c.input_specs[j][0], src % P,
                           self._tag(action.i, slot, comm_.BACKWARD_TAG, src, action.stage))

    def _forward(self, action, xs, ys, sws, scale, reqs, messages):
        i = action.i
        inputs = self._inputs(action, xs, reqs)
        c = self.chunk(action.stage)
        with self.recorder.span("forward", i, stage=action.stage):
            outputs, aux = c.worker.forward(i, inputs, ys if c.is_last else None,
                                            sws if c.is_last else None, scale, self.recompute)
        self.send_outputs(action, outputs, messages)
        return float(aux)

    def send_outputs(self, action, outputs, messages):
        """Send `action`'s outputs (tensors; its loss sum's last, if sent) to their consumer
        stages."""
        c, P = self.chunk(action.stage), self.topology.partitions
        if c.shapes is not None:
            c.shapes[action.i] = [tuple(t.shape) for t in outputs]
        for slot, dsts in enumerate(c.destinations[:len(outputs)]):  # no loss: predicting
            if dsts:
                buf = to_numpy(outputs[slot])
                for d in dsts:
                    self._send(messages, buf, c.output_specs[slot][0], d % P,
                               self._tag(action.i, slot, comm_.FORWARD_TAG, action.stage, d))

    def _backward(self, action, reqs, messages, n):
        partial_errors = self.partial_errors(action, reqs, n)
        with self.recorder.span("backward", action.i, stage=action.stage):
            grads = self.chunk(action.stage).worker.backward(action.i, partial_errors)
        self.send_partial_errors(action, grads, messages)

    def partial_errors(self, action, reqs, n):
        """The partial errors of `action` (a backward on `n` samples), in its worker's
        `targets` order, from its posted receives (`reqs`), summed over consumers; zeros
        for an output its consumers do not differentiate."""
        c, i = self.chunk(action.stage), action.i
        summed = {}
        for slot, peer, req, buf in reqs:
            name = repr(c.stage.output_names[slot]) if slot < len(c.stage.output_names) \
                else "this stage's loss sum"
            buf = self._arrived(req, buf, f"the partial errors of {name} for micro-batch {i}",
                                peer, action, i)
            summed[slot] = buf if slot not in summed else summed[slot] + buf
        partial_errors = []
        for slot in c.worker.targets:
            if slot in summed:
                partial_errors.append(summed[slot])
            else:  # sent to a stage that does not differentiate it
                shape, dtype = c.output_specs[slot]
                if comm_.dynamic(shape):  # as this micro-batch's forward made it
                    partial_errors.append(np.zeros(c.shapes[i][slot], dtype))
                else:
                    partial_errors.append(np.zeros(comm_.message_shape(n, shape), dtype))
        return partial_errors

    def _wait(self, requests, what, peer_stage, action):
        """Wait through the watchdog; its report shows the step's schedule, `action` marked."""
        top = self.topology
        peer = None if peer_stage is None else top.where(top.rank_of(top.replica, peer_stage))
        if action is not None:
            what += f" (action {action})"

            def context():
                return [f"Step {self._steps} of this fit, schedule {self.schedule.name}, "
                        f"{len({a.i for a in self._full[0]})} micro-batches; the waiting "
                        "action is marked:",
                        schedule_.render(self._full, mark={action})]
        else:
            def context():
                return []
        self.guard.context = context
        self.guard.wait(requests, what, peer)

    def _step(self):
        """Allreduce this stage's gradients over replicas, then take the optimizer step.

        Under a LossScaleOptimizer with several stages, the stages first agree
        whether all their gradients are finite, so that every rank applies or
        skips the step and moves the loss scale alike, as one process would.
        """
        if self.optimizer is None:
            return
        grads = [g for c in self.chunks for g in c.worker.gradients()]
        if self.shard is not None:  # this rank's share, summed over replicas
            what = (f"the gradient reduce-scatter of step {self._steps} over the "
                    f"{self.shard.replicas} replicas of stage {self.topology.stage}")
            with self.recorder.span("allreduce"):
                grads = self.shard.reduce_scatter(
                    grads, wait=lambda r: self._wait(r, what, None, None))
        elif self.replicas is not None and self.replicas.Get_size() > 1 and grads:
            with self.recorder.span("allreduce"):
                grads = self._combine_replicas(grads)
        if self.tied is not None:
            with self.recorder.span("allreduce"):
                grads = self.tied.combine(grads, self.pipeline, lambda r: self._wait(
                    r, f"the tied weights' gradients of step {self._steps} over the "
                       "stages that hold them", None, None))
        scaled = optimizers_.loss_scaled(self.optimizer)
        # Keras sums some float16 gradients over the whole batch at once, where an overflow
        # is inf; hyparflow sums their parts in float32: judged before any clipping.
        beyond = scaled and optimizers_.beyond_half(
            grads, self._share(self._per_variable("in_half")))
        if self.clip:
            grads = optimizers_.clip_by_global_norm(
                grads, self.positions, self.total_variables, self.clip,
                self.optimizer.dynamic_scale if scaled else self.optimizer.loss_scale_factor,
                self._holders,
                lambda r: self._wait(r, f"every stage's gradient norms of step {self._steps} "
                                        "(global_clipnorm)", None, None))
        finite = not beyond
        if scaled and self._holders is not None and self._holders.Get_size() > 1:
            finite = optimizers_.agreed_finite(
                grads, self._holders,
                lambda r: self._wait(r, f"the verdict of every stage on step {self._steps}'s "
                                        "gradients (finite or not)", None, None), beyond)
        with self.recorder.span("optimizer"):
            if not any(g is not None for g in grads):
                optimizers_.step_without_variables(self.optimizer, finite)
            else:
                if not finite:
                    grads = optimizers_.poisoned(grads)
                self._optimizer_step()(optimizers_.as_tensors(grads))
        if self.shard is not None:
            self._gather_shards()

    def _gather_shards(self):
        """Every replica's variables take their owners' new values (sharded optimizer)."""
        what = (f"the weights all-gather of step {self._steps} over the "
                f"{self.shard.replicas} replicas of stage {self.topology.stage}")
        with self.recorder.span("allreduce"):
            self.shard.all_gather(wait=lambda r: self._wait(r, what, None, None))

    def _share(self, per_variable):
        """A list over the stage's variables, cut to this rank's share of them (sharded)."""
        return per_variable if self.shard is None else [per_variable[k] for k in self.shard.owned]

    @property
    def updated_variables(self):
        """The variables this rank's optimizer updates: its share (sharded), else the stage's."""
        return self.shard.owned_variables if self.shard is not None else self.variables

    def optimizer_state(self, wait=None):
        """{name: array}: the stage optimizer's whole state (every owner's share, sharded)."""
        if self.shard is not None:
            return self.shard.state(self.optimizer, wait=wait)
        return optimizers_.stage_state(self.optimizer)

    def finalize(self, variables):
        """Model.fit's end of training (EMA: the variables take their moving averages), on
        `variables` as the optimizer was built over them; sharded, on this rank's share,
        then every replica gets them."""
        if self.shard is not None:
            optimizers_.finalize(self.optimizer, self.shard.owned_variables)
            self._gather_shards()
        else:
            optimizers_.finalize(self.optimizer, variables)

    def over_replicas(self, what):
        """The wait (through the watchdog) for `what` of this step over the stage's
        replicas."""
        what = (f"{what} of step {self._steps} over the {self.replicas.Get_size()} "
                f"replicas of stage {self.topology.stage}")
        return lambda requests: self._wait(requests, what, None, None)

    def _combine_replicas(self, grads):
        """Every replica's gradients: dense ones summed (one fused allreduce), sparse ones
        (IndexedSlices) concatenated in replica order, as one process lists their rows."""
        wait = self.over_replicas("the gradient allreduce")
        grads = list(grads)
        dense = [k for k, g in enumerate(grads)
                 if g is not None and not isinstance(g, tf.IndexedSlices)]
        if self.buckets is not None:
            worker = self.chunks[0].worker  # (buckets: the rank holds one stage)
            local = set(dense)
            summed = self.buckets.finish(
                worker.sums, lambda k: grads[k].numpy() if k in local else None, wait)
        else:
            summed = dict(zip(dense, comm_.allreduce_sum([grads[k].numpy() for k in dense],
                                                         self.replicas, wait=wait)))
        for k in dense:
            grads[k] = summed[k]
        for k, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                indices, values = comm_.allgather_rows(
                    [g.indices.numpy(), g.values.numpy()], self.replicas, wait=wait)
                grads[k] = tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                                            g.dense_shape)
        return grads

    def _record(self, kind, i, start, end):
        """A span of this step measured elsewhere (the bucket reducer's) on the timeline."""
        self.recorder.add(kind, i, start, end)

    def _optimizer_step(self):
        """The compiled optimizer update of this stage's variables (built on first use)."""
        if self._apply is None:
            self._apply = optimizers_.compiled_apply(self.optimizer, self.updated_variables)
        return self._apply
