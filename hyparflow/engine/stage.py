"""One stage's forward and backward per micro-batch, and its gradient accumulation."""

import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow.keras import keras_private, reduction
from hyparflow.keras.user_loss import UserLoss


class _DLPack:
    """Lets numpy take an eager tensor's memory through DLPack (no copy)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, stream=None, **kwargs):
        return tf.experimental.dlpack.to_dlpack(self.tensor)

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def to_numpy(tensor):
    """A numpy view of a CPU tensor's memory (a copy for other devices), to send."""
    if isinstance(tensor, (tf.SparseTensor, tf.RaggedTensor)):
        raise ValueError(
            f"a stage boundary tensor is a {type(tensor).__name__}: stages exchange dense "
            "tensors only. Give hf.fit an explicit balance (a list of calls per stage, or "
            "the layer names that start stages) that cuts after a layer with a dense output.")
    try:
        return np.from_dlpack(_DLPack(tensor))
    except Exception:  # not on the CPU, or a dtype DLPack does not carry
        return tensor.numpy()


def to_tensor(array):
    """A tensor over a received numpy buffer, without a copy when it is aligned (a sparse or
    ragged tensor as it is)."""
    if isinstance(array, (tf.SparseTensor, tf.RaggedTensor)):
        return array
    if isinstance(array, np.ndarray) and array.flags.c_contiguous and array.ctypes.data % 64 == 0:
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except Exception:
            pass
    return tf.convert_to_tensor(array)


def _as_tensors(inputs, y, sw, scale):
    """A micro-batch's inputs, targets and sample weights (or None) and loss scale as tensors."""
    inputs = [to_tensor(t) for t in inputs]
    y = None if y is None else [to_tensor(t) for t in y]  # (a ragged target as it is)
    sw = None if sw is None else [None if w is None else tf.convert_to_tensor(w) for w in sw]
    return inputs, y, sw, tf.constant(scale, tf.float32)


def _empty(spec):
    """A sparse or ragged tensor of `spec`'s shape with no values (to trace a stage on)."""
    n = spec.shape[0]
    if isinstance(spec, tf.SparseTensorSpec):
        return tf.SparseTensor(tf.zeros((0, len(spec.shape)), tf.int64),
                               tf.zeros((0,), spec.dtype), spec.shape)
    return tf.RaggedTensor.from_row_lengths(tf.zeros((0,), spec.dtype),
                                            tf.zeros((n,), spec.row_splits_dtype))


def open_axes(tensor):
    """Which axes after the batch axis a model's (symbolic) tensor leaves unknown (None)."""
    shape = getattr(tensor, "shape", None)
    return () if shape is None else tuple(d is None for d in tuple(shape)[1:])


def relaxed(value, axes):
    """The spec of a micro-batch's tensor, array or spec `value` with the `axes` the model
    leaves unknown (`open_axes`) left open, its batch axis kept (sparse and ragged ones:
    their own spec; None stays None)."""
    if value is None:
        return None
    if isinstance(value, (tf.SparseTensor, tf.RaggedTensor)):
        return tf.type_spec_from_value(value)
    if isinstance(value, (tf.SparseTensorSpec, tf.RaggedTensorSpec)):
        return value
    shape = list(value.shape)
    for a, unknown in enumerate(axes[:len(shape) - 1], 1):
        if unknown:
            shape[a] = None
    return tf.TensorSpec(shape, tf.as_dtype(value.dtype))


def _spec_of(value):
    """A tensor's TensorSpec (of each in a list); a spec or a Python value as it is."""
    if isinstance(value, tf.Tensor):
        return tf.TensorSpec(value.shape, value.dtype)
    if isinstance(value, list):
        return [_spec_of(v) for v in value]
    return value


def _at(axes, j):
    """The unknown axes of item `j` of a list of them (none past its end: a loss sum, or an
    input the model does not declare)."""
    return axes[j] if j < len(axes) else ()


def _symbolic(model, name):
    """A functional model's symbolic `inputs` or `outputs` (none for another model)."""
    try:
        return list(getattr(model, name, None) or [])
    except Exception:  # a subclassed model has none
        return []


def _after(tensors):
    """One control input standing for all `tensors`.

    ``tf.control_dependencies(tensors)`` gives every op in its block an edge from
    every tensor: n × n edges for n variables, which for a 3000-variable stage
    cost a minute of graph optimisation and gigabytes. A group is n + n.
    """
    return [tf.group(*tensors)] if tensors else []


def _rows_of(grads):
    """(indices, values) of each IndexedSlices gradient, None for the others."""
    return [(g.indices, g.values) if isinstance(g, tf.IndexedSlices) else None for g in grads]


def differentiable(dtype):
    """Whether partial errors flow through tensors of this dtype."""
    return tf.as_dtype(dtype).is_floating


