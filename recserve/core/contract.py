"""The dense contract: what the dense network receives and returns under a spec, and its attention inputs."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from recserve.core.names import (
    DENSE_NET_INPUTS,
    DENSE_NORMALIZED,
    GROUP_INPUTS,
    HISTORY_EMBEDDINGS,
    HISTORY_LOG_WEIGHTS,
    HISTORY_MASK,
    PROBABILITY,
    SPARSE_EMBEDDINGS,
)
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import AttentionGroup, CategoricalFeature, SequenceFeature
from recserve.core.user_state_wire import log_weight_inputs


@functools.lru_cache(maxsize=256)  # asked per tensor of every request; the names are few
def is_dense_net_input(name: str) -> bool:
    """True for a name the dense network may take (:data:`DENSE_NET_INPUTS`, a further group's or width's)."""
    return name in (*DENSE_NET_INPUTS, HISTORY_LOG_WEIGHTS) or name.partition("__")[0] in (
        *GROUP_INPUTS,
        SPARSE_EMBEDDINGS,
    )


def sparse_inputs(spec: ModelSpec) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """The categorical embeddings' tensors: ``(name, width, slots)`` each.

    ``sparse_embeddings`` (``embedding_dim``), then ``sparse_embeddings__<width>`` per other table
    width, ascending; ``slots`` are its features, as indices of
    :attr:`~recserve.core.spec.types.CategoricalGroup.slot_names`.
    """
    names = {spec.model.embedding_dim: SPARSE_EMBEDDINGS}
    return tuple(
        (names.get(width, f"{SPARSE_EMBEDDINGS}__{width}"), width, spec.sparse_slots(width))
        for width in (spec.model.embedding_dim, *spec.other_widths)
    )


@functools.lru_cache(maxsize=256)  # asked per tensor of every request; the names are few
def is_sequence_input(name: str) -> bool:
    """True for a dense input with a sequence axis (axis 1): a history, a mask or the log-weights."""
    return name.partition("__")[0] in (HISTORY_EMBEDDINGS, HISTORY_MASK, HISTORY_LOG_WEIGHTS)


@dataclass(frozen=True)
class Slot:
    """One embedding of a packed input: the feature whose value is looked up, and the table it is in.

    A feature that feeds several tables has a slot per table, so names may repeat across slots.
    """

    feature: str
    table: str

    def to_json(self) -> dict[str, str]:
        """``{"feature", "table"}``."""
        return {"feature": self.feature, "table": self.table}


@dataclass(frozen=True)
class ContractTensor:
    """One input or output of the dense network: name, Triton dtype, shape (-1: dynamic), contents.

    ``slots`` (packed embedding inputs only): what each position of axis 1 holds, in order.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    holds: str
    slots: tuple[Slot, ...] = ()

    def to_json(self) -> dict[str, object]:
        """``{"name", "dtype", "shape", "holds"}``, and ``"slots"`` for a packed embedding input."""
        doc: dict[str, object] = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "holds": self.holds,
        }
        if self.slots:
            doc["slots"] = [slot.to_json() for slot in self.slots]
        return doc


def packed_slots(spec: ModelSpec, indices: Sequence[int]) -> tuple[Slot, ...]:
    """The slots at ``indices`` of :attr:`~recserve.core.spec.types.CategoricalGroup.slot_names`."""
    group = spec.categorical
    return tuple(Slot(group.slot_names[i], group.slot_tables[i]) for i in indices)


def _span(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def _side_by_side(spec: ModelSpec, features: Sequence[CategoricalFeature | SequenceFeature]) -> str:
    """``"a (table 'x', 0:16) | b (table 'y', 16:24)"``: each feature's rows and their columns."""
    parts, start = [], 0
    for feature in features:
        width = spec.tables[feature.table].dim
        parts.append(f"{feature.name} (table {feature.table!r}, {start}:{start + width})")
        start += width
    return " | ".join(parts)


@dataclass(frozen=True)
class AttentionInputs:
    """The dense network's inputs of one attention group: its query, its positions and their mask.

    ``width`` is the last axis of the target and the history: ``embedding_dim`` for a summed group,
    the sum of its tables' widths for a concatenated one (``combine = "concat"``).
    """

    target: str
    history: str
    mask: str
    width: int


def group_width(spec: ModelSpec, group: AttentionGroup) -> int:
    """The width of a group's target and history rows (see :class:`AttentionInputs`)."""
    if group.combine == "concat":
        return sum(spec.tables[s.table].dim for s in group.sequences)
    return spec.model.embedding_dim


def attention_inputs(spec: ModelSpec) -> tuple[AttentionInputs, ...]:
    """Per attention group (:attr:`~recserve.core.spec.model.ModelSpec.attention_groups`), its dense inputs.

    The first group's are ``target_embedding``, ``history_embeddings`` and ``history_mask``; each
    other group's carry its first sequence's name, ``history_embeddings__<sequence>`` and so on.
    """
    groups = []
    for i, group in enumerate(spec.attention_groups):
        target, history, mask = (
            name + ("" if i == 0 else f"__{group.primary.name}") for name in GROUP_INPUTS
        )
        groups.append(AttentionInputs(target, history, mask, group_width(spec, group)))
    return tuple(groups)


def sequence_inputs(spec: ModelSpec) -> tuple[str, ...]:
    """The dense inputs with a sequence axis (axis 1): every group's history and mask, the log-weights."""
    names = tuple(name for group in attention_inputs(spec) for name in (group.history, group.mask))
    return names + log_weight_inputs(spec)


def left_padded_inputs(spec: ModelSpec) -> tuple[str, ...]:
    """The histories and masks of the groups padded on the left (``padding = "left"``), their log-weights."""
    left = tuple(
        name
        for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True)
        if group.primary.padding == "left"
        for name in (names.history, names.mask)
    )
    first_left = bool(spec.attention_groups) and spec.attention_groups[0].primary.padding == "left"
    return left + (log_weight_inputs(spec) if first_left else ())


