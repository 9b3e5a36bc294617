"""Keras model → DAG of layer calls and tensors, in topological order."""

import heapq
import weakref
from collections import ChainMap
from dataclasses import dataclass, field

import keras
from keras import tree

from hyparflow.keras import keras_private


@dataclass
class Call:
    """One call of a layer (or operation) in the model's graph.

    Attributes:
        index: position in the topological order.
        name: the layer's name, prefixed with the names of the models it is nested in
            (``outer/block/dense``), with ``.k`` appended for its k-th call (k ≥ 1)
            when the layer is called more than once.
        node: the Keras node recording the call (operation and arguments).
        inputs: keys of the tensors the call consumes, in argument order, once each; then
            the masks (Keras' masking) of those, which a layer may read from its input
            without taking them as an argument (MultiHeadAttention reads its query's).
        outputs: keys of the tensors the call produces.
        bindings: ``{id(Keras tensor in node.arguments): key}``, to replay the call.
    """

    index: int
    name: str
    node: object
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    bindings: dict = field(default_factory=dict)

    @property
    def layer(self):
        return self.node.operation

    def replay(self, env, **overrides):
        """Call the layer again on ``env[key]`` tensors; returns its outputs, flat."""
        args, kwargs = self.node.arguments.fill_in(
            {tid: env[key] for tid, key in self.bindings.items()})
        return tree.flatten(self.layer(*args, **{**kwargs, **overrides}))


class _CannotCutThrough(ValueError):
    """The calls of the model used as a layer at prefix `nested` ("outer/inner/"; "" for
    the model itself) cannot be cut apart: that model is kept whole."""

    def __init__(self, message, nested):
        super().__init__(message)
        self.nested = nested


