"""Each attention group's query and history, made from its sequences' and targets' rows.

One place for the lookup step (:class:`~recserve.backends.steps.lookup.EmbeddingLookup`) and for
what trains the served rows (``recserve learn``), so both combine a group's sequences alike: side by
side at their tables' widths (``combine = "concat"``), or summed at ``embedding_dim``.
"""

from __future__ import annotations

from typing import Any

from recserve.backends.base.arrays import side_by_side
from recserve.core.contract import AttentionInputs, attention_inputs
from recserve.core.spec.model import ModelSpec

#: an attention group's dense inputs, the span of its sequences (and their targets) among all the
#: spec's, and each one's width when they are concatenated (empty: summed at ``embedding_dim``)
GroupSpan = tuple[AttentionInputs, slice, tuple[int, ...]]


def attention_spans(spec: ModelSpec) -> list[GroupSpan]:
    """Per attention group, in order: its inputs, its sequences' span, their widths if concatenated."""
    spans, start = [], 0
    for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True):
        widths = tuple(spec.tables[s.table].dim for s in group.sequences)
        spans.append(
            (names, slice(start, start + len(group.sequences)), widths if group.combine == "concat" else ())
        )
        start += len(group.sequences)
    return spans


def group_inputs(targets: Any, histories: Any, spans: list[GroupSpan], cut: int) -> dict[str, Any]:
    """Each group's target and history (numpy arrays or torch tensors, as given).

    Args:
        targets: the targets' rows ``[B, sequences, width]`` (a sequence's target at its index).
        histories: the sequences' rows ``[owners, sequences, positions, width]``.
        spans: :func:`attention_spans`.
        cut: ``embedding_dim``, the width of a summed group (the store's rows may be wider).
    """
    out = {}
    for names, span, concat in spans:
        if concat:  # each sequence (and target) at its table's width, side by side
            out[names.target] = side_by_side([targets[:, span.start + i, :w] for i, w in enumerate(concat)])
            out[names.history] = side_by_side(
                [histories[:, span.start + i, :, :w] for i, w in enumerate(concat)]
            )
            continue
        one = span.stop - span.start == 1  # one query, one sequence: no sum
        out[names.target] = targets[:, span.start, :cut] if one else targets[:, span, :cut].sum(1)
        out[names.history] = histories[:, span.start, :, :cut] if one else histories[:, span, :, :cut].sum(1)
    return out
