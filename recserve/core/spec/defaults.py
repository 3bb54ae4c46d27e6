"""Defaults of the sections an imported model does not use: ``embedding_dim``, ``[dense_net]``, ``[serving]``.

An import needs only the schema and the tables (their widths and dtypes); the built-in network's
sizes and the serving buckets get values that fit any widths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from recserve.core.sections.base import SpecError
from recserve.core.sections.serving import DenseNetSection, ServingSection
from recserve.core.spec.types import TableSpec

#: The default bottom MLP's first width (it then ends at ``embedding_dim``).
BOTTOM_WIDTH = 64


def default_embedding_dim(embedding_dim: int, tables: Mapping[str, TableSpec]) -> int:
    """``[model] embedding_dim`` as written, else the widest table's width (tables giving ``dim``).

    Raises:
        SpecError: neither ``embedding_dim`` nor any table's ``dim`` is given.
    """
    if embedding_dim:
        if embedding_dim < 1:
            raise SpecError(f"[model] embedding_dim must be >= 1, got {embedding_dim}")
        return embedding_dim
    widths = [t.dim for t in tables.values() if t.dim]
    if not widths:
        raise SpecError("[model] needs embedding_dim, or [tables.<name>] their dim (the widest is taken)")
    return max(widths)


def default_dense_net(net: DenseNetSection, dim: int) -> DenseNetSection:
    """``[dense_net]`` with its unset sizes filled for ``embedding_dim = dim``."""
    heads = net.attention_heads or (2 if dim % 2 == 0 else 1)
    bottom = net.bottom_mlp or ((BOTTOM_WIDTH, dim) if dim != BOTTOM_WIDTH else (dim,))
    return replace(net, bottom_mlp=bottom, attention_heads=heads)


def default_serving(serving: ServingSection, max_batch: int, longest: int) -> ServingSection:
    """``[serving]`` with its unset buckets filled.

    Batch buckets 1, 8, 32, ... (each four times the last) below ``max_batch``, then ``max_batch``;
    sequence buckets 8, 16, ... below the longest ``max_length``, then it (``[1]`` without one).
    """
    batch = serving.batch_buckets
    if not batch:
        if max_batch < 1:
            raise SpecError(f"[model] max_batch_size must be >= 1, got {max_batch}")
        sizes, size = [1], 8
        while size < max_batch:
            sizes.append(size)
            size *= 4
        batch = tuple(sorted({*sizes, max_batch}))
    sequence = serving.sequence_buckets
    if not sequence:
        sizes, size = [], 8
        while size < longest:
            sizes.append(size)
            size *= 2
        sequence = (*sizes, longest) if longest else (1,)
    return replace(serving, batch_buckets=batch, sequence_buckets=sequence)


def check_first_order(net: DenseNetSection, dim: int, slot_widths: list[int]) -> None:
    """Refuse ``first_order = true`` without a 1-wide table among the categorical features' tables.

    Raises:
        SpecError: no feature feeds a table of dim 1, or ``embedding_dim`` itself is 1.
    """
    if not net.first_order:
        return
    if dim == 1:
        raise SpecError(
            "[dense_net] first_order takes the 1-wide tables out of the interaction: "
            "embedding_dim must be > 1"
        )
    if 1 not in slot_widths:
        raise SpecError(
            "[dense_net] first_order sums the values of 1-wide tables into the logit: give some feature a "
            'table of dim = 1 (tables = ["site_id", "site_id_linear"], [tables.site_id_linear] dim = 1)'
        )
