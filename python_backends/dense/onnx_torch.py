"""An imported model's ONNX network run op by op under PyTorch: frozen weights, gradients to its inputs.

``recserve learn`` trains an imported model's embedding rows through the user's own dense network,
which it only has as ONNX. ONNX Runtime scores it but gives no gradient, so :class:`OnnxGraph`
evaluates the graph's nodes in order with torch operators: the network's weights (its initializers
and constants) stay fixed, and the loss's gradient flows back to the embeddings it was given.
:class:`OnnxNet` puts it where the learner puts the bundled network (``score(named)``).

The operators are those PyTorch exports for CTR networks (MLPs, attention, FM interactions,
layer and batch normalization, shape arithmetic); a graph using another is refused when it is
loaded, naming the operators, and its rows are not trained. The checks in
``tests/unit/test_onnx_torch.py`` hold it to ONNX Runtime's scores on the bundled network.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recserve.core.names import DENSE_NORMALIZED, PROBABILITY

Tensor = torch.Tensor
#: an operator: (its inputs, None where left out; its attributes) -> its outputs
Operator = Callable[[list[Any], dict[str, Any]], tuple[Any, ...]]

#: ONNX TensorProto element types -> torch dtypes (those a CTR network uses)
DTYPES = {
    1: torch.float32,
    2: torch.uint8,
    3: torch.int8,
    6: torch.int32,
    7: torch.int64,
    9: torch.bool,
    10: torch.float16,
    11: torch.float64,
}


def _axes(value: Any, attrs: dict[str, Any]) -> list[int] | None:
    """Axes given as an input (opset 13 on) or as the ``axes`` attribute (before); None: none given."""
    if value is not None:
        return [int(a) for a in value.reshape(-1).tolist()]
    axes = attrs.get("axes")
    return None if axes is None else [int(a) for a in axes]


def _unsqueeze(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    x, axes = args[0], _axes(args[1] if len(args) > 1 else None, attrs) or []
    rank = x.dim() + len(axes)
    for axis in sorted(a % rank for a in axes):
        x = x.unsqueeze(axis)
    return (x,)


def _squeeze(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    x, axes = args[0], _axes(args[1] if len(args) > 1 else None, attrs)
    if axes is None:
        return (x.squeeze(),)
    for axis in sorted((a % x.dim() for a in axes), reverse=True):
        x = x.squeeze(axis)
    return (x,)


def _gemm(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    a, b = args[0], args[1]
    a = a.T if attrs.get("transA", 0) else a
    b = b.T if attrs.get("transB", 0) else b
    y = attrs.get("alpha", 1.0) * (a @ b)
    if len(args) > 2 and args[2] is not None:
        y = y + attrs.get("beta", 1.0) * args[2]
    return (y,)


def _reduce(fn: Callable[..., Tensor]) -> Operator:
    def reduce(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
        x, axes = args[0], _axes(args[1] if len(args) > 1 else None, attrs)
        keep = bool(attrs.get("keepdims", 1))
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return (x,)
            axes = list(range(x.dim()))
        return (fn(x, dim=tuple(axes), keepdim=keep),)

    return reduce


def _reshape(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    x, shape = args[0], [int(s) for s in args[1].tolist()]
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return (x.reshape(shape),)


def _gather(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    x, indices = args[0], args[1].long()
    axis = attrs.get("axis", 0) % x.dim()
    indices = torch.where(indices < 0, indices + x.shape[axis], indices)
    taken = x.index_select(axis, indices.reshape(-1))
    return (taken.reshape([*x.shape[:axis], *indices.shape, *x.shape[axis + 1 :]]),)


def _slice(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    x = args[0]
    starts, ends = args[1].tolist(), args[2].tolist()
    axes = args[3].tolist() if len(args) > 3 and args[3] is not None else list(range(len(starts)))
    steps = args[4].tolist() if len(args) > 4 and args[4] is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        if step < 0:
            raise ValueError("Slice with a negative step is not supported")
        size = x.shape[axis]
        index[axis % x.dim()] = slice(max(min(start, size), -size), max(min(end, size), -size - 1), step)
    return (x[tuple(index)],)


def _layer_norm(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    x, scale = args[0], args[1]
    bias = args[2] if len(args) > 2 else None
    axis = attrs.get("axis", -1) % x.dim()
    shape = x.shape[axis:]
    return (torch.nn.functional.layer_norm(x, shape, scale, bias, attrs.get("epsilon", 1e-5)),)


def _batch_norm(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    x, scale, bias, mean, var = args[:5]
    y = torch.nn.functional.batch_norm(x, mean, var, scale, bias, False, 0.0, attrs.get("epsilon", 1e-5))
    return (y,)


def _constant(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    from onnx import numpy_helper

    if "value" in attrs:
        return (torch.from_numpy(np.array(numpy_helper.to_array(attrs["value"]))),)
    for name, dtype in (("value_float", torch.float32), ("value_floats", torch.float32),
                        ("value_int", torch.int64), ("value_ints", torch.int64)):  # fmt: skip
        if name in attrs:
            return (torch.tensor(attrs[name], dtype=dtype),)
    raise ValueError(f"Constant with attributes {sorted(attrs)} is not supported")


def _constant_of_shape(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    from onnx import numpy_helper

    value = attrs.get("value")
    fill = torch.from_numpy(np.array(numpy_helper.to_array(value))) if value is not None else torch.zeros(1)
    return (torch.full([int(s) for s in args[0].tolist()], fill.reshape(-1)[0].item(), dtype=fill.dtype),)


def _clip(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    low = args[1] if len(args) > 1 and args[1] is not None else attrs.get("min")
    high = args[2] if len(args) > 2 and args[2] is not None else attrs.get("max")
    return (torch.clamp(args[0], low, high),)


def _shape(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    shape = torch.tensor(list(args[0].shape), dtype=torch.int64)
    return (shape[attrs.get("start", 0) : attrs.get("end", None)],)


def _elementwise(fn: Callable[..., Any]) -> Operator:
    return lambda args, attrs: (fn(*args),)


def _flatten(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    """ONNX's Flatten: two dimensions, those before ``axis`` and the rest."""
    x = args[0]
    axis = attrs.get("axis", 1) % (x.dim() + 1)
    return (x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1),)