# Ops whose gradient with respect to their weight input is an op of its own (a convolution's
# filter gradient, a product's), which TensorFlow leaves out when only their other input's
# gradient is asked for: a split backward computes it later (W), from the gradient at the
# op's output that the input-gradient pass (B) computes anyway.
# A bias added to a convolution's or product's output is one too, and must be: oneDNN fuses
# a filter gradient with the bias gradient of the same output gradient into one op, which
# across B and W would make the step's graph a cycle.
_SEPARABLE = {"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul", "BatchMatMulV2",
              "BatchMatMulV3", "Einsum", "BiasAdd", "AddV2", "Add"}
_PASSING = {"Identity", "Cast", "Reshape", "Squeeze", "ExpandDims"}  # read → its use


class _Taped:
    """A micro-batch's forward as kept by default: its tape over the compiled forward, the
    watched inputs, the outputs and the loss. The backward differentiates the tape.

    Traced in a graph (`StageWorker.taped(..., split=True)`), the backward can be split
    in two (`split_backward`, then `_Weights.backward`); `ops` are then the forward's ops
    in the graph."""

    def __init__(self, tape, watched, outputs, aux, ops=None):
        self.tape, self.watched, self.outputs, self.aux = tape, watched, outputs, aux
        self.ops = ops

    def _targets(self, worker, seeds):
        return ([self.outputs[j] for j in worker.targets] + [self.aux],
                seeds + [worker.scale_loss(tf.ones_like(self.aux))])

    def backward(self, worker, seeds):
        """(gradients of the watched inputs, sparse rows per variable, what added the dense
        weight gradients to `worker`'s sums: ops in a graph), as `StageWorker.take_in`."""
        targets, seeds = self._targets(worker, seeds)
        input_grads, grads = worker._gradients(self.tape, targets, self.watched, seeds)
        return (input_grads,) + worker.take_in(grads)

    def split_backward(self, worker, seeds):
        """The input-gradient half of the backward (B, in a graph): as `backward`, with the
        gradients of the variables used only through separable ops (`_SEPARABLE`) left
        for `_Weights.backward` (W); those are computed here only up to the ops' outputs,
        where the gradient passes anyway on its way to the inputs.

        Returns:
            (gradients of the watched inputs, sparse rows per variable, what added the
            dense gradients computed here, the `_Weights` to run as W).
        """
        targets, seeds = self._targets(worker, seeds)
        uses = _weight_uses(self.ops, worker.variables)
        deferred = [k for k, parts in enumerate(uses) if parts is not None]
        whole = [k for k, parts in enumerate(uses) if parts is None]
        ends = [(k, end) for k in deferred for end in uses[k]]
        # at a separable op's output (read is None: a read used otherwise, its gradient here)
        sources = [end[0] if end[1] is None else end[2] for _, end in ends]
        grads = self.tape.gradient(
            targets, self.watched + [worker.variables[k] for k in whole] + sources,
            output_gradients=seeds, unconnected_gradients=tf.UnconnectedGradients.NONE)
        n, w = len(self.watched), len(whole)
        input_grads = worker._input_gradients(self.watched, grads[:n])
        now = [None] * len(worker.variables)
        for k, g in zip(whole, grads[n:n + w]):
            now[k] = g
        worker._record(whole, [now[k] for k in whole])
        later = _Weights([(k, end, g) for (k, end), g in zip(ends, grads[n + w:])], deferred)
        return (input_grads,) + worker.take_in(now) + (later,)


class _Weights:
    """What W needs of a micro-batch whose B ran: per deferred variable, the gradients at
    the outputs of the separable ops that use it (and at its other reads)."""

    def __init__(self, parts, deferred):
        self.parts, self.deferred = parts, deferred

    def backward(self, worker):
        """The deferred variables' gradients added to `worker`'s sums (W): (sparse rows per
        variable, none here; the ops that added them).

        Each op is differentiated alone, from its read to its output, with
        `tf.gradients`, which builds only the ops between the two (a tape builds the
        gradient of everything before the output too, pruned only when the graph runs:
        for a deep stage, a graph thousands of times larger); the op's other input's
        gradient is left out (TensorFlow prunes it)."""
        summed = {k: [] for k in self.deferred}
        for k, (read, _, output), g in self.parts:
            if g is None:
                continue
            if output is None:  # a read used otherwise: its gradient is B's
                summed[k].append(g)
            else:
                summed[k].append(tf.gradients(output, read, grad_ys=g)[0])
        grads = [None] * len(worker.variables)
        for k, parts in summed.items():
            parts = [p for p in parts if p is not None]
            grads[k] = parts[0] if len(parts) == 1 else tf.add_n(parts) if parts else None
        worker._record(self.deferred, [grads[k] for k in self.deferred])
        return worker.take_in(grads)


