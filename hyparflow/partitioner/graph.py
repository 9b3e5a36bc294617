"""Keras model → DAG of layer calls and tensors, in topological order."""

from dataclasses import dataclass, field

import keras
from keras.src.models.functional import Functional


@dataclass
class Call:
    """One call of a layer (or operation) in the model's graph.

    Attributes:
        index: position in the topological order.
        name: the layer's name, with ``.k`` appended for its k-th call (k ≥ 1)
            when the layer is called more than once.
        node: the Keras node recording the call (operation and arguments).
        inputs: keys of the tensors the call consumes, in argument order, once each.
        outputs: keys of the tensors the call produces.
    """

    index: int
    name: str
    node: object
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)

    @property
    def layer(self):
        return self.node.operation


class LayerGraph:
    """The calls of a functional model and the tensors between them.

    Tensors are identified by a key (``id`` of the Keras tensor); `tensors` maps a
    key to the Keras tensor, `names` to a readable name, `producer` to the index
    of the call that produces it (``None`` for a model input), `consumers` to the
    indices of the calls that take it.
    """

    def __init__(self, model):
        functional = functional_of(model)
        self.model = model
        self.functional = functional
        self.inputs = [id(t) for t in functional.inputs]
        self.outputs = [id(t) for t in functional.outputs]
        self.tensors = {}
        self.names = {}
        self.producer = {}
        self.consumers = {}
        self.calls = []
        for t in functional.inputs:
            self._add_tensor(t, t._keras_history.operation.name, None)
        times_called = {}
        for depth in sorted(functional._nodes_by_depth, reverse=True):
            for node in functional._nodes_by_depth[depth]:
                if node.is_input or node.operation is None:
                    continue
                op = node.operation
                k = times_called.get(id(op), 0)
                times_called[id(op)] = k + 1
                call = Call(index=len(self.calls), name=op.name if k == 0 else f"{op.name}.{k}",
                            node=node)
                for t in node.input_tensors:
                    if id(t) not in call.inputs:
                        call.inputs.append(id(t))
                    self.consumers.setdefault(id(t), []).append(call.index)
                for j, t in enumerate(node.outputs):
                    suffix = f":{j}" if len(node.outputs) > 1 else ""
                    self._add_tensor(t, call.name + suffix, call.index)
                    call.outputs.append(id(t))
                self.calls.append(call)
        for key in self.consumers:
            self.consumers[key] = sorted(set(self.consumers[key]))

    def _add_tensor(self, tensor, name, producer):
        self.tensors[id(tensor)] = tensor
        self.names[id(tensor)] = name
        self.producer[id(tensor)] = producer

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
    return isinstance(model, Functional)


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
    if isinstance(model, Functional):
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}.")
    raise ValueError(
        f"model {model.name!r} is a subclassed keras.Model ({type(model).__name__}); its "
        "layer graph cannot be traced, so it cannot be split into stages. Use partitions=1 "
        "(data parallelism, which works for any model), or build it with the functional API "
        "(keras.Input → layers → keras.Model(inputs, outputs))."
    )