def _divide(a: Tensor, b: Tensor) -> Tensor:
    """ONNX's Div: integers truncate."""
    return a / b if a.is_floating_point() else torch.div(a, b, rounding_mode="trunc")


def _expand(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    x = args[0]
    return (x.expand(torch.broadcast_shapes(x.shape, tuple(int(s) for s in args[1].tolist()))),)


def _range(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    start, limit, delta = (a.item() for a in args)
    return (torch.arange(start, limit, delta, dtype=args[0].dtype),)


def _softmax(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    return (torch.softmax(args[0], attrs.get("axis", -1)),)


def _transpose(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor]:
    perm = attrs.get("perm") or list(reversed(range(args[0].dim())))
    return (args[0].permute(*perm),)


def _split(args: list[Any], attrs: dict[str, Any]) -> tuple[Tensor, ...]:
    x, axis = args[0], attrs.get("axis", 0)
    sizes = args[1].tolist() if len(args) > 1 and args[1] is not None else attrs.get("split")
    if sizes is None:
        parts = attrs["num_outputs"]
        sizes = [x.shape[axis] // parts] * parts
    return tuple(torch.split(x, [int(s) for s in sizes], dim=axis))


OPS: dict[str, Operator] = {
    "Abs": _elementwise(torch.abs),
    "Add": _elementwise(torch.add),
    "And": _elementwise(torch.logical_and),
    "BatchNormalization": _batch_norm,
    "Cast": lambda args, attrs: (args[0].to(DTYPES[attrs["to"]]),),
    "Clip": _clip,
    "Concat": lambda args, attrs: (torch.cat(args, dim=attrs["axis"]),),
    "Constant": _constant,
    "ConstantOfShape": _constant_of_shape,
    "Div": _elementwise(
        lambda a, b: torch.div(a, b, rounding_mode="trunc") if not a.is_floating_point() else a / b
    ),
    "Einsum": lambda args, attrs: (torch.einsum(attrs["equation"].decode(), *args),),
    "Equal": _elementwise(torch.eq),
    "Exp": _elementwise(torch.exp),
    "Expand": _expand,
    "Flatten": _flatten,
    "Gather": _gather,
    "Gemm": _gemm,
    "Greater": _elementwise(torch.gt),
    "Identity": _elementwise(lambda x: x),
    "LayerNormalization": _layer_norm,
    "LeakyRelu": lambda args, attrs: (torch.nn.functional.leaky_relu(args[0], attrs.get("alpha", 0.01)),),
    "Less": _elementwise(torch.lt),
    "Log": _elementwise(torch.log),
    "MatMul": _elementwise(torch.matmul),
    "Max": _elementwise(lambda *xs: torch.stack(torch.broadcast_tensors(*xs)).amax(0)),
    "Min": _elementwise(lambda *xs: torch.stack(torch.broadcast_tensors(*xs)).amin(0)),
    "Mul": _elementwise(torch.mul),
    "Neg": _elementwise(torch.neg),
    "Not": _elementwise(torch.logical_not),
    "Pow": _elementwise(torch.pow),
    "Range": _range,
    "ReduceMax": _reduce(torch.amax),
    "ReduceMean": _reduce(torch.mean),
    "ReduceSum": _reduce(torch.sum),
    "Relu": _elementwise(torch.relu),
    "Reshape": _reshape,
    "Shape": _shape,
    "Sigmoid": _elementwise(torch.sigmoid),
    "Slice": _slice,
    "Softmax": _softmax,
    "Split": _split,
    "Sqrt": _elementwise(torch.sqrt),
    "Squeeze": _squeeze,
    "Sub": _elementwise(torch.sub),
    "Tanh": _elementwise(torch.tanh),
    "Transpose": _transpose,
    "Unsqueeze": _unsqueeze,
    "Where": _elementwise(torch.where),
}


class OnnxGraph:
    """An ONNX graph as a function of named torch tensors, differentiable with respect to them.

    Raises:
        ValueError: the graph uses operators that are not in :data:`OPS` (named), or is not ONNX.
    """

    def __init__(self, source: Path | bytes) -> None:
        import onnx
        from onnx import helper, numpy_helper

        model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(str(source))
        graph = model.graph
        unknown = sorted({node.op_type for node in graph.node} - set(OPS))
        if unknown:
            raise ValueError(
                f"the ONNX network uses {', '.join(unknown)}, which recserve learn cannot run under PyTorch"
            )
        self._constants = {
            init.name: torch.from_numpy(np.array(numpy_helper.to_array(init))) for init in graph.initializer
        }
        self._nodes = [
            (node.op_type, list(node.input), list(node.output),
             {a.name: helper.get_attribute_value(a) for a in node.attribute})
            for node in graph.node
        ]  # fmt: skip
        #: the graph's inputs (not its initializers) and the dtype each is given in
        self.inputs = {
            value.name: DTYPES[value.type.tensor_type.elem_type]
            for value in graph.input
            if value.name not in self._constants
        }
        self.outputs = [value.name for value in graph.output]

    def __call__(self, named: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The graph's outputs for ``named`` inputs (each cast to the type the graph declares)."""
        missing = sorted(set(self.inputs) - set(named))
        if missing:
            raise ValueError(f"the ONNX network needs inputs {missing}")
        values: dict[str, Any] = dict(self._constants)
        values.update({name: named[name].to(dtype) for name, dtype in self.inputs.items()})
        for op, inputs, outputs, attrs in self._nodes:
            results = OPS[op]([values[name] if name else None for name in inputs], attrs)
            values.update(zip(outputs, results, strict=False))
        return {name: values[name] for name in self.outputs}


class OnnxNet(torch.nn.Module):
    """An imported dense network (its served ONNX) where the learner puts the bundled one: frozen."""

    def __init__(self, source: Path | bytes) -> None:
        super().__init__()
        self.graph = OnnxGraph(source)
        if PROBABILITY not in self.graph.outputs:
            raise ValueError(f"the ONNX network has no {PROBABILITY!r} output")
        self.has_dense = DENSE_NORMALIZED in self.graph.inputs

    def score(self, named: Mapping[str, Tensor]) -> Tensor:
        """Probabilities ``[B, 1]`` of the inputs the graph takes among ``named``."""
        return self.graph({name: named[name] for name in self.graph.inputs if name in named})[PROBABILITY]
