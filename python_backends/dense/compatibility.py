"""Does a dense network follow the contract of the spec it will be fed by?

The contract (:func:`recserve.core.contract.dense_contract`) names every input and output of the dense
network with its dtype and shape. A new ``dense`` version is refused at load when the shapes its
graph declares disagree with the spec the ``embedding_lookup`` step serves (another embedding dim,
another number of categorical features, another dense width), so a mismatched pair never goes
live: the old pair keeps serving. ``recserve import`` checks a user's ONNX the same way, names,
dtypes and outputs included, before it writes anything.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from recserve.backends.base.artifacts import read_manifest, verified_path
from recserve.core.contract import ContractTensor, dense_contract
from recserve.core.spec.model import ModelSpec
from recserve.errors import ArtifactError

LOGGER = logging.getLogger(__name__)

Dim = int | str | None
#: ONNX element types by number (TensorProto.DataType), as the contract names them.
ONNX_DTYPES = {
    1: "FP32",
    2: "UINT8",
    3: "INT8",
    5: "INT16",
    6: "INT32",
    7: "INT64",
    9: "BOOL",
    10: "FP16",
    11: "FP64",
}


def dense_input_dims(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Per-row dims of each dense-network input under ``spec`` (-1: variable length)."""
    inputs, _ = dense_contract(spec)
    return {t.name: t.shape[1:] for t in inputs}


def _render(dims: Sequence[Dim]) -> str:
    return "[" + ", ".join("?" if not isinstance(d, int) or d < 0 else str(d) for d in dims) + "]"


def _fits(declared: Sequence[Dim], expected: Sequence[int]) -> bool:
    return len(declared) == len(expected) and all(
        want < 0 or got == want for got, want in zip(declared, expected, strict=True)
    )


def check_dense_fits(spec: ModelSpec, graph_inputs: Mapping[str, Sequence[Dim]]) -> None:
    """Refuse a dense graph whose inputs do not fit the spec's embeddings and features.

    Args:
        spec: the spec the embedding tables and feature step are served with.
        graph_inputs: input name -> declared shape including the batch dim (ints for fixed dims,
            names or None for symbolic ones), as ONNX Runtime reports them.

    Raises:
        ArtifactError: an input is missing or a fixed dim differs; the message names both shapes.
    """
    problems = []
    for name, expected in dense_input_dims(spec).items():
        if name not in graph_inputs:
            problems.append(f"it has no input '{name}'")
            continue
        declared = tuple(graph_inputs[name])[1:]
        if not _fits(declared, expected):
            problems.append(
                f"'{name}' is {_render(declared)} per row, the embeddings give {_render(expected)}"
            )
    if problems:
        raise ArtifactError(
            f"dense model does not fit spec '{spec.name}' (embedding_dim {spec.model.embedding_dim}, "
            f"{spec.num_sparse} categorical features): " + "; ".join(problems)
        )


GraphSignature = dict[str, tuple[str, list[Dim]]]  # tensor name -> (dtype, declared shape)


def onnx_signature(path: Path) -> tuple[GraphSignature, GraphSignature]:
    """Declared ``(inputs, outputs)`` of an ONNX file: dtype name and shape (symbolic dims as names).

    Initializers listed as graph inputs (older exporters do that) are not inputs to feed.

    Raises:
        ArtifactError: the file is not an ONNX model.
    """
    import onnx

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # onnx raises DecodeError and others for a file that is no model
        raise ArtifactError(f"{path.name} is not an ONNX model: {exc}") from None
    weights = {init.name for init in graph.initializer}

    def signature(values) -> GraphSignature:
        return {
            v.name: (
                ONNX_DTYPES.get(v.type.tensor_type.elem_type, f"type {v.type.tensor_type.elem_type}"),
                [
                    d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in v.type.tensor_type.shape.dim
                ],
            )
            for v in values
            if v.name not in weights
        }

    return signature(graph.input), signature(graph.output)


