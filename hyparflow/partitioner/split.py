"""Cut points → stages: one keras.Model per stage, its boundary tensors, who sends what to whom."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import keras
import numpy as np
from keras import tree

from hyparflow.keras import keras_private
from hyparflow.partitioner import balance as balance_
from hyparflow.partitioner import costs as costs_
from hyparflow.partitioner import timing
from hyparflow.partitioner.graph import LayerGraph

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from mpi4py import MPI


class Stage:
    """One pipeline stage: a keras.Model over a contiguous run of the model's calls.

    Attributes:
        index: the stage number ``s``.
        model: a keras.Model sharing its layers (and so its weights) with the user's
            model. It takes `input_names` and returns `output_names`, as lists.
        input_names: model inputs this stage reads directly, then boundary tensors
            it receives, in the order `model` takes them.
        output_names: boundary tensors it sends (on the last stage: the model's
            outputs), in the order `model` returns them.
        sources: for each input, ``None`` if it is a model input read from the data,
            else the stage that sends it.
        destinations: for each output, the later stages that receive it (empty on
            the last stage).
        calls: the names of the layer calls on this stage, in order.
        cost: the predicted cost under the balance method used.
    """

    def __init__(self, index, model, input_keys, output_keys, sources, destinations,
                 calls, cost, names, model_inputs):
        self.index = index
        self._model_inputs = model_inputs
        self.model = model
        self.input_keys = input_keys
        self.output_keys = output_keys
        self.input_names = [names[k] for k in input_keys]
        self.output_names = [names[k] for k in output_keys]
        self.sources = sources
        self.destinations = destinations
        self.calls = calls
        # How `model` takes its inputs: a list (a stage model), or the structure the user's
        # data has (the whole of a subclassed model: a dict, a tuple, one tensor).
        self.pack_inputs = lambda inputs: inputs[0] if len(inputs) == 1 else list(inputs)
        self.cost = cost

    @property
    def data_inputs(self):
        """Positions (in this stage's inputs) of the inputs read from the data."""
        return [j for j, src in enumerate(self.sources) if src is None]

    @property
    def data_positions(self):
        """For each data input, its position among the model's inputs."""
        return [self._model_inputs.index(self.input_keys[j]) for j in self.data_inputs]

    def __repr__(self):
        return (f"Stage({self.index}: {len(self.calls)} calls {self.calls[0]}..{self.calls[-1]}, "
                f"in={self.input_names}, out={self.output_names})")


class Partition:
    """A model cut into P stages. Build it with `hyparflow.partition`."""

    def __init__(self, model, graph, stages, method, costs=None):
        self.model = model
        self.graph = graph
        self.stages = stages
        self.method = method
        self.costs = costs
        # {variable path: its stages} for weights several stages hold (`tied_weights`)
        self.tied = tied_weights(stages)

    @property
    def partitions(self) -> int:
        return len(self.stages)

    def compose(self) -> keras.Model:
        """A keras.Model chaining the stage models in one process.

        It takes and returns exactly what the original model does; tests and users
        use it to check that a split computes the same function.
        """
        g = self.graph
        if g is None:
            return self.model
        inputs = [keras.Input(batch_shape=g.tensors[k].shape, dtype=g.tensors[k].dtype,
                              name=_input_name(g.names[k])) for k in g.inputs]
        env = dict(zip(g.inputs, inputs))
        for stage in self.stages:
            outs = stage.model([env[k] for k in stage.input_keys])
            env.update(zip(stage.output_keys, tree.flatten(outs)))
        f = g.functional
        return keras.Model(tree.pack_sequence_as(keras_private.inputs_struct(f), inputs),
                           tree.pack_sequence_as(keras_private.outputs_struct(f),
                                                 [env[k] for k in g.outputs]),
                           name=f"{self.model.name}_composed")

    def stage_lines(self) -> list[str]:
        """One line a stage: its first and last layer calls and its share of the cost; then
        the weights several stages hold (tied), if any."""
        total = sum(st.cost for st in self.stages) or 1.0
        lines = [f"stage {st.index}: {st.calls[0]} .. {st.calls[-1]} ({len(st.calls)} calls, "
                 f"{st.cost / total:.0%} of the cost by {self.method})" for st in self.stages]
        lines += [f"weights of {layer!r} held by stages {stages} (tied: gradients summed "
                  "over them)" for layer, stages in self.tied_layers().items()]
        return lines

    def tied_layers(self) -> dict:
        """{layer: the stages holding its weights} for the layers whose weights are tied."""
        return {path.rsplit("/", 1)[0]: stages for path, stages in sorted(self.tied.items())}

    def summary(self, print_fn: Callable[[str], object] | None = None) -> str:
        """A table: stage, layers, parameters, cost, boundary tensors and bytes per sample.

        Returns the table as a string, and prints it when `print_fn` is given.
        """
        g = self.graph
        fmt = self.costs.format if self.costs is not None else "{:,.0f}".format
        what = self.method if self.method != "explicit" else "explicit split; params"
        rows = [("stage", "layers", "first .. last", "params", f"predicted cost ({what})",
                 "receives (bytes/sample)", "sends (bytes/sample)")]
        for st in self.stages:
            recv = [f"{g.names[k]} ({costs_.bytes_per_sample(g.tensors[k])})"
                    for k, src in zip(st.input_keys, st.sources) if src is not None]
            send = [f"{g.names[k]} ({costs_.bytes_per_sample(g.tensors[k])})"
                    for k, dst in zip(st.output_keys, st.destinations) if dst]
            rows.append((str(st.index), str(len(st.calls)), f"{st.calls[0]} .. {st.calls[-1]}",
                         f"{st.model.count_params():,}", fmt(st.cost),
                         ", ".join(recv) or "-", ", ".join(send) or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        total = [st.cost for st in self.stages]
        lines.append(f"imbalance (max/mean cost): {max(total) / (sum(total) / len(total)):.3f}")
        text = "\n".join(lines)
        if print_fn is not None:
            print_fn(text)
        return text


def _bounds_from_balance(graph, partitions, balance, costs, chunks=1):
    """Stage start indices (and n at the end) for a method name or an explicit split."""
    if isinstance(balance, str):
        allowed = check_partitions(graph, partitions)
        sizes, _ = balance_.split(costs, partitions, graph, allowed)
    else:
        sizes = _explicit_sizes(graph, partitions, balance, chunks)
    return [0] + list(itertools.accumulate(sizes))


def check_partitions(graph, partitions):
    """Raise if `graph` cannot be cut into `partitions` stages; else the allowed stage starts."""
    n = len(graph)
    if not 1 <= partitions <= n:
        raise ValueError(
            f"partitions={partitions}: model {graph.model.name!r} has {n} layer calls, so it can "
            f"be split into at most {n} stages. Use partitions between 1 and {n} (and more "
            "replicas instead).")
    allowed = balance_.cuts_for(graph, partitions)
    cuts = int(allowed[1:-1].sum())
    if partitions > cuts + 1:
        shared = sorted({graph.calls[i[0]].layer.name for i in graph.layer_calls().values()
                         if not balance_.tieable(graph.calls[i[0]].layer)})
        why = [f"layers called at several places that update state of their own "
               f"({', '.join(map(repr, shared))}) keep all their calls, and everything "
               "between them, on one stage"] if shared else []
        text = [graph.names[k] for k in balance_.strings(graph)]
        why += [f"tensors of strings ({', '.join(map(repr, text))}) stay on the stage that "
                "makes them, with the calls that read them"] if text else []
        masked = sorted(set(graph.masked_at_run.values()))
        why += [f"the outputs of {', '.join(map(repr, masked))}, given a Keras mask at run "
                "time that the model's graph does not record, stay on their stage with the "
                "calls that read them"] if masked else []
        raise ValueError(
            f"partitions={partitions}: model {graph.model.name!r} can be cut at only {cuts} "
            f"places, because {'; and '.join(why)}. Use partitions "
            f"≤ {cuts + 1} (and more replicas instead).")
    return allowed


def _explicit_sizes(graph, partitions, balance, chunks=1):
    n = len(graph)
    each = "one per stage" if chunks == 1 else \
        f"one per stage: partitions={partitions // chunks} × chunks={chunks}"
    if not isinstance(balance, (list, tuple)) or not balance:
        pass
    elif all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in balance):
        if len(balance) != partitions or any(b < 1 for b in balance) or sum(balance) != n:
            raise ValueError(
                f"balance={balance}: a list of layer counts needs {partitions} entries "
                f"({each}), each ≥ 1, summing to the model's {n} layer calls "
                f"({_call_names(graph)}).")
        return [int(b) for b in balance]
    elif all(isinstance(b, str) for b in balance):
        index = {c.name: c.index for c in graph.calls}
        unknown = [b for b in balance if b not in index]
        if unknown:
            raise ValueError(
                f"balance={balance}: {unknown} name no layer call of model "
                f"{graph.model.name!r}; names are layer names (with .k for a layer's k-th call), "
                f"e.g. {[c.name for c in graph.calls[1:4]]}.")
        starts = [index[b] for b in balance]
        if len(starts) != partitions - 1 or starts != sorted(set(starts)) or starts[0] == 0:
            raise ValueError(
                f"balance={balance}: a list of names gives the layer that starts each of stages "
                f"1..{partitions - 1}: {partitions - 1} distinct names after the first layer, in "
                f"the model's order.")
        bounds = [0] + starts + [n]
        return [b - a for a, b in zip(bounds, bounds[1:])]
    raise ValueError(
        f"balance={balance!r}: use a method name ({', '.join(map(repr, costs_.METHODS))}), a list "
        "of layer counts per stage, or a list of layer names that start stages 1..P-1.")


def _call_names(graph, most=12):
    """The graph's layer calls by name, in order (Keras' own, such as a mask's not_equal,
    included), the middle left out when there are more than `most`."""
    names = [c.name for c in graph.calls]
    if len(names) > most:
        names = names[:most // 2] + [f"… {len(names) - most} more …"] + names[-(most // 2):]
    return ", ".join(names)


def stage_models(graph, sizes):
    """The stage models of `graph` cut into pieces of `sizes` calls (what `timing.profile`
    times)."""
    return [stage.model for stage in partition(graph.model, len(sizes), balance=sizes,
                                               keep_nested=graph.keep_nested).stages]


def shared_profile(graph, microbatch_size, comm=None):
    """`timing.profile` measured on rank 0 of `comm` and broadcast: every rank gets the same.

    Kept on the model, by micro-batch size and what is timed (the calls, the trainable
    weights, the dtype policy): a later call of the same process reuses rank 0's timings
    instead of measuring again, so it makes the same cut (timings measured anew differ by
    a few percent, enough to move a cut where many are nearly as good).
    """
    model = graph.model
    kept = model.__dict__.setdefault("_hyparflow_timings", {})
    key = (microbatch_size, graph.keep_nested, len(graph),
           tuple(v.path for v in model.trainable_variables),
           tuple(sorted({layer.dtype_policy.name for layer in keras_private.all_layers(model)})))

    def measured():
        if key not in kept:
            kept[key] = timing.profile(graph, microbatch_size, stage_models)
        return kept[key]

    if comm is None or comm.Get_size() == 1:
        return measured()
    from hyparflow.mpi import comm as comm_

    # rank 0's timings, kept or measured, decide on every rank (whatever the others keep)
    kept[key] = comm_.from_root(comm, measured,
                                'balance="time": timing the model compiled, piece by piece')
    return kept[key]


def partition(model: keras.Model, partitions: int,
              balance: str | Sequence[int] | Sequence[str] = costs_.DEFAULT,
              keep_nested: bool = False, *, microbatch_size: int = 16,
              microbatches: int | None = None, comm: MPI.Comm | None = None,
              schedule: str = "1f1b", chunks: int = 1, step_graph: bool = False) -> Partition:
    """Cut `model` into `partitions` pipeline stages.

    Args:
        model: a functional or Sequential keras.Model (built).
        partitions: the number of stages P, from 1 to the number of layer calls.
        balance: how to place the cuts. A method minimises the cost of the costliest
            stage exactly, over every contiguous split of the calls:
            ``"flops"`` (default) estimated forward FLOPs per sample;
            ``"params"`` parameters (+1 per call); ``"layers"`` layer calls;
            ``"time"`` forward + backward time of each call measured on one
            micro-batch, plus what its boundary tensors cost to send and receive;
            ``"memory"`` weights, gradients and optimizer slots and what each call holds
            in its stage's role (`costs.HELD`), plus that role's share of the activations
            and boundary tensors per micro-batch in flight under `schedule`.
            Or explicitly: a list of P ints gives the calls per stage; a list of P-1
            layer names gives the layer that starts each of stages 1..P-1.
        keep_nested: keep models used as layers whole (one call each) instead of
            splitting through their layers.
        microbatch_size: samples per micro-batch, for ``"time"`` and ``"memory"``.
        microbatches: micro-batches per step m, for ``"memory"`` (default P).
        comm: an MPI communicator; with ``"time"`` rank 0 measures and every rank
            gets its numbers, so every rank makes the same split.
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"``, for ``"memory"``: how many
            micro-batches each stage keeps (`schedule.kept`).
        chunks: for ``"memory"`` with the interleaved schedule, the stages each rank holds
            (`partitions` counts them all: ranks × chunks).
        step_graph: whether each stage runs its step as one graph
            (``hf.fit(step_graph=True)``): then for ``"time"`` a non-last stage is costed
            as the last runs its calls, forward and backward compiled together, and for
            ``"memory"`` every stage holds what the step graph holds (`costs.HELD`).

    Returns:
        A `Partition`; ``part.stages[s].model`` is stage s's keras.Model.

    Raises:
        ValueError: subclassed model, P out of range, bad balance, or a layer called
            at several places whose calls fall on different stages.

    Example:
        >>> part = hf.partition(model, partitions=2)
        >>> print(part.summary())
    """
    graph = LayerGraph.of(model, keep_nested)
    if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
        raise ValueError(f"partitions={partitions!r}: must be a whole number ≥ 1.")
    method = balance if isinstance(balance, str) else costs_.DEFAULT  # explicit: summary's costs
    timings = shared_profile(graph, microbatch_size, comm) if method == "time" else None
    costs = costs_.costs(graph, method, partitions=partitions, microbatch_size=microbatch_size,
                         microbatches=microbatches, optimizer=getattr(model, "optimizer", None),
                         timings=timings, schedule=schedule, chunks=chunks,
                         step_graph=step_graph)
    bounds = _bounds_from_balance(graph, partitions, balance, costs, chunks)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    stage_of = np.repeat(np.arange(partitions), sizes)
    _check_shared_layers(graph, stage_of)
    predicted = balance_.stage_costs(costs, graph, bounds)
    P = partitions
    model_outputs = set(graph.outputs)
    stages = []
    start = 0
    for s, size in enumerate(sizes):
        calls = graph.calls[start:start + size]
        start += size
        produced = {k for c in calls for k in c.outputs}
        needed = []
        for c in calls:
            needed += [k for k in c.inputs if k not in produced and k not in needed]
        if s == P - 1:
            needed += [k for k in graph.outputs if k not in produced and k not in needed]
        data = [k for k in graph.inputs if k in needed]
        received = sorted((k for k in needed if k not in data), key=lambda k: graph.producer[k])
        input_keys = data + received
        sources = [None] * len(data) + [int(stage_of[graph.producer[k]]) for k in received]
        if s == P - 1:
            output_keys = list(graph.outputs)
            destinations = [[] for _ in output_keys]
        else:
            output_keys, destinations = [], []
            for c in calls:
                for k in c.outputs:
                    dst = readers(graph, stage_of, k, model_outputs)
                    if dst:
                        _check_dense(graph, k, balance)
                        output_keys.append(k)
                        destinations.append(dst)
        stage_model = _build_stage_model(graph, calls, input_keys, output_keys,
                                         name=f"{model.name}_stage{s}")
        if s == P - 1:
            _check_output_masks(graph, stage_model, P)
        stages.append(Stage(s, stage_model, input_keys, output_keys, sources, destinations,
                            [c.name for c in calls], predicted[s], graph.names, graph.inputs))
    return Partition(model, graph, stages, balance if isinstance(balance, str) else "explicit",
                     costs)


def readers(graph, stage_of, key, model_outputs=None):
    """The other stages that read tensor `key`, sorted: its consumers' stages, and the last
    stage when it is a model output (the last stage computes the loss).

    `stage_of` gives each call's stage; `model_outputs` is ``set(graph.outputs)``,
    passed in by callers that ask for many tensors.
    """
    last = int(stage_of[-1])
    src = int(stage_of[graph.producer[key]])
    dst = {int(stage_of[j]) for j in graph.consumers.get(key, [])} - {src}
    if key in (model_outputs if model_outputs is not None else set(graph.outputs)) \
            and src != last:
        dst.add(last)
    return sorted(dst)


def whole_model(model, inputs, pack_inputs=None):
    """The one-stage Partition of any model, subclassed ones included (P = 1).

    Args:
        model: a keras.Model.
        inputs: how many input arrays the model takes.
        pack_inputs: the flat input arrays → what the model's call takes (the
            structure of the user's x); default: one array, or a list.
    """
    keys = list(range(inputs))
    names = {k: f"input_{k}" for k in keys}
    stage = Stage(0, model, keys, [], [None] * inputs, [], [model.name], 0, names, keys)
    if pack_inputs is not None:
        stage.pack_inputs = pack_inputs
    return Partition(model, None, [stage], "whole")


def _build_stage_model(graph, calls, input_keys, output_keys, name):
    taken = {c.layer.name for c in calls}  # (a tied layer's output comes in beside it)
    # The model's own inputs keep their sparse / ragged declaration; boundary tensors are
    # dense (`_check_dense`; Keras' symbolic sparse flag of an op's output is not reliable).
    env = {k: keras.Input(batch_shape=graph.tensors[k].shape, dtype=graph.tensors[k].dtype,
                          sparse=k in graph.inputs and graph.tensors[k].sparse,
                          ragged=k in graph.inputs and graph.tensors[k].ragged,
                          name=_input_name(graph.names[k], taken)) for k in input_keys}
    inputs = [env[k] for k in input_keys]
    masked = set()  # the received tensors given back their masks
    for c in calls:
        for k in c.inputs:  # a received tensor's mask, received beside it, goes with it again
            mask = graph.masks.get(k)
            if k in input_keys and k not in masked and mask in env:
                env[k] = WithMask(name=f"{_input_name(graph.names[k])}_masked")(
                    [env[k], env[mask]])
                masked.add(k)
        try:
            outputs = c.replay(env)
        except Exception as exc:
            raise ValueError(
                f"layer call {c.name!r} ({type(c.layer).__name__}) of model {graph.model.name!r} "
                f"cannot be called again on symbolic inputs to build stage model {name!r}: "
                f"{type(exc).__name__}: {exc}. hyparflow rebuilds each stage by calling the "
                "model's layers on new keras.Input tensors; make the layer callable that way, "
                "or keep it inside a model used as a layer and pass hf.fit "
                "balance=hf.partition(model, P, keep_nested=True), or use partitions=1."
            ) from exc
        env.update(zip(c.outputs, outputs))
    return keras.Model(inputs, [env[k] for k in output_keys], name=name)


class WithMask(keras.layers.Layer):
    """A stage's received tensor with its Keras mask, received beside it: the tensor as it
    is, carrying the mask for the layers after it (which read it as model.fit's do)."""

    def call(self, inputs):
        return keras.ops.copy(inputs[0])

    def compute_mask(self, inputs, mask=None):
        return inputs[1]

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(inputs[0].shape, inputs[0].dtype)


def _check_output_masks(graph, last, partitions):
    """Refuse a model output whose mask (Keras' masking) its loss and metrics would read in
    `model.fit` but the last stage's rebuilt output has lost: a mask made on an earlier
    stage does not travel with the tensor it belongs to."""
    for k, ours in zip(graph.outputs, last.outputs):
        if keras_private.mask_of(graph.tensors[k]) is not None and \
                keras_private.mask_of(ours) is None:
            raise ValueError(
                f"partitions={partitions}: model output {graph.names[k]!r} of model "
                f"{graph.model.name!r} carries a mask (Keras' masking: Embedding(mask_zero="
                "True), Masking, ...), which model.fit's loss and metrics read; made on an "
                "earlier stage, it does not reach the last stage, whose loss would count the "
                "masked entries. Train this model with partitions=1 (data parallel), or give "
                "the loss the mask as sample weights instead (sample_weight=(x != 0), which "
                "Keras' loss reads as it reads a mask).")


def _check_dense(graph, key, balance):
    """A boundary tensor must be numbers, not ragged: stages exchange dense buffers.
    (Keras' symbolic `sparse` flag is not reliable — `dense * 0.5` claims it — so a sparse
    boundary is caught as it is sent, `stage.to_numpy`.)"""
    if str(graph.tensors[key].dtype) == "string":
        raise ValueError(
            f"balance={balance!r} cuts model {graph.model.name!r} after "
            f"{graph.names[key]!r}, a tensor of strings: only numbers cross a cut. Give an "
            "explicit balance that keeps the layers reading it (TextVectorization, "
            "StringLookup, Hashing) on the stage that makes it.")
    if key in graph.masked_at_run:
        raise ValueError(
            f"balance={balance!r} cuts model {graph.model.name!r} after "
            f"{graph.names[key]!r}, which {graph.masked_at_run[key]!r} gives a Keras mask at "
            "run time that the model's graph does not record (its compute_mask does not "
            "make it), so it cannot follow the tensor to another stage. Give a balance that "
            "keeps the calls reading it on the same stage, or a balance method (which does).")
    if graph.tensors[key].ragged:
        raise ValueError(
            f"balance={balance!r} cuts model {graph.model.name!r} after "
            f"{graph.names[key]!r}, a ragged tensor: stages exchange dense tensors only. "
            "Give an explicit balance (a list of calls per stage, or the layer names that "
            "start stages) that cuts where tensors are dense, e.g. after a pooling or "
            "Dense layer.")


def _check_shared_layers(graph, stage_of):
    """Refuse a split that puts the calls of a layer with state of its own on several stages
    (one whose weights are all trainable is tied: `tied_weights`)."""
    for indices in graph.layer_calls().values():
        stages = sorted({int(stage_of[i]) for i in indices})
        layer = graph.calls[indices[0]].layer
        if len(stages) > 1 and not balance_.tieable(layer):
            names = [graph.calls[i].name for i in indices]
            state = [w.path for w in layer.non_trainable_weights]
            raise ValueError(
                f"layer {layer.name!r} is called at several places ({names}) and this split puts "
                f"its calls on stages {stages}; its state ({', '.join(state[:3])}) moves in "
                "each call, which stages apart cannot do as one model does. Choose a split "
                "that keeps them together (balance=[layer names or counts]) or fewer "
                "partitions.")


def tied_weights(stages):
    """{variable path: the stages holding it} for each trainable variable of several stages
    (a layer called on each: `hyparflow.engine.tied`), in stage order."""
    held = {}
    for st in stages:
        for v in st.model.trainable_variables:
            held.setdefault(v.path, []).append(st.index)
    return {path: s for path, s in held.items() if len(s) > 1}


def _input_name(tensor_name, taken=()):
    """A keras.Input name for a tensor (Keras names may not contain '/'), not one of the
    `taken` layer names."""
    name = tensor_name.replace("/", "__")
    return f"{name}_received" if name in taken else name
