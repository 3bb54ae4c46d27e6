"""``recserve import`` of a network that looks up its own tables, split at its lookups.

The user's ONNX follows the in-model contract (:func:`~recserve.core.in_model.in_model_contract`):
each feature's vocabulary rows in, its tables inside. Every use of a row input must be a lookup: a
``Gather`` (axis 0) of a weight of the graph (directly or through an ``Identity``) at those rows.
The split takes each table's rows from the weight its features' lookups read, replaces each lookup
by a read of the dense contract's input that carries the feature's embedding (a slot of a packed
input, a span of a target's or history's columns), and drops the weights nothing reads any more.
What remains is the user's network over the dense contract's inputs, node for node; the tables go
to the store, so they are served, tiered and updated online like any imported table.

:func:`check_split` proves the split on rows of every table: the whole graph on the rows and the
split one on the rows' embeddings must score the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recserve.backends.dense.compatibility import contract_problems, onnx_signature
from recserve.build.export import example_inputs
from recserve.core.contract import dense_contract, sequence_inputs
from recserve.core.in_model import RowInput, in_model_contract, row_inputs
from recserve.core.names import BATCH_AXIS, SEQUENCE_AXIS
from recserve.core.sections.base import SpecError
from recserve.core.spec.model import ModelSpec
from recserve.errors import ArtifactError

#: The largest difference allowed between the whole and the split network's outputs on the same rows.
SPLIT_TOLERANCE = 1e-5
#: Prefix of the names the split gives its constants.
SPLIT_PREFIX = "recserve_split"


class SplitError(ArtifactError):
    """An in-model network that cannot be split at its lookups; nothing was written."""


@dataclass(frozen=True)
class SplitModel:
    """A network split at its lookups: its tables and the rest of it over the dense contract's inputs."""

    tables: dict[str, np.ndarray]  # each table's rows [rows, dim], as the graph holds them
    weights: dict[str, str]  # each table's weight in the graph
    model: bytes  # the network over the dense contract's inputs (a serialized ONNX model)
    lookups: int  # how many lookups were replaced
    shared: dict[str, tuple[str, ...]]  # the features with several tables: their tables