def _slot_note(tensor: ContractTensor, shape: Sequence[Dim]) -> str:
    """For a packed embedding input: which slots the graph's axis 1 leaves out or has no feature for."""
    if not tensor.slots:
        return ""
    wanted = len(tensor.slots)
    declared = shape[1] if isinstance(shape[1], int) and shape[1] > 0 else wanted
    if declared < wanted:
        first = tensor.slots[declared]
        return (
            f"; the graph has no place for slot {declared} (feature {first.feature!r}, table {first.table!r})"
            + (f" and the {wanted - declared - 1} after it" if wanted - declared > 1 else "")
            + " (recserve contract --json lists every slot)"
        )
    if declared > wanted:
        last = tensor.slots[-1]
        return (
            f"; the contract's last slot is {wanted - 1} (feature {last.feature!r}, table {last.table!r}): "
            f"slots {wanted}..{declared - 1} of the graph are fed by nothing"
        )
    tables = list(dict.fromkeys(s.table for s in tensor.slots))
    named = ", ".join(tables[:3]) + (f" and {len(tables) - 3} more" if len(tables) > 3 else "")
    return f"; each slot is a row of {tensor.shape[2]} floats of its table ({named})"


def contract_problems(
    spec: ModelSpec,
    inputs: GraphSignature,
    outputs: GraphSignature,
    contract: tuple[tuple[ContractTensor, ...], tuple[ContractTensor, ...]] | None = None,
) -> list[str]:
    """What differs between a graph's signature and a contract (empty: it follows it).

    ``contract``: ``(inputs, outputs)`` as :func:`~recserve.core.contract.dense_contract` gives them
    (None: the spec's dense contract).
    """
    want_inputs, want_outputs = contract or dense_contract(spec)
    problems = []
    for kind, wanted, declared in (("input", want_inputs, inputs), ("output", want_outputs, outputs)):
        names = {t.name for t in wanted}
        for tensor in wanted:
            if tensor.name not in declared:
                problems.append(f"it has no {kind} '{tensor.name}'")
                continue
            dtype, shape = declared[tensor.name]
            if dtype != tensor.dtype:
                problems.append(f"{kind} '{tensor.name}' is {dtype}, the contract says {tensor.dtype}")
            if len(shape) != len(tensor.shape):
                problems.append(
                    f"{kind} '{tensor.name}' has rank {len(shape)} {_render(shape)}, "
                    f"the contract says rank {len(tensor.shape)} {_render(tensor.shape)}"
                )
            elif not _fits(shape[1:], tensor.shape[1:]) or any(
                want < 0 and isinstance(got, int) and got > 0
                for got, want in zip(shape, tensor.shape, strict=True)
            ):
                problems.append(
                    f"{kind} '{tensor.name}' is {_render(shape)}, the contract says {_render(tensor.shape)}"
                    " (? = a dynamic axis)" + _slot_note(tensor, shape)
                )
        extra = sorted(set(declared) - names)
        if extra and kind == "input":
            problems.append(f"it has inputs the contract does not feed: {', '.join(extra)}")
    return problems


def check_onnx_contract(spec: ModelSpec, path: Path) -> None:
    """Refuse an ONNX file that does not follow the spec's dense contract, naming every difference.

    Raises:
        ArtifactError: the file is no ONNX model, or its inputs or outputs differ from the contract.
    """
    problems = contract_problems(spec, *onnx_signature(path))
    if problems:
        raise ArtifactError(
            f"dense model {path.name} does not follow the contract of spec '{spec.name}' "
            f"(recserve contract --spec SPEC prints it): " + "; ".join(problems)
        )


def onnx_input_dims(version_dir: Path) -> dict[str, list[Dim]]:
    """Declared input shapes of a ``dense`` version's checked ONNX graph (symbolic dims as names)."""
    path = verified_path(version_dir, read_manifest(version_dir)["files"]["model"])
    inputs, _ = onnx_signature(path)
    return {name: shape for name, (_, shape) in inputs.items()}
