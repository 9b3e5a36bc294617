"""Keras model → DAG of layer calls and tensors, in topological order."""

import heapq
from dataclasses import dataclass, field

import keras
from keras import tree

from hyparflow import keras_private


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


class LayerGraph:
    """The calls of a functional model and the tensors between them.

    Models used as layers (functional or Sequential) are split through: their
    calls appear in place of the model's call, named ``model/layer``, unless
    `keep_nested` is set or the call passes arguments their graph cannot honour
    (e.g. ``training=False``).

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
        self.tensors = {}
        self.names = {}
        self.producer = {}
        self.consumers = {}
        self.masks = {}
        self.calls = []
        self._times_called = {}
        self._masked = []  # (call, its model's scope of tensors, prefix), for `_add_masks`
        scope = {}
        self.inputs = [self._add_tensor(t, keras_private.producer_name(t), None, scope)
                       for t in functional.inputs]
        self._walk(functional, scope, "")
        self.outputs = [scope[id(t)] for t in functional.outputs]
        self._add_masks()
        del self._times_called, self._masked
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
                inner = self._splittable(node)
                if inner is not None:
                    self._expand(node, inner, scope, prefix)
                else:
                    self._add_call(node, scope, prefix)

    def _splittable(self, node):
        """The functional graph of a nested model call to split through, else None."""
        op = node.operation
        if self.keep_nested or not isinstance(op, keras.Model) or not is_graph_model(op):
            return None
        args, kwargs = node.arguments.args, node.arguments.kwargs
        # (Keras records `mask` for a dict input even when every entry is None)
        if len(args) != 1 or any(v is not None for v in tree.flatten(list(kwargs.values()))):
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
        inner_scope = {id(t): scope[id(a)] for t, a in zip(
            tree.flatten(keras_private.inputs_struct(inner)),
            tree.flatten(node.arguments.args[0]))}
        self._walk(inner, inner_scope, f"{prefix}{node.operation.name}/")
        for t, o in zip(tree.flatten(keras_private.outputs_struct(inner)),
                        tree.flatten(node.outputs)):
            scope[id(o)] = inner_scope[id(t)]

    def _add_call(self, node, scope, prefix):
        op = node.operation
        k = self._times_called.get(id(op), 0)
        self._times_called[id(op)] = k + 1
        name = prefix + op.name + (f".{k}" if k else "")
        call = Call(index=len(self.calls), name=name, node=node)
        for t in node.input_tensors:
            key = scope[id(t)]
            call.bindings[id(t)] = key
            if key not in call.inputs:
                call.inputs.append(key)
            self.consumers.setdefault(key, []).append(call.index)
        for j, t in enumerate(node.outputs):
            suffix = f":{j}" if len(node.outputs) > 1 else ""
            call.outputs.append(self._add_tensor(t, name + suffix, call.index, scope))
        self.calls.append(call)
        self._masked.append((call, scope, prefix))

    def _add_masks(self):
        """Each call's inputs' masks as inputs of the call too (`Call.inputs`), and `masks`:
        known once every call is walked (a mask's op may come later in Keras' order)."""
        k = 0
        while k < len(self._masked):  # (a mask's own ops are added as they are found)
            call, scope, prefix = self._masked[k]
            k += 1
            for t in call.node.input_tensors:
                key = self._key_of(keras_private.mask_of(t), scope, prefix)
                if key is not None and key not in call.inputs:
                    call.inputs.append(key)
                    self.consumers.setdefault(key, []).append(call.index)
            for t, key in zip(call.node.outputs, call.outputs):
                mask = self._key_of(keras_private.mask_of(t), scope, prefix)
                if mask is not None:
                    self.masks[key] = mask

    def _key_of(self, tensor, scope, prefix):
        """The key of a Keras tensor of this scope, adding the calls that make it when the
        model's graph does not hold them (a mask no layer takes as an argument: Keras
        records its ops, Embedding's not_equal, but no output depends on them); None if
        it is none or is not made from this scope's tensors."""
        if tensor is None or id(tensor) in scope:
            return None if tensor is None else scope[id(tensor)]
        node = keras_private.producing_node(tensor)
        if node is None or node.is_input or node.operation is None or any(
                self._key_of(t, scope, prefix) is None for t in node.input_tensors):
            return None
        self._add_call(node, scope, prefix)
        return scope.get(id(tensor))

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


def is_graph_model(model):
    """Whether `model` is functional or a built Sequential (its graph can be split)."""
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None) is not None
    return keras_private.is_functional(model)


def functional_of(model):
    """The functional graph behind `model`.

    Raises:
        ValueError: `model` is subclassed, or a Sequential model without an input shape.
    """
    if isinstance(model, keras.Sequential):
        functional = getattr(model, "_functional", None)
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