def dense_net_inputs(spec: ModelSpec) -> tuple[str, ...]:
    """The dense network's inputs under ``spec``, in the order of :data:`DENSE_NET_INPUTS`.

    ``dense_normalized`` only with numeric features that are not bucketized; the target, history
    and mask only with a sequence, then those of every further attention group; last, with
    ``[user_state]`` on, ``history_log_weights`` (the first group's).
    """
    first = (DENSE_NORMALIZED,) if spec.normalized_columns else ()
    sparse = tuple(name for name, _, _ in sparse_inputs(spec))
    groups = tuple(name for g in attention_inputs(spec) for name in (g.target, g.history, g.mask))
    return first + sparse + groups + log_weight_inputs(spec)


def dense_contract(spec: ModelSpec) -> tuple[tuple[ContractTensor, ...], tuple[ContractTensor, ...]]:
    """What the dense network receives and returns under ``spec``: ``(inputs, outputs)``.

    Inputs in the order of :func:`dense_net_inputs`; every one FP32 with the batch first. With
    several attention groups, every history and mask has the same number of positions (the sequence
    bucket of the request's longest history of any group). The output
    is named after ``[model] output``: ``probability``, or ``logit`` (which recserve serves as its
    sigmoid). The built-in network and every imported ONNX follow this contract.
    """
    inputs = []
    if spec.dense is not None and spec.normalized_columns:
        numeric = [spec.dense.numeric[i] for i in spec.dense.normalized]
        ops = {c.describe() for c in numeric}
        how = ops.pop() if len(ops) == 1 else "each by its feature's ops"
        inputs.append(
            ContractTensor(
                DENSE_NORMALIZED, "FP32", (-1, len(numeric)), f"{_span([c.name for c in numeric])}: {how}"
            )
        )
    for name, width, indices in sparse_inputs(spec):
        slots = packed_slots(spec, indices)
        inputs.append(
            ContractTensor(
                name,
                "FP32",
                (-1, len(slots), width),
                f"{_span([s.feature for s in slots])}: one embedding per slot, in the order of slots",
                slots,
            )
        )
    for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True):
        seq = group.primary
        target, history = (
            (
                f"{group.targets[0].name}: its row of table {group.targets[0].table!r}",
                f"{seq.name}: rows of table {seq.table!r}",
            )
            if len(group.sequences) == 1
            else (
                " + ".join(t.name for t in group.targets) + ": the sum of their rows",
                " + ".join(s.name for s in group.sequences) + ": the sum of their rows at each position",
            )
            if group.combine == "sum"
            else (
                _side_by_side(spec, group.targets) + ", side by side",
                _side_by_side(spec, group.sequences) + ", side by side at each position",
            )
        )
        inputs += [
            ContractTensor(names.target, "FP32", (-1, names.width), target),
            ContractTensor(
                names.history,
                "FP32",
                (-1, -1, names.width),
                f"{history}, oldest first, padded to a sequence bucket on the {seq.padding}"
                + (" (the newest at the last position)" if seq.padding == "left" else ""),
            ),
            ContractTensor(
                names.mask,
                "FP32",
                (-1, -1),
                f"{seq.name}: 1 on real positions, 0 on padding (whose embeddings the network must ignore)",
            ),
        ]
    inputs += [
        ContractTensor(
            name,
            "FP32",
            (-1, -1),
            "per position of the first group's history, added to its attention logit: ln count of a "
            "user state's token, 0 elsewhere (all zero: the attention without user states)",
        )
        for name in log_weight_inputs(spec)
    ]

    output = ContractTensor(
        spec.model.output,
        "FP32",
        (-1, 1),
        "click probability" if spec.model.output == PROBABILITY else "click logit (served as its sigmoid)",
    )
    return tuple(inputs), (output,)