def _weight_uses(ops, variables):
    """Per variable, how the forward's `ops` (a graph's) use it: None when its gradient must
    be computed whole in B (it is read other than by ReadVariableOps of these ops — inside
    a loop or a nested function, gathered — or no separable op uses it); else a list of
    (read, None, None) for each read B differentiates whole and (read, op, output) for
    each read that only a separable op uses (through identities and casts)."""
    region = set(ops)
    graph = ops[0].graph if ops else None
    internal = {id(outer): inner for outer, inner in graph.captures} if graph is not None \
        else {}
    out = []
    for v in variables:
        handle = internal.get(id(getattr(v, "handle", None)))
        users = [] if handle is None else [op for op in handle.consumers() if op in region]
        if not users or any(op.type != "ReadVariableOp" for op in users):
            out.append(None)
            continue
        parts = []
        for read in users:
            t = read.outputs[0]
            while len(t.consumers()) == 1 and t.consumers()[0].type in _PASSING:
                t = t.consumers()[0].outputs[0]
            use = t.consumers()
            if len(use) == 1 and use[0].type in _SEPARABLE and len(use[0].outputs) == 1 \
                    and use[0] in region:
                parts.append((read.outputs[0], use[0], use[0].outputs[0]))
            else:
                parts.append((read.outputs[0], None, None))
        out.append(parts if any(op is not None for _, op, _ in parts) else None)
    return out


class _Inputs:
    """A micro-batch's forward as kept when recomputing: only its inputs and the state the
    forward started from. The backward runs the forward again, then its gradients, as one
    compiled function."""

    def __init__(self, inputs, y, sw, scale, snapshot):
        self.inputs, self.y, self.sw, self.scale, self.snapshot = inputs, y, sw, scale, snapshot

    def backward(self, worker, seeds):
        worker._open(worker._recompute, self.inputs, self.y, self.sw, self.scale,
                     worker.seed_specs(seeds), self.snapshot)
        return worker._recompute(self.inputs, self.y, self.sw, self.scale, seeds,
                                 self.snapshot) + ([],)