def split_at_lookups(spec: ModelSpec, path: Path) -> SplitModel:
    """Split the in-model network in ``path`` at its lookups.

    Raises:
        SplitError: the graph does not follow the in-model contract, uses a row input other than in a
            lookup, reads one table from two weights, or holds a table that does not fit the spec.
    """
    import onnx
    from onnx import helper, numpy_helper

    label = f"dense model {path.name}"
    try:
        wanted = in_model_contract(spec)
    except SpecError as exc:
        raise SplitError(str(exc)) from None
    problems = contract_problems(spec, *onnx_signature(path), contract=wanted)
    if problems:
        raise SplitError(
            f"{label} does not follow the in-model contract of spec {spec.name!r} "
            "(recserve contract --spec SPEC prints it): " + "; ".join(problems)
        )
    model = onnx.load(str(path))
    graph = model.graph
    rows: dict[str, list[RowInput]] = {}
    for row in row_inputs(spec):
        rows.setdefault(row.name, []).append(row)
    weights = {w.name: w for w in graph.initializer}
    aliases = {
        n.output[0]: n.input[0] for n in graph.node if n.op_type == "Identity" and n.input[0] in weights
    }
    read: dict[str, str] = {}  # table -> weight
    lookups: list[tuple[int, RowInput, str]] = []  # (node index, row input, output)
    measured: dict[int, Any] = {}  # a Shape of a row input -> the same Shape of its embedding
    for index, node in enumerate(graph.node):
        for position, name in enumerate(node.input):
            if name not in rows:
                continue
            if node.op_type == "Shape":  # the rows' dims lead the embedding's: its batch (and positions)
                measured[index] = _shape_of_embedding(node, rows[name][0])
                continue
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            weight = aliases.get(node.input[0], node.input[0])
            if node.op_type != "Gather" or position != 1 or axis != 0 or weight not in weights:
                raise SplitError(
                    f"{label}: input {name!r} feeds node {node.name or index!r} ({node.op_type}); a row "
                    "input may only be looked up (a Gather, axis 0, of a weight of the graph at its rows) "
                    "or measured (a Shape)"
                )
            found = _row_of(rows[name], weights[weight])
            if found is None:
                named = ", ".join(f"{r.table!r} ({spec.tables[r.table].dim} wide)" for r in rows[name])
                raise SplitError(
                    f"{label}: input {name!r} looks up weight {weight!r} of shape "
                    f"{list(weights[weight].dims)}; its table(s): {named}"
                )
            row = found
            if read.setdefault(row.table, weight) != weight:
                raise SplitError(
                    f"{label}: table {row.table!r} is read from two weights, {read[row.table]!r} and "
                    f"{weight!r}; the features of one table look up one weight"
                )
            lookups.append((index, row, node.output[0]))
    tables = {}
    for table, weight in read.items():
        array = numpy_helper.to_array(weights[weight])
        dim = spec.tables[table].dim
        if array.dtype != np.float32 or array.ndim != 2 or array.shape[1] != dim:
            raise SplitError(
                f"{label}: table {table!r} (weight {weight!r}) is {array.dtype}{list(array.shape)}, "
                f"expected float32 [rows, {dim}] (the spec's dim)"
            )
        tables[table] = array
    unread = [t for t in dict.fromkeys(r.table for named in rows.values() for r in named) if t not in read]
    if unread:
        raise SplitError(f"{label} looks up no row of table(s) {unread}; each table of the spec is looked up")

    for name, feature_rows in rows.items():
        sizes = {r.table: len(tables[r.table]) for r in feature_rows}
        if len(set(sizes.values())) > 1:
            raise SplitError(
                f"{label}: input {name!r} indexes tables of different rows {sizes}; a feature's tables "
                "share its vocabulary, row for row"
            )
    shapes = {t.name: t.shape for t in dense_contract(spec)[0]}
    widths = {name: shape[-1] for name, shape in shapes.items()}
    constants: dict[str, np.ndarray] = {}

    def constant(value: list[int] | int) -> str:
        name = f"{SPLIT_PREFIX}_{len(constants)}"
        constants[name] = np.array(value, np.int64)
        return name

    replaced = {}
    for index, row, output in lookups:
        where = f"{SPLIT_PREFIX}_{output}"
        if row.slot >= 0:
            node = helper.make_node("Gather", [row.embedding, constant(row.slot)], [output], where, axis=1)
        elif row.columns == (0, widths[row.embedding]):
            node = helper.make_node("Identity", [row.embedding], [output], where)
        else:
            start, stop = row.columns
            ends = [constant([start]), constant([stop]), constant([-1])]
            node = helper.make_node("Slice", [row.embedding, *ends], [output], where)
        replaced[index] = node
    replaced |= measured
    nodes = [replaced.get(i, node) for i, node in enumerate(graph.node)]
    nodes = _reassembled(nodes, {output: row for _, row, output in lookups}, shapes, _constants(graph))
    del graph.node[:]
    graph.node.extend(_live(nodes, {o.name for o in graph.output}))
    used = {name for node in graph.node for name in node.input}
    made = {name for node in graph.node for name in node.output}
    infos = [v for v in graph.value_info if v.name in made]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    made_constants = [numpy_helper.from_array(value, name) for name, value in constants.items()]
    kept = [w for w in [*graph.initializer, *made_constants] if w.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    present = {v.name: v for v in graph.input if v.name not in rows and v.name not in weights}
    sequences = set(sequence_inputs(spec))
    inputs = []
    for tensor in dense_contract(spec)[0]:
        if tensor.name in present:
            inputs.append(present.pop(tensor.name))
            continue
        dims: list[str | int] = [BATCH_AXIS, *tensor.shape[1:]]
        if tensor.name in sequences:
            dims[1] = SEQUENCE_AXIS
        inputs.append(helper.make_tensor_value_info(tensor.name, onnx.TensorProto.FLOAT, dims))
    del graph.input[:]
    graph.input.extend([*inputs, *present.values()])
    onnx.checker.check_model(model)
    shared = {name: tuple(r.table for r in named) for name, named in rows.items() if len(named) > 1}
    return SplitModel(tables, read, model.SerializeToString(), len(lookups), shared)


def _row_of(rows: list[RowInput], weight) -> RowInput | None:
    """Which of a feature's tables a lookup reads: the one as wide as the weight (None: none is)."""
    width = weight.dims[-1] if len(weight.dims) == 2 else -1
    return next((row for row in rows if row.columns[1] - row.columns[0] == width), None)


def _shape_of_embedding(node, row: RowInput):
    """A ``Shape`` of ``row``'s embedding input giving what ``node`` gives of the rows themselves.

    The rows' dims (``[batch]``, or ``[batch, positions]``) are the leading dims of the embedding
    input that carries them, so the same span of its dims is read.
    """
    from onnx import helper

    rank = 2 if row.sequence else 1
    start, end = _attribute(node, "start") or 0, _attribute(node, "end")
    start, end = (
        (start + rank if start < 0 else start),
        (rank if end is None else end + rank if end < 0 else end),
    )
    start, end = max(0, min(start, rank)), max(0, min(end, rank))
    return helper.make_node("Shape", [row.embedding], list(node.output), node.name, start=start, end=end)


def _constants(graph) -> dict[str, np.ndarray]:
    """The values of the graph's weights and ``Constant`` nodes, by name."""
    from onnx import helper, numpy_helper

    values = {w.name: numpy_helper.to_array(w) for w in graph.initializer}
    for node in graph.node:
        value = next((a for a in node.attribute if a.name == "value"), None)
        if node.op_type == "Constant" and value is not None:
            values[node.output[0]] = numpy_helper.to_array(helper.get_attribute_value(value))
    return values


def _reassembled(
    nodes: list, reads: Mapping[str, RowInput], shapes: Mapping[str, tuple[int, ...]], values: Mapping
) -> list:
    """``nodes`` with each ``Concat`` that puts a dense input back together replaced by that input.

    A network stacks its profile's embeddings (``Unsqueeze`` at axis 1 of each slot, in slot order)
    and lays a behaviour's item and category side by side (its columns, in order): after the split,
    that rebuilds the packed input the lookup step sends. An ``Identity`` of the input takes its place,
    so the split network computes no more than a network written over the dense contract.
    """
    from onnx import helper

    stacked = {}  # an Unsqueeze at axis 1 of a slot's read -> that read
    for node in nodes:
        row = reads.get(node.input[0]) if node.input else None
        if node.op_type == "Unsqueeze" and row is not None and row.slot >= 0:
            axes = values.get(node.input[1]) if len(node.input) > 1 else _attribute(node, "axes")
            if axes is not None and np.atleast_1d(axes).tolist() == [1]:
                stacked[node.output[0]] = row
    out = []
    for node in nodes:
        whole = _whole_input(node, reads, stacked, shapes) if node.op_type == "Concat" else ""
        out.append(helper.make_node("Identity", [whole], list(node.output), node.name) if whole else node)
    return out


def _whole_input(
    concat,
    reads: Mapping[str, RowInput],
    stacked: Mapping[str, RowInput],
    shapes: Mapping[str, tuple[int, ...]],
) -> str:
    """The dense input a ``Concat`` rebuilds from its reads, whole and in order (``""``: none)."""
    axis = _attribute(concat, "axis")
    for parts, packed in ((reads, False), (stacked, True)):
        rows = [parts.get(name) for name in concat.input]
        named = [row for row in rows if row is not None]
        if len(named) < len(rows) or len({row.embedding for row in named}) != 1:
            continue
        name = named[0].embedding
        if packed:
            in_order = axis == 1 and [row.slot for row in named] == list(range(shapes[name][1]))
        else:
            spans = [row.columns for row in named if row.slot < 0]
            ends = [0, *(stop for _, stop in spans)]
            in_order = (
                axis in (-1, len(shapes[name]) - 1)
                and len(spans) == len(named)
                and [start for start, _ in spans] == ends[:-1]
                and ends[-1] == shapes[name][-1]
            )
        if in_order:
            return name
    return ""


def _attribute(node, name: str):
    """The value of a node's attribute (None: it has none of that name)."""
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def _live(nodes: list, outputs: set[str]) -> list:
    """``nodes`` less those whose outputs nothing reads (a weight's ``Identity`` only lookups read)."""
    while True:
        read = outputs | {name for node in nodes for name in node.input}
        live = [node for node in nodes if any(name in read for name in node.output)]
        if len(live) == len(nodes):
            return live
        nodes = live


def check_split(
    spec: ModelSpec, source: Path, split: SplitModel, progress: Callable[[str], None] = lambda _: None
) -> float:
    """The largest difference between the whole and the split network on random rows of every table.

    At every sequence bucket, 3 examples: each feature a random row of its table, the dense values
    and masks of :func:`~recserve.build.export.example_inputs`; the split network gets the rows'
    embeddings, laid out as the dense contract lays them out.

    Raises:
        SplitError: the two differ by more than :data:`SPLIT_TOLERANCE` (or the whole one fails).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    whole = ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    part = ort.InferenceSession(split.model, options, providers=["CPUExecutionProvider"])
    largest = 0.0
    for length in spec.serving.sequence_buckets:
        dense = example_inputs(spec, rows=3, length=length, seed=length)
        rows = _random_rows(spec, split.tables, length, np.random.default_rng(length))
        embedded = _embeddings(spec, split.tables, rows, dense)
        try:
            want = whole.run(None, {**{n: v for n, v in dense.items() if n not in embedded}, **rows})[0]
        except Exception as exc:  # onnxruntime raises its own types for graphs that fail at run time
            raise SplitError(
                f"dense model {source.name} fails on 3 rows of {length} positions: {exc}"
            ) from None
        got = part.run(None, {**dense, **embedded})[0]
        delta = float(np.max(np.abs(np.asarray(got, np.float64) - want), initial=0.0))
        if not delta <= SPLIT_TOLERANCE * max(1.0, float(np.max(np.abs(want), initial=0.0))):
            raise SplitError(
                f"dense model {source.name} split at its lookups scores 3 rows of {length} positions "
                f"differently from the whole graph (max |Δ| = {delta:.3g}); import it over embeddings "
                '([model] lookups = "store")'
            )
        largest = max(largest, delta)
    read = ", ".join(f"{table} <- {weight}" for table, weight in split.weights.items())
    progress(
        f"[import] {source.name} split at its {split.lookups} lookups ({read}): the split network scores "
        f"as the whole one to max |Δ| = {largest:.2g}"
    )
    return largest


def _random_rows(
    spec: ModelSpec, tables: Mapping[str, np.ndarray], length: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    rows: dict[str, np.ndarray] = {}
    for r in row_inputs(spec):  # a feature's tables have the same rows (split_at_lookups checks it)
        shape = (3, length) if r.sequence else 3
        rows.setdefault(r.name, rng.integers(0, len(tables[r.table]), shape).astype(np.int64))
    return rows


def _embeddings(
    spec: ModelSpec,
    tables: Mapping[str, np.ndarray],
    rows: Mapping[str, np.ndarray],
    dense: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """The dense contract's embedding inputs holding the embeddings of ``rows`` (zeros elsewhere)."""
    out: dict[str, np.ndarray] = {}
    for row in row_inputs(spec):
        if row.embedding not in out:
            out[row.embedding] = np.zeros_like(dense[row.embedding])
        vectors = tables[row.table][rows[row.name]]
        if row.slot >= 0:
            out[row.embedding][:, row.slot, :] = vectors
        else:
            out[row.embedding][..., row.columns[0] : row.columns[1]] = vectors
    return out
