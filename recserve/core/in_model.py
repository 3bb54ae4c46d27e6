"""The in-model contract: what an ONNX that looks up its own tables takes (``[model] lookups = "in_model"``).

Such a network is the user's model as written: per feature, the row of its value in the table's
vocabulary (INT64, ``[-1]``, or ``[-1, -1]`` for a behaviour sequence), the histories' masks and the
dense values, and the tables inside the graph as the tensors its ``Gather`` nodes read.
``recserve import`` splits it at those lookups (:mod:`recserve.build.in_model_split`): the tables go
to the store and each lookup's output is read from the dense contract's input that carries that
feature's embedding, so the repository it writes is the same as for a network over embeddings.
:class:`RowInput` says where each feature's embedding is in the dense contract.
"""

from __future__ import annotations

from dataclasses import dataclass

from recserve.core.contract import (
    ContractTensor,
    attention_inputs,
    dense_contract,
    sparse_inputs,
)
from recserve.core.sections.base import SpecError
from recserve.core.spec.model import ModelSpec

#: ``[model] lookups`` of a network that takes vocabulary rows and holds its tables.
IN_MODEL = "in_model"


@dataclass(frozen=True)
class RowInput:
    """One row input of an in-model network, and where the served network finds its embedding.

    ``embedding`` is the dense contract's input that carries the feature's rows; ``slot`` its position
    on axis 1 of a packed input (-1: not packed); ``columns`` its span of the last axis.
    """

    name: str  # the feature's name
    table: str
    sequence: bool  # [-1, -1] rows of a history; else [-1], one row per example
    embedding: str
    slot: int
    columns: tuple[int, int]


def row_inputs(spec: ModelSpec) -> tuple[RowInput, ...]:
    """Each feature's row input per table it feeds, in the order of the dense contract's embedding inputs.

    A feature with several tables (an embedding and a first-order weight) has one input, read once
    per table: its entries share the name.

    Raises:
        SpecError: the spec has what an in-model network cannot take (see :func:`in_model_problems`).
    """
    problems = in_model_problems(spec)
    if problems:
        raise SpecError(
            f'spec {spec.name!r}: [model] lookups = "{IN_MODEL}" cannot take: ' + "; ".join(problems)
        )
    group = spec.categorical
    rows: dict[tuple[str, str], RowInput] = {}
    for name, width, indices in sparse_inputs(spec):
        for k, i in enumerate(indices):
            feature, table = group.slot_names[i], group.slot_tables[i]
            rows.setdefault((feature, table), RowInput(feature, table, False, name, k, (0, width)))
    for attention, names in zip(spec.attention_groups, attention_inputs(spec), strict=True):
        start = 0
        for sequence, target in zip(attention.sequences, attention.targets, strict=True):
            stop = start + spec.tables[sequence.table].dim
            rows.setdefault(
                (target.name, target.table),
                RowInput(target.name, target.table, False, names.target, -1, (start, stop)),
            )
            rows.setdefault(
                (sequence.name, sequence.table),
                RowInput(sequence.name, sequence.table, True, names.history, -1, (start, stop)),
            )
            start = stop
    return tuple(rows.values())


def in_model_problems(spec: ModelSpec) -> list[str]:
    """Why an in-model network cannot be served under ``spec`` (empty: it can).

    recserve hands such a network, once split, each feature's embedding as the lookup step serves it:
    a pooled multi-hot feature, sequences summed at each position or a bucketized number has no one
    row per feature to take, and a feature's tables of one width could not be told apart.
    """
    group, problems = spec.categorical, []
    problems += [
        f"multi-hot feature {f.name!r} (recserve pools its rows before the network)" for f in group.multi_hot
    ]
    problems += [
        f"feature {f.name!r}, a bucketized number (its rows are buckets, not vocabulary rows)"
        for f in group.features
        if f.numeric >= 0
    ]
    tables: dict[str, list[str]] = {}
    for feature, table in zip(group.slot_names, group.slot_tables, strict=True):
        tables.setdefault(feature, []).append(table)
    for name, named in tables.items():
        widths = [spec.tables[t].dim for t in named]
        if len(set(widths)) < len(widths):
            problems.append(
                f"feature {name!r}, whose tables {named} have the same width (the split tells a feature's "
                "lookups apart by their width)"
            )
    for attention in spec.attention_groups:
        if len(attention.sequences) > 1 and attention.combine != "concat":
            problems.append(
                " + ".join(s.name for s in attention.sequences)
                + ' summed at each position (give the group combine = "concat": each sequence\'s rows apart)'
            )
        elif (
            attention.combine != "concat"
            and spec.tables[attention.primary.table].dim > spec.model.embedding_dim
        ):
            problems.append(
                f"sequence {attention.primary.name!r}, wider than embedding_dim (served cut to it)"
            )
    contract = {t.name for t in dense_contract(spec)[0]}
    features = dict.fromkeys([*tables, *(t.name for t in spec.targets), *(s.name for s in spec.sequences)])
    problems += [
        f"feature {name!r}, named like an input of the dense contract"
        for name in features
        if name in contract
    ]
    return problems


def in_model_contract(spec: ModelSpec) -> tuple[tuple[ContractTensor, ...], tuple[ContractTensor, ...]]:
    """What an in-model network receives and returns under ``spec``: ``(inputs, outputs)``.

    The dense contract with each embedding input replaced by the row inputs of its features
    (:func:`row_inputs`, INT64); the dense values, masks, log-weights and the output as there.

    Raises:
        SpecError: the spec has what an in-model network cannot take.
    """
    rows = row_inputs(spec)
    tables: dict[str, list[str]] = {}
    for row in rows:
        tables.setdefault(row.name, []).append(row.table)
    dense_inputs, outputs = dense_contract(spec)
    inputs: list[ContractTensor] = []
    for tensor in dense_inputs:
        carried = [r for r in rows if r.embedding == tensor.name]
        if not carried:
            inputs.append(tensor)
        for row in carried:
            if row.table != tables[row.name][0]:  # a further table of a feature: the same input
                continue
            if row.sequence:
                sequence = next(s for s in spec.sequences if s.name == row.name)
                holds = (
                    f"{row.name}: each position's row in table {row.table!r}, oldest first, padded on the "
                    f"{sequence.padding} (padding holds any row: the network must ignore it by the mask)"
                )
                inputs.append(ContractTensor(row.name, "INT64", (-1, -1), holds))
            else:
                named = " and ".join(repr(t) for t in tables[row.name])
                if len(tables[row.name]) == 1:
                    holds = f"{row.name}: its value's row in table {named} (an unknown value: the oov row)"
                else:
                    holds = (
                        f"{row.name}: its value's row in tables {named}, the same in each (their "
                        "vocabularies are one; an unknown value: the oov row)"
                    )
                inputs.append(ContractTensor(row.name, "INT64", (-1,), holds))
    return tuple(inputs), outputs