class StageWorker:
    """Runs one stage's keras.Model on micro-batches; knows nothing of MPI.

    `forward` runs the stage's compiled function inside a GradientTape kept per
    micro-batch; `backward` calls ``tape.gradient`` on it with the partial errors
    of the stage's outputs, so the backward runs compiled and nothing is
    recomputed. A forward told to `recompute` keeps only the inputs, and its
    backward runs forward and backward again as one compiled function: each
    micro-batch's record (`_Taped`, `_Inputs`) knows how to run its own backward.
    `forward_backward` does both at once, for a stage that needs no partial errors
    (the last: the schedule's fused action).
    Weight gradients are summed in-graph over micro-batches until `gradients`
    takes them.

    Each micro-batch's loss is its samples' mean loss scaled by
    ``micro-batch size / global batch``, so that summing over micro-batches and
    replicas gives the gradient of the global batch's mean loss. Its gradient is
    seeded with ``scale_loss(1)``, as Keras' train step differentiates
    ``optimizer.scale_loss(loss)``: under a LossScaleOptimizer every stage's
    gradients and the partial errors between stages carry the loss scale, and the
    optimizer divides it out once. The logged loss is unscaled.

    A variable the loss does not depend on (an output compiled with loss None, an
    unused branch) gets no gradient, None, as in Keras, whose optimizer then
    leaves it (and its slots) alone. A gradient TensorFlow gives as IndexedSlices
    (an Embedding's table) stays sparse: the micro-batches' rows are concatenated
    in sample order, never added into a dense table, and the optimizer applies
    them as Keras' does (each row, duplicates included).
    """

    def __init__(self, stage, model, is_last, functional=None, scale_loss=None, structures=None,
                 labelled=None, others=0, find_half=False):
        """`functional` is the model's graph; None when the stage is a whole subclassed model.

        `scale_loss` is the stage optimizer's ``scale_loss`` (None: no scaling);
        `structures` the (x, y, sample_weight) `data.Structure`s the user gave and `labelled`
        which outputs have targets (for the model's compute_loss, which takes them so);
        `others`, on the last stage, how many other stages there are (with the model's own
        loss logic, their loss sums are inputs here). `find_half`: find `in_half` before the
        first step also where the backward runs eagerly (a loss-scaling optimizer needs it).
        """
        self.stage = stage
        # The model's own loss logic (see `UserLoss`), or None: the compiled loss and metrics.
        self.user = UserLoss(model, is_last, functional, structures, labelled) \
            if UserLoss.needed(model) else None
        self.scale_loss = scale_loss or (lambda loss: loss)
        self.model = model  # the user's compiled model: loss, metrics
        self.summed = reduction.summed(model)
        self.masked = False  # whether the model's outputs carry masks (known once traced)
        self.is_last = is_last
        self.functional = functional
        self.variables = list(stage.model.trainable_variables)
        received = [j for j, src in enumerate(stage.sources) if src is not None]
        self.watched = [j for j in received if differentiable(stage.model.inputs[j].dtype)]
        self.targets = [] if is_last else [
            j for j, out in enumerate(stage.model.outputs) if differentiable(out.dtype)]
        # With the model's own loss logic (`UserLoss`): the other stages' loss sums, inputs
        # after the stage's on the last stage (watched: their partial errors go back); on
        # another stage, its loss sum, an output after the stage's (its partial error comes
        # back as the seed of its losses).
        n = len(stage.input_keys)
        self.others = others if self.user is not None and is_last else 0
        self.watched += list(range(n, n + self.others))
        self.sends_loss = self.user is not None and not is_last
        if self.sends_loss:
            self.targets.append(len(stage.model.outputs))
        # Whether the loss depends on each watched input (a partial error to send back):
        # fixed by the graph, recorded when a backward is traced or run.
        self.input_has_gradient = [True] * len(self.watched)
        self.state = list(stage.model.non_trainable_variables)
        # The axes the model leaves unknown (a sequence's length) of each input (the stage's,
        # the other stages' loss sums, then the model's), and of each output (also of its
        # targets and sample weights): the functions are traced with those open, once per
        # micro-batch size, not again for each new length (`_open`).
        self._open_in = [open_axes(t) for t in _symbolic(stage.model, "inputs")] + \
            [()] * self.others + [open_axes(t) for t in _symbolic(functional, "inputs")]
        self._open_out = [open_axes(t) for t in _symbolic(stage.model, "outputs")]
        self.open = any(any(a) for a in self._open_in + self._open_out)
        self._opened = set()
        # The last stage traces once per micro-batch size: Keras' per-output loss
        # trackers weight each update by the static batch size, which a trace
        # relaxed to any size does not have (it would count a micro-batch as one).
        relax = not is_last
        self._forward = tf.function(self._forward_fn, reduce_retracing=relax)
        self._infer = tf.function(lambda inputs, y, sw, scale, loss: self._forward_fn(
            inputs, y, sw, scale, training=False, loss=loss), reduce_retracing=relax)
        self._fused = tf.function(self._fused_fn, reduce_retracing=relax)
        self._recompute = tf.function(self._recompute_fn, reduce_retracing=relax)
        self._snapshot = tf.function(lambda: [tf.identity(v) for v in self.state])
        self._accumulate = tf.function(self._add_fn, reduce_retracing=True)
        self._take = tf.function(self._take_fn)
        # Dense gradient sums; a variable's is dropped (its memory freed) when its
        # gradient is first seen to be sparse, kept as {micro-batch: (indices, values)}.
        self._sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                      for v in self.variables]
        self._rows = [{} for _ in self.variables]
        # a sparse gradient's (indices, values) dtypes, by position (what a step without
        # samples here sends as its empty share of the rows)
        self._sparse = {}
        # Whether each variable has had a gradient (the loss depends on it): fixed by
        # the graph, recorded when a backward is traced or run.
        self.has_gradient = [False] * len(self.variables)
        self.differentiated = False  # whether a backward has traced (`has_gradient` known)
        # Whether each variable's gradient is, in Keras' train step, one float16 sum over
        # the batch (mixed_float16: the gradient ends in a cast from float16); known once a
        # backward is traced in a graph, and looked for ahead (`prepare`) with `find_half`.
        self.in_half = [False] * len(self.variables)
        self.find_half = find_half
        # Which variables the targets reach, where the tape cannot tell (`drop_targets`).
        self._reachable = None
        self._kept = {}  # micro-batch → what its forward kept for its backward
        # A `buckets.Reducer` of the sums over the stage's replicas (set by the executor), or
        # None: each accumulation then ends with its buckets' hand-over ops.
        self.buckets = None

    def specs(self, inputs, y, sw):
        """The specs a micro-batch's inputs, targets and sample weights (tensors, arrays or
        specs) are traced with: the axes the model leaves unknown left open."""
        return ([relaxed(t, _at(self._open_in, j)) for j, t in enumerate(inputs)],
                None if y is None else [relaxed(t, _at(self._open_out, j))
                                        for j, t in enumerate(y)],
                None if sw is None else [relaxed(w, _at(self._open_out, j))
                                         for j, w in enumerate(sw)])

    def seed_specs(self, seeds):
        """The specs of partial errors of the `targets` (tensors or specs), axes left open
        (a loss sum's, the last target: a scalar)."""
        return [relaxed(t, _at(self._open_out, j)) for t, j in zip(seeds, self.targets)]

    def _open(self, function, inputs, y, sw, *more):
        """Trace `function` (a compiled stage function) once for these micro-batches' specs
        with the axes the model leaves unknown open, so that a micro-batch of another
        length runs the same trace, as Keras' train function traces a dataset's batches
        once; `more`: the function's other arguments (tensors, specs or Python values).
        Nothing for a model that leaves no axis unknown."""
        if not self.open:
            return
        specs = self.specs(inputs, y, sw) + tuple(_spec_of(t) for t in more)
        key = (id(function), tuple(tf.nest.flatten(specs)))
        if key not in self._opened:
            self._opened.add(key)
            function.get_concrete_function(*specs)

    @property
    def sums(self):
        """The dense gradient sums (tf.Variables; None where the gradient is sparse)."""
        return self._sums

    def pack(self, tensors):
        """Flat list of per-output tensors → the model's output structure."""
        return keras_private.as_outputs(self.functional, tensors)

    def _forward_fn(self, inputs, y, sw, scale, training=True, loss=True):
        """The stage's outputs and its loss contribution (`loss` False: predicting, no loss
        on the last stage). `inputs` are the stage model's, then, for the model's own
        loss logic on the last stage, the other stages' loss sums and the model's inputs
        (its `x`); another stage's loss sum is then its last output."""
        n = len(self.stage.input_keys)
        outputs = tree.flatten(self.stage.model(self.stage.pack_inputs(list(inputs[:n])),
                                                training=training))
        if self.user is not None and loss:
            k = n + self.others
            total = self.user.contribution(self.stage.model.losses, inputs[n:k], inputs[k:],
                                           y, sw, outputs, scale, training)
            if self.sends_loss:  # counted on the last stage
                return outputs + [total], tf.zeros((), tf.float32)
            return outputs, total
        aux = tf.zeros((), tf.float32)
        for term in self.stage.model.losses:
            aux += tf.cast(term, tf.float32) * scale
        if self.is_last and y is not None and loss:
            y_true = self.pack(y)
            y_pred = self.pack(outputs)
            weights = None if sw is None else self.pack(sw)
            loss = self._compiled_loss(y_true, y_pred, weights, scale)
            # A loss summed over the batch counts each piece whole (`reduction.summed`).
            aux += tf.cast(loss, tf.float32) * (1.0 if self.summed else scale)
            # Seen as the function traces: a subclassed model's masks are not known before.
            self.masked = self.masked or any(
                keras_private.mask_of(t) is not None for t in outputs)
            metrics = keras_private.compiled_metrics(self.model)
            if metrics is not None:
                metrics.update_state(y_true, y_pred, weights)
        return outputs, aux

    def _compiled_loss(self, y_true, y_pred, weights, scale):
        """The compiled loss of a micro-batch, its per-output loss logs counted as a `scale`
        share of one step.

        Model.fit's per-output loss Means count each step once: each update is weighted
        by the batch's static size, which its data's batches (numpy, generators,
        datasets without drop_remainder) leave unknown, so 1, and whatever the size of
        the last, partial batch. Weighted by a micro-batch's own size, a partial batch
        would weigh less than in Keras; with the micro-batch's share of the step, the
        step's pieces add up to one update of their whole batch's loss.
        """
        trackers = keras_private.output_loss_trackers(self.model)
        before = [(tf.identity(t.total), tf.identity(t.count)) for t in trackers]
        loss = keras_private.compiled_loss(self.model)(y_true, y_pred, weights)
        with tf.control_dependencies(_after([loss])):
            for t, (total, count) in zip(trackers, before):
                weight = t.count - count  # what the compiled loss gave the update
                t.total.assign(total + (t.total - total) * (scale / weight))
                t.count.assign(count + scale)
        return loss

    def forward(self, i, inputs, y, sw, scale, recompute=False):
        """Forward of micro-batch `i`.

        Args:
            i: micro-batch index (keys what is kept for `backward`).
            inputs: the stage model's inputs, numpy or tensors, in its input order; then,
                for the model's own loss logic on the last stage, the other stages' loss
                sums and the model's inputs.
            y: the targets (list of arrays) on the last stage, else None.
            sw: the sample weights (list per output, or None), with `y`.
            scale: micro-batch size / global batch size.
            recompute: keep only the inputs (and the state the forward started from);
                the backward runs the forward again. Else the tape is kept.

        Returns:
            (outputs, loss): the stage outputs as eager tensors (then, for the model's own
            loss logic, this stage's loss sum), and this micro-batch's scaled loss
            contribution (data loss on the last stage, plus regularisation).
        """
        inputs, y, sw, scale = _as_tensors(inputs, y, sw, scale)
        self._open(self._forward, inputs, y, sw, scale)
        if recompute:
            snapshot = self._snapshot() if self.state else []
            outputs, aux = self._forward(inputs, y, sw, scale)
            self._kept[i] = _Inputs(inputs, y, sw, scale, snapshot)
            return outputs, aux
        kept = self._kept[i] = self.taped(self._forward, inputs, y, sw, scale)
        return kept.outputs, kept.aux

    def taped(self, forward, inputs, y, sw, scale, split=False):
        """`forward` (the compiled `_forward`, or `_forward_fn` as a graph traces) under a
        tape watching the watched inputs: the record (`_Taped`) its backward runs from
        (`split`, in a graph: a backward split in B and W, `_Taped.split_backward`)."""
        graph = tf.compat.v1.get_default_graph() if split else None
        start = len(graph.get_operations()) if split else 0
        with tf.GradientTape() as tape:
            for j in self.watched:
                tape.watch(inputs[j])
            outputs, aux = forward(inputs, y, sw, scale)
        ops = graph.get_operations()[start:] if split else None
        return _Taped(tape, [inputs[j] for j in self.watched], outputs, aux, ops)

    def prepare(self, specs, y, sw, kind):
        """Trace and compile the function a micro-batch of these shapes will run, before it arrives.

        Called on every rank at once before the first step, so that each stage
        traces and compiles while the others do, instead of waiting for the stages
        before it to trace, compile and send. The function runs once on zeros with
        a loss scale of 0 (under a tape with its backward, off the fused path):
        running is what builds and optimises the graphs. Everything the run
        touched is put back: non-trainable state (BatchNormalization's statistics,
        dropout's seed), the loss trackers and metrics, and the gradient sums.

        Args:
            specs: the stage model's inputs as tf.TensorSpec, in its input order (then
                the model's, as `forward` takes them).
            y, sw: the targets and sample weights (arrays, or None) of the last stage.
            kind: what the micro-batch will run through: "forward" (`forward`, then
                `backward`), "recompute" (the same, recomputing), "fused"
                (`forward_backward`), "infer" (`infer`: evaluate), "predict" (`infer`
                without a loss) or "traced" (a stage's forward and backward inside the
                step graph, which compiles as it first runs: only traced here, to know
                what its gradients reach; nothing runs).
        """
        if kind == "traced":
            self._trace_gradients(*self.specs(specs, y, sw))
            return
        if self.open:  # traced with the unknown axes open, as every length will run it
            self._prepare_open(specs, y, sw, kind)
            return
        zeros = lambda t: tf.zeros(tuple(t.shape), tf.as_dtype(t.dtype))  # noqa: E731
        inputs = [_empty(t) if isinstance(t, (tf.SparseTensorSpec, tf.RaggedTensorSpec))
                  else zeros(t) for t in specs]
        # (a ragged target: zeros in its rows' shape)
        y = None if y is None else [tf.zeros_like(t) if isinstance(t, tf.RaggedTensor)
                                    else zeros(t) for t in y]
        sw = None if sw is None else [None if w is None else zeros(w) for w in sw]
        scale = tf.constant(0.0)
        kept = self.state + self._metric_variables()
        before = [tf.identity(v) for v in kept]
        if kind in ("infer", "predict"):
            self._infer(inputs, y, sw, scale, kind == "infer")
        elif kind == "fused":
            self._fused(inputs, y, sw, scale, [])
        elif kind == "recompute":
            snapshot = self._snapshot() if self.state else []
            outputs, _ = self._forward(inputs, y, sw, scale)
            self._recompute(inputs, y, sw, scale,
                            [tf.zeros_like(outputs[j]) for j in self.targets], snapshot)
        else:
            self._differentiate(self._forward, inputs, y, sw, scale,
                                lambda targets: [tf.zeros_like(t) for t in targets])
            if self.find_half and self.variables:  # the eager backward cannot tell `in_half`
                known = list(self.has_gradient), list(self.input_has_gradient)
                self._trace_gradients(specs, y, sw)
                self.has_gradient[:], self.input_has_gradient[:] = known  # as the tape has them
        for v, value in zip(kept, before):
            v.assign(value)
        if self.variables:
            self.gradients()  # back to zero

    def _prepare_open(self, specs, y, sw, kind):
        """`prepare` for a model that leaves an axis unknown: the micro-batch's functions
        traced for any length (`_open`), not run (zeros of which length?); the first
        micro-batch compiles as it runs, and its backward records which variables have
        gradients."""
        scale = tf.TensorSpec((), tf.float32)
        if kind in ("infer", "predict"):
            self._open(self._infer, specs, y, sw, scale, kind == "infer")
        elif kind == "fused":
            self._open(self._fused, specs, y, sw, scale, [])
        else:
            self._open(self._forward, specs, y, sw, scale)
        if kind not in ("infer", "predict") and self.find_half and self.variables:
            self._trace_gradients(*self.specs(specs, y, sw))

    def _metric_variables(self):
        """The variables of the user model's loss trackers and metrics (what a
        forward counts in)."""
        seen, out = set(), []
        for owner in (self.model, keras_private.compiled_loss(self.model),
                      keras_private.compiled_metrics(self.model)):
            for v in getattr(owner, "metrics_variables", None) or getattr(
                    owner, "variables", None) or []:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    def infer(self, inputs, y, sw, scale, loss=True):
        """Forward of one micro-batch in inference mode (evaluate, predict).

        Args:
            inputs: the stage model's inputs, in its input order (then the model's, as
                `forward` takes them).
            y: the targets on the last stage when evaluating, else None: then no
                compiled loss or metric is computed.
            sw: the sample weights with `y`, or None.
            scale: micro-batch size / batch size.
            loss: False when predicting (the model's own loss logic is not run).

        Returns:
            (outputs, loss) as for `forward`; nothing is kept for a backward.
        """
        args = _as_tensors(inputs, y, sw, scale)
        self._open(self._infer, *args, loss)
        return self._infer(*args, loss)

    def backward(self, i, partial_errors):
        """Backward of micro-batch `i`, as its forward kept it (`_Taped` or `_Inputs`).

        Args:
            partial_errors: gradients of the loss w.r.t. this stage's differentiable
                outputs (in `targets` order: its loss sum's last); empty on the last stage.

        Returns:
            Partial errors w.r.t. the watched inputs (in `watched` order), as numpy.
        """
        seeds = [to_tensor(pe) for pe in partial_errors]
        input_grads, rows, _ = self._kept.pop(i).backward(self, seeds)
        self._keep_rows(i, rows)
        return [to_numpy(g) for g in input_grads]

    def drop_targets(self, slots, specs, y=None, sw=None):
        """Stop differentiating these outputs: no later stage's loss depends on them, so
        what only they feed gets no gradient (None), as in Keras.

        The backward under a tape over the compiled forward sees the forward as one
        op, and gives every variable it reads a gradient (zeros) whatever the
        targets: which variables and inputs the remaining targets depend on is found
        by tracing the gradient once in a graph (`specs`: the inputs, as for
        `prepare`); nothing runs.
        """
        self.targets = [j for j in self.targets if j not in set(slots)]
        self._trace_gradients(specs, y, sw)
        self._reachable = list(self.has_gradient)

    def _trace_gradients(self, specs, y, sw):
        """Trace the forward and the gradients of the targets once in a graph, running
        nothing: `has_gradient`, `input_has_gradient` and `in_half` as the graph has them.
        (The backward under a tape over the compiled forward sees the forward as one op.)"""
        scale = tf.constant(1.0)

        def probe(inputs, y, sw):
            self._differentiate(self._forward_fn, inputs, y, sw, scale,
                                lambda targets: [tf.ones_like(t) for t in targets])
            return tf.zeros(())

        spec = lambda t: relaxed(t, ())  # noqa: E731  (a ragged target's own spec)
        tf.function(probe).get_concrete_function(
            list(specs), None if y is None else [spec(t) for t in y],
            None if sw is None else [None if w is None else spec(w) for w in sw])

    def _keep_rows(self, i, rows):
        """Keep micro-batch `i`'s sparse gradients ((indices, values) per variable, or None)."""
        for kept, r in zip(self._rows, rows):
            if r is not None:
                kept[i] = r

    def _gradients(self, tape, targets, watched, seeds):
        """(gradients of the watched inputs, zeros where unconnected; of the variables, None
        where unconnected), recording which variables have gradients."""
        grads = tape.gradient(targets, watched + self.variables, output_gradients=seeds,
                              unconnected_gradients=tf.UnconnectedGradients.NONE)
        n = len(watched)
        self._record(range(len(self.variables)), grads[n:])
        return self._input_gradients(watched, grads[:n]), grads[n:]

    def _input_gradients(self, watched, grads):
        """The watched inputs' gradients, zeros where unconnected (recording which are)."""
        for k, g in enumerate(grads):
            self.input_has_gradient[k] = g is not None
        return [tf.zeros_like(x) if g is None else g for x, g in zip(watched, grads)]

    def _record(self, positions, grads):
        """Record which of the variables at `positions` have gradients (`grads`), which are
        sparse, and which are float16 sums."""
        self.differentiated = True
        for k, g in zip(positions, grads):
            self.has_gradient[k] = g is not None
            if isinstance(g, tf.IndexedSlices):
                self._sums[k] = None  # never densified: no dense sum to keep
                self._sparse[k] = (g.indices.dtype, g.values.dtype)
            elif g is not None and not tf.executing_eagerly():
                self.in_half[k] = g.op.type == "Cast" and g.op.inputs[0].dtype == tf.float16

    def record(self):
        """What a backward taught this stage (`differentiated`): which variables and inputs
        have gradients, which are sparse, float16 sums or reached, whether the outputs carry
        masks; for `adopt` on a replica that has not run one."""
        return dict(has_gradient=list(self.has_gradient), in_half=list(self.in_half),
                    input_has_gradient=list(self.input_has_gradient),
                    sparse={k: (i.name, v.name) for k, (i, v) in self._sparse.items()},
                    reachable=self._reachable, masked=self.masked,
                    keys=None if self.user is None else dict(self.user.keys))

    def adopt(self, record):
        """Take another replica's `record` of this stage, if no backward has run here: a
        replica whose first steps have no samples exchanges its (empty) gradients as the
        others exchange theirs."""
        if self.differentiated:
            return
        self.differentiated = True
        self.has_gradient[:], self.in_half[:] = record["has_gradient"], record["in_half"]
        self.input_has_gradient[:] = record["input_has_gradient"]
        for k, (indices, values) in record["sparse"].items():
            self._sums[k] = None
            self._sparse[k] = (tf.as_dtype(indices), tf.as_dtype(values))
        self._reachable = record["reachable"]
        self.masked = record["masked"]
        if self.user is not None:
            self.user.keys.update(record["keys"])

    def forward_backward(self, i, inputs, y, sw, scale):
        """Forward and backward of one micro-batch in one compiled function.

        For a stage whose outputs need no partial errors from elsewhere (the last
        stage, or the only one): like Keras' own train step, the whole micro-batch
        runs as one graph, and no activations are kept afterwards.

        Returns:
            (loss, partial errors w.r.t. the watched inputs as numpy).
        """
        args = _as_tensors(inputs, y, sw, scale)
        self._open(self._fused, *args, [])
        aux, input_grads, rows = self._fused(*args, [])
        self._keep_rows(i, rows)
        return aux, [to_numpy(g) for g in input_grads]

    def _fused_fn(self, inputs, y, sw, scale, seeds):
        """Forward, then gradients seeded with `seeds` (partial errors of the outputs)."""
        return self.fused_parts(inputs, y, sw, scale, seeds)[:3]

    def fused_parts(self, inputs, y, sw, scale, seeds):
        """`_fused_fn`'s work as it traces, in a graph: (loss, gradients of the watched
        inputs, sparse rows per variable, the ops that added the dense gradients)."""
        aux, input_grads, grads = self.fused_gradients(inputs, y, sw, scale, seeds)
        return (aux, input_grads) + self.take_in(grads)

    def fused_gradients(self, inputs, y, sw, scale, seeds):
        """The forward, then the gradients of its outputs seeded with `seeds` and of its
        (scaled) loss, in a graph: (loss, gradients of the watched inputs, gradients of the
        variables, as `_gradients` gives them), nothing taken in."""
        return self._differentiate(
            self._forward_fn, inputs, y, sw, scale,
            lambda targets: list(seeds) + [self.scale_loss(tf.ones_like(targets[-1]))])

    def take_in(self, grads):
        """A micro-batch's weight gradients taken in: dense ones added to the sums, sparse
        ones returned as (indices, values) rows per variable (None for the others).

        Returns:
            (rows, what added the dense ones: their ops as this traces in a graph, none
            eagerly, where the compiled `_accumulate` adds them).
        """
        dense = [None if isinstance(g, tf.IndexedSlices) else g for g in grads]
        if not tf.executing_eagerly():
            return _rows_of(grads), self._accumulate_fn(dense)
        if any(g is not None for g in dense):
            self._accumulate(dense)
        return _rows_of(grads), []

    def _differentiate(self, forward, inputs, y, sw, scale, seeds):
        """`forward` under a tape, then the gradients of the targets (the differentiated
        outputs and the loss, seeded with `seeds(targets)`): (loss, gradients of the
        watched inputs, gradients of the variables), as `_gradients` gives them."""
        kept = self.taped(forward, inputs, y, sw, scale)
        targets = [kept.outputs[j] for j in self.targets] + [kept.aux]
        return (kept.aux,) + tuple(self._gradients(kept.tape, targets, kept.watched,
                                                   seeds(targets)))

    def _recompute_fn(self, inputs, y, sw, scale, seeds, snapshot):
        """The backward of `recompute`: the forward again from the state it first saw.

        Non-trainable state (BatchNormalization's moving statistics, dropout's seed)
        is set to what the first forward started from, so the recomputed forward is
        the same computation, and restored afterwards, so it is updated once.
        """
        current = [tf.identity(v) for v in self.state]
        with tf.control_dependencies(_after(current)):
            for v, value in zip(self.state, snapshot):
                v.assign(value)
        _, grads, rows = self._fused_fn(inputs, y, sw, scale, seeds)
        with tf.control_dependencies(_after(grads)):
            for v, value in zip(self.state, current):
                v.assign(value)
        return [tf.identity(g) for g in grads], rows

    def _add_fn(self, grads):  # (a compiled function returns tensors, not ops)
        self._accumulate_fn(grads)

    def _accumulate_fn(self, grads):
        """Add the dense gradients to the sums; returns the ops that add them (with the
        buckets' hand-over ops, if any)."""
        added = [total.assign_add(tf.convert_to_tensor(g), read_value=False)
                 for total, g in zip(self._sums, grads) if g is not None and total is not None]
        if self.buckets is not None:
            added += self.buckets.hooks(self._sums)
        return added

    def _take_fn(self, made):
        """The dense sums (`made` of them: one dropped since the last trace retraces) read
        and reset."""
        sums = [total for total in self._sums if total is not None]
        values = [tf.identity(total.read_value()) for total in sums]
        with tf.control_dependencies(_after(values)):
            for total in sums:
                total.assign(tf.zeros_like(total))
        return values

    def gradients(self):
        """The summed weight gradients of this step as tensors (and reset the sums).

        None for a variable that has no gradient, as Keras gives it to the optimizer.
        """
        if not self.variables:
            return []
        made = sum(total is not None for total in self._sums)
        dense = iter(self._take(made) if made else [])
        out = []
        for k, (total, has, rows) in enumerate(zip(self._sums, self.has_gradient, self._rows)):
            if rows:
                parts = [rows[i] for i in sorted(rows)]  # micro-batches in sample order
                out.append(tf.IndexedSlices(
                    tf.concat([p[1] for p in parts], 0), tf.concat([p[0] for p in parts], 0),
                    tf.constant(self.variables[k].shape, tf.int64)))
                rows.clear()
            elif total is None and has:  # no samples here this step: no rows
                indices, values = self._sparse[k]
                shape = self.variables[k].shape
                out.append(tf.IndexedSlices(tf.zeros((0,) + tuple(shape[1:]), values),
                                            tf.zeros((0,), indices),
                                            tf.constant(shape, tf.int64)))
            elif total is not None:
                value = next(dense)
                reached = self._reachable is None or self._reachable[k]
                out.append(value if has and reached else None)
            else:
                out.append(None)
        return out