class LayerGraph:
    """The calls of a functional model and the tensors between them.

    Models used as layers (functional or Sequential) are split through: their
    calls appear in place of the model's call, named ``model/layer``, unless
    `keep_nested` is set, the call passes arguments their graph cannot honour
    (e.g. ``training=False``), or a mask inside cannot follow its tensor to another
    stage (`kept_whole`).

    Tensors are identified by an integer key; `tensors` maps a key to a Keras
    tensor of that shape and dtype, `names` to a readable name, `producer` to the
    index of the call that produces it (``None`` for a model input), `consumers`
    to the indices of the calls that take it, `masks` a tensor's to the key of its Keras
    mask (`Embedding(mask_zero=True)`'s, carried by the tensors after it) where it has one.
    The calls are in Keras' order, except that a call comes after every call whose
    tensors it reads, its inputs' masks included.
    """

    def __init__(self, model, keep_nested=False):
        functional = functional_of(model)
        self.model = model
        self.functional = functional
        self.keep_nested = keep_nested
        # models used as layers kept whole because their calls cannot be cut apart, by
        # prefix ("outer/inner/"): each found by a walk that failed, then walked again
        self.kept_whole = set()
        while True:
            try:
                self._build(functional)
                break
            except _CannotCutThrough as exc:
                if not exc.nested or exc.nested in self.kept_whole:
                    raise ValueError(str(exc)) from None
                self.kept_whole.add(exc.nested)

    @classmethod
    def of(cls, model, keep_nested=False):
        """`LayerGraph(model, keep_nested)`, walked once per model and layers (every hf.fit
        checks the cut: ResNet-1001's walk takes a second). A Sequential given another layer
        is another model here."""
        cache = model.__dict__.setdefault("_hyparflow_graphs", {})
        key = (keep_nested, tuple(map(id, keras_private.all_layers(model))))
        if key not in cache:
            for stale in [k for k in cache if k[1] != key[1]]:  # of layers it no longer has
                del cache[stale]
            cache[key] = cls(model, keep_nested)
        return cache[key]

    def _build(self, functional):
        self.tensors = {}
        self.names = {}
        self.producer = {}
        self.consumers = {}
        self.masks = {}
        self.calls = []
        self._times_called = {}
        self._masked = []  # (call, its model's scope of tensors, prefix), for `_add_masks`
        self._carried = {}  # {key: its mask} inside nested models called on masked tensors
        self._cleared = {}  # {key: [deleting layer's name, scope, prefix, key without mask]}
        # {key: its call's name} of the outputs given a Keras mask at run time that the
        # model's graph does not record: it cannot follow them to another stage
        self.masked_at_run = {}
        scope = {}
        self.inputs = [self._add_tensor(t, keras_private.producer_name(t), None, scope)
                       for t in functional.inputs]
        self._walk(functional, scope, "")
        self.outputs = [scope[id(t)] for t in functional.outputs]
        self._add_masks()
        del self._times_called, self._masked, self._carried, self._cleared
        self._after_what_they_read()
        self._hoist_heads()
        for key in self.consumers:
            self.consumers[key] = sorted(set(self.consumers[key]))

    def _hoist_heads(self):
        """Move each call whose outputs only leave the model to just after its inputs.

        Keras orders calls by depth from the outputs, so every output head comes
        last; an early head (an auxiliary or second output) would then drag its
        input through every later stage. Right after its inputs, the stage that
        computes it sends only its (usually small) output to the last stage.
        """
        def key(call):
            if any(self.consumers.get(k) for k in call.outputs):
                return (call.index, 0)
            anchor = max((self.producer[k] for k in call.inputs
                          if self.producer[k] is not None), default=-1)
            return (anchor, 1, call.index)

        self._reorder(sorted(self.calls, key=key))

    def _after_what_they_read(self):
        """Reorder the calls, as little as Keras' order allows, so that each comes after the
        producers of what it reads: a mask is made where its layer is called (Embedding's
        not_equal), and Keras' depth ordering can put it after a call that reads it."""
        needs = {c.index: {self.producer[k] for k in c.inputs if self.producer[k] is not None}
                 for c in self.calls}
        if all(p < i for i, ps in needs.items() for p in ps):
            return
        waiting = {i: len(ps) for i, ps in needs.items()}
        readers = {}
        for i, ps in needs.items():
            for p in ps:
                readers.setdefault(p, []).append(i)
        ready = [i for i, n in waiting.items() if n == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(self.calls[i])
            for j in readers.get(i, []):
                waiting[j] -= 1
                if waiting[j] == 0:
                    heapq.heappush(ready, j)
        self._reorder(order)

    def _reorder(self, order):
        """The calls in this `order`: indices, producers and consumers renumbered."""
        new = {c.index: i for i, c in enumerate(order)}
        for i, c in enumerate(order):
            c.index = i
        self.calls = order
        self.producer = {k: None if p is None else new[p] for k, p in self.producer.items()}
        self.consumers = {k: [new[c] for c in cs] for k, cs in self.consumers.items()}

    def _walk(self, functional, scope, prefix):
        """Add the calls of `functional`; `scope` maps its tensors' ids to keys."""
        nodes = keras_private.nodes_by_depth(functional)
        for depth in sorted(nodes, reverse=True):
            for node in nodes[depth]:
                if node.is_input or node.operation is None:
                    continue
                inner = self._splittable(node, prefix)
                if inner is not None:
                    self._expand(node, inner, scope, prefix)
                else:
                    self._add_layer_call(node, scope, prefix)

    def _splittable(self, node, prefix):
        """The functional graph of a nested model call to split through, else None."""
        op = node.operation
        if self.keep_nested or not isinstance(op, keras.Model) or not is_graph_model(op) \
                or f"{prefix}{op.name}/" in self.kept_whole:
            return None
        args, kwargs = node.arguments.args, node.arguments.kwargs
        if len(args) != 1 or any(v is not None for k, v in kwargs.items() if k != "mask"):
            return None
        # Keras records the masks its argument carries (`_expand` carries them inside);
        # another mask, given by hand, is the call's own business: keep it whole
        given = kwargs.get("mask")
        if given is not None and any(
                m is not None and m is not keras_private.mask_of(a)
                for a, m in zip(tree.flatten(args[0]), _flat_like(given, args[0]))):
            return None
        inner = functional_of(op)
        try:
            tree.assert_same_structure(args[0], keras_private.inputs_struct(inner))
        except (ValueError, TypeError):
            return None
        if not all(isinstance(a, keras.KerasTensor) for a in tree.flatten(args[0])):
            return None  # a constant among the inputs: keep the call whole
        return inner

    def _expand(self, node, inner, scope, prefix):
        # (a mask carried in may be made by ops on the outer model's tensors: they are
        # looked up in the outer scope)
        inner_scope = ChainMap({}, scope)
        for t, a in zip(tree.flatten(keras_private.inputs_struct(inner)),
                        tree.flatten(node.arguments.args[0])):
            inner_scope[id(t)] = scope[id(a)]
            if keras_private.mask_of(a) is not None:
                self._carried[scope[id(a)]] = (keras_private.mask_of(a), scope, prefix)
        inner_prefix = f"{prefix}{node.operation.name}/"
        self._walk(inner, inner_scope, inner_prefix)
        outputs = list(zip(tree.flatten(keras_private.outputs_struct(inner)),
                           tree.flatten(node.outputs)))
        for j, (t, o) in enumerate(outputs):
            if keras_private.mask_of(o) is None and \
                    self._mask(inner_scope[id(t)]) is not None:
                # a model that does not support masking drops its outputs' masks
                suffix = f"_{j}" if len(outputs) > 1 else ""
                t = WithoutMask(name=f"mask_dropped{suffix}")(t)
                self._add_call(keras_private.producing_node(t), inner_scope, inner_prefix)
            scope[id(o)] = inner_scope[id(t)]

    def _add_layer_call(self, node, scope, prefix):
        """Add a call of the model's graph. A layer may delete the masks its inputs carry
        when it runs (MultiHeadAttention does, to handle them itself; so do layers that
        call one on their input): Keras' calls after it, in Keras' order, then read
        those inputs without their masks wherever the masks are not recorded arguments
        (inside a nested model called on a masked tensor, and for MultiHeadAttention's
        query). That is made explicit here, whatever order the calls end up running in:
        such a layer reads a copy of each input (`MaskKept`), and the calls after it read
        a copy without the mask (`WithoutMask`, made when one needs it)."""
        bind = {}
        for t in node.input_tensors:
            key = scope[id(t)]
            if key in self._cleared:
                bind[id(t)] = self._without_mask(key)
        keys = {id(t): bind.get(id(t), scope[id(t)]) for t in node.input_tensors}
        deleted, seen = self._run_apart(node, keys)
        for j, key in enumerate(deleted):
            copy = self.tensors[key]
            copy = MaskKept(name=f"{node.operation.name}_input{j or ''}")(copy)
            self._add_call(keras_private.producing_node(copy), scope, prefix,
                           {id(self.tensors[key]): key})
            if key in self._carried:
                self._carried[scope[id(copy)]] = self._carried[key]
            for t in node.input_tensors:
                if keys[id(t)] == key:
                    bind[id(t)] = scope[id(copy)]
            self._cleared[key] = [node.operation.name, scope, prefix, None]
        call = self._add_call(node, scope, prefix, bind, seen)
        for key, at_run in zip(call.outputs, seen or []):
            if at_run not in (None, False) and self._mask(key) is None:
                self.masked_at_run[key] = call.name

    def _without_mask(self, key):
        """The key of tensor `key` without its mask, after a layer deleted it (`_cleared`),
        adding the call that makes it the first time."""
        name, scope, prefix, after = self._cleared[key]
        if after is None:
            tensor = WithoutMask(name=f"{name}_cleared")(self.tensors[key])
            self._add_call(keras_private.producing_node(tensor), scope, prefix,
                           {id(self.tensors[key]): key})
            after = self._cleared[key][3] = scope[id(tensor)]
        return after

    def _run_apart(self, node, keys):
        """What a layer call does with the masks its inputs (`keys`: {id(argument): key})
        carry when it runs, seen by tracing it once (never run) on tensors carrying them:
        (the keys whose masks it deletes, and per output None, the key of the input whose
        mask it carries, or True for a mask of its own). ([], None) when no input has a
        mask or the call cannot be traced apart."""
        order = list(dict.fromkeys(keys.values()))
        masked = [k for k in order if self._mask(k) is not None]
        if not masked or not isinstance(node.operation, keras.Layer):
            return [], None
        # (the same model walked again, by the planner or another P: the same answer)
        asked = (tuple(keys.items()), tuple(masked))
        known = _traced.setdefault(node, {})
        if asked not in known:
            known[asked] = self._trace_apart(node, keys, order, masked)
        return known[asked]

    def _trace_apart(self, node, keys, order, masked):
        import tensorflow as tf

        found = []

        def call(*tensors):
            env = dict(zip(order, tensors))
            masks = dict(zip(masked, tensors[len(order):]))
            for k, mask in masks.items():
                keras_private.set_mask(env[k], mask)
            args, kwargs = node.arguments.fill_in({t: env[k] for t, k in keys.items()})
            outputs = tree.flatten(node.operation(*args, **kwargs))
            found.append([k for k in masked if keras_private.mask_of(env[k]) is None])
            found.append([None if keras_private.mask_of(o) is None else next(
                (k for k, m in masks.items() if m is keras_private.mask_of(o)), True)
                for o in outputs])
            return []

        specs = [tf.TensorSpec(self.tensors[k].shape, self.tensors[k].dtype) for k in order]
        specs += [tf.TensorSpec(self._mask(k).shape, self._mask(k).dtype) for k in masked]
        try:
            tf.function(call, autograph=False).get_concrete_function(*specs)
        except Exception:  # (it cannot be traced apart: Keras' rules stand)
            return [], None
        return found

    def _add_call(self, node, scope, prefix, bind=None, seen=None):
        """Add a call of `node`; `bind`: {id(its argument): key} where it is not the key
        `scope` holds; `seen`: its outputs' masks at run time (`_run_apart`), if known."""
        op = node.operation
        k = self._times_called.get(id(op), 0)
        self._times_called[id(op)] = k + 1
        name = prefix + op.name + (f".{k}" if k else "")
        call = Call(index=len(self.calls), name=name, node=node)
        for t in node.input_tensors:
            key = (bind or {}).get(id(t), scope[id(t)])
            call.bindings[id(t)] = key
            if key not in call.inputs:
                call.inputs.append(key)
            self.consumers.setdefault(key, []).append(call.index)
        for j, t in enumerate(node.outputs):
            suffix = f":{j}" if len(node.outputs) > 1 else ""
            call.outputs.append(self._add_tensor(t, name + suffix, call.index, scope))
        self.calls.append(call)
        self._masked.append((call, scope, prefix))
        self._carry(call, scope, prefix, seen)
        return call

    def _carry(self, call, scope, prefix, seen=None):
        """Propagate the masks carried into a nested model (whose own graph holds none)
        through one of its calls as they go at run time: an input's own where the traced
        call (`seen`) passes it on, else the first argument's mask through the layer's
        `compute_mask`, as Keras' `Layer.__call__` does."""
        layer = call.layer
        if (not isinstance(layer, keras.Layer)
                or not any(k in self._carried for k in call.inputs)
                or any(keras_private.mask_of(t) is not None for t in call.node.outputs)):
            return
        made = [None] * len(call.outputs)
        args = call.node.arguments
        first = args.args[0] if args.args else next(iter(args.kwargs.values()))
        previous = tree.map_structure(lambda t: self._mask(call.bindings[id(t)]), first)
        if layer.supports_masking and any(m is not None for m in tree.flatten(previous)):
            masks = layer.compute_mask(first, previous)
            made = tree.flatten(masks) if masks is not None else made
        for j, key in enumerate(call.outputs):
            at_run = seen[j] if seen is not None else made[j] is not None
            if at_run is True and made[j] is None:  # (the nested model is kept whole)
                raise _CannotCutThrough(
                    f"{call.name!r} ({type(layer).__name__}) gives its output a Keras mask "
                    "of its own at run time, which its compute_mask does not say how to "
                    "make, so it cannot follow the output to another stage. Call the "
                    "nested model on a tensor without a mask (give the mask as an "
                    "argument instead), or use partitions=1.", prefix)
            if at_run is True:
                self._carried[key] = (made[j], scope, prefix)
            elif at_run is not None and at_run is not False:
                self._carried[key] = self._carried.get(
                    at_run, (keras_private.mask_of(self.tensors[at_run]), scope, prefix))

    def _mask(self, key):
        """A tensor's mask: the one carried into a nested model, else the one Keras
        attached to it, or None."""
        carried = self._carried.get(key)
        return carried[0] if carried else keras_private.mask_of(self.tensors[key])

    def _add_masks(self):
        """Each call's inputs' masks as inputs of the call too (`Call.inputs`), and `masks`:
        known once every call is walked (a mask's op may come later in Keras' order)."""
        k = 0
        while k < len(self._masked):  # (a mask's own ops are added as they are found)
            call, scope, prefix = self._masked[k]
            k += 1
            for t in call.node.input_tensors:
                key = self._mask_key(call.bindings[id(t)], scope, prefix)
                if key is not None and key not in call.inputs:
                    call.inputs.append(key)
                    self.consumers.setdefault(key, []).append(call.index)
            for key in call.outputs:
                mask = self._mask_key(key, scope, prefix)
                if mask is not None:
                    self.masks[key] = mask

    def _mask_key(self, key, scope, prefix):
        """The key of a tensor's mask (`_mask`), or None if it has none."""
        if key not in self._carried:
            return self._key_of(keras_private.mask_of(self.tensors[key]), scope, prefix)
        mask, where, at = self._carried[key]
        made = self._key_of(mask, where, at)
        if made is None:  # (the nested model reading it is kept whole)
            raise _CannotCutThrough(
                f"the Keras mask of {self.names[key]!r} is made from tensors the model's "
                "graph does not hold, so it cannot follow that tensor to another stage. "
                "Call the nested model on a tensor without a mask (give the mask as an "
                "argument instead), or use partitions=1.", prefix)
        return made

    def _key_of(self, tensor, scope, prefix):
        """The key of a Keras tensor of this scope, adding the calls that make it when the
        model's graph does not hold them (a mask no layer takes as an argument: Keras
        records its ops, Embedding's not_equal, but no output depends on them); None if
        it is none or is not made from this scope's tensors."""
        if tensor is None or not self._makeable(tensor, scope):
            return None
        if id(tensor) not in scope:
            node = keras_private.producing_node(tensor)
            for t in node.input_tensors:
                self._key_of(t, scope, prefix)
            self._add_call(node, scope, prefix)
        return scope[id(tensor)]

    def _makeable(self, tensor, scope):
        """Whether a Keras tensor is of this scope or made by ops from its tensors."""
        if id(tensor) in scope:
            return True
        node = keras_private.producing_node(tensor)
        return (node is not None and not node.is_input and node.operation is not None
                and all(self._makeable(t, scope) for t in node.input_tensors))

    def _add_tensor(self, tensor, name, producer, scope):
        key = len(self.tensors)
        scope[id(tensor)] = key
        self.tensors[key] = tensor
        self.names[key] = name
        self.producer[key] = producer
        return key

    def __len__(self):
        return len(self.calls)

    def layer_calls(self):
        """{id(layer): [indices of its calls]} for layers called more than once."""
        calls = {}
        for call in self.calls:
            calls.setdefault(id(call.layer), []).append(call.index)
        return {k: v for k, v in calls.items() if len(v) > 1}


_traced = weakref.WeakKeyDictionary()  # node → {its inputs' keys and masks: `_run_apart`'s}


class MaskKept(keras.layers.Layer):
    """A tensor as it is, with its mask: a copy for a layer that deletes its inputs'."""

    def call(self, inputs):
        return keras.ops.copy(inputs)

    def compute_mask(self, inputs, mask=None):
        return mask


class WithoutMask(keras.layers.Layer):
    """A tensor without its mask: a nested model's output as the model outside sees it (a
    Functional model drops its outputs' masks), or a tensor after a layer deleted its mask."""

    def call(self, inputs):
        return keras.ops.copy(inputs)

    def compute_mask(self, inputs, mask=None):
        return None


def _flat_like(masks, args):
    """`masks` flat in the order of `args`' tensors (Keras records one mask per tensor, or a
    single one for a single tensor)."""
    flat = tree.flatten(masks)
    return flat if len(flat) == len(tree.flatten(args)) else [masks]


def is_graph_model(model):
    """Whether `model` is functional or a built Sequential (its graph can be split)."""
    if isinstance(model, keras.Sequential):
        return keras_private.sequential_graph(model) is not None
    return keras_private.is_functional(model)


def functional_of(model):
    """The functional graph behind `model`.

    Raises:
        ValueError: `model` is subclassed, or a Sequential model without an input shape.
    """
    if isinstance(model, keras.Sequential):
        functional = keras_private.sequential_graph(model)
        if functional is None:
            raise ValueError(
                f"model {model.name!r} is a Sequential model without a known input shape, "
                "so its layer graph cannot be split. Start it with keras.Input(shape=...) "
                "or call model.build(input_shape) first."
            )
        return functional
    if keras_private.is_functional(model):
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}.")
    raise ValueError(
        f"model {model.name!r} is a subclassed keras.Model ({type(model).__name__}); its "
        "layer graph cannot be traced, so it cannot be split into stages. Use partitions=1 "
        "(data parallelism, which works for any model), or build it with the functional API "
        "(keras.Input → layers → keras.Model(inputs, outputs))."
    )
