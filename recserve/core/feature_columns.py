"""Which tables a feature feeds and which column it reads: ``tables = [...]`` and ``column = "..."``.

A categorical or multi-hot feature may feed several tables (``tables = ["site_id", "site_id_linear"]``,
e.g. an embedding and a 1-wide first-order weight): each table keys the feature's values with its
own salt, so the same value has independent rows, and each table is one slot of the packed input of
its width. A numeric or categorical feature may read another feature's column (``column = "C15"``):
the wire carries the column once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from recserve.core.name_ranges import expand_names
from recserve.core.sections.base import SpecError
from recserve.core.spec.types import CategoricalFeature, NumericColumn, RawColumn

#: The value types a numeric feature may read from a categorical column, as numbers.
NUMBER_TYPES = ("int64", "uint64")


def _parallel(names: Sequence[str], pattern: str, what: str) -> tuple[str, ...]:
    """``pattern`` expanded alongside ``names``: one name each, or one shared by all."""
    expanded = expand_names(pattern)
    if len(expanded) == 1:
        return expanded * len(names)
    if len(expanded) != len(names):
        raise SpecError(f"{what} {pattern!r} names {len(expanded)} tables for {len(names)} features")
    return expanded


def feature_tables(
    table: str, tables: Sequence[str], default: str, names: Sequence[str], where: str
) -> list[tuple[str, ...]]:
    """Per feature name, the tables it feeds, in the spec's order.

    Args:
        table: the section's ``table`` (``""``: not given).
        tables: the section's ``tables`` (empty: not given).
        default: the table of a feature that names none (its own name pattern).
        names: the feature's names, expanded.
        where: the feature, for error messages.

    Raises:
        SpecError: both ``table`` and ``tables`` are given, or a table is listed twice.
    """
    if table and tables:
        raise SpecError(f"{where}: give table or tables, not both")
    patterns = tuple(tables) or (table or default,)
    per_pattern = [_parallel(names, pattern, f"{where}: table") for pattern in patterns]
    per_name = [tuple(column) for column in zip(*per_pattern, strict=True)]
    for fed in per_name:
        twice = next((t for t in fed if fed.count(t) > 1), None)
        if twice is not None:
            raise SpecError(f"{where}: tables lists {twice!r} twice; a feature feeds each table once")
    return per_name


@dataclass(frozen=True)
class ColumnRead:
    """A feature reading another feature's column, resolved once every column is known."""

    feature: str
    column: str
    where: str
    raw: Mapping[str, Any]  # the feature's section as written (the keys it gave)


def _own_column(column: str, reader: ColumnRead) -> None:
    if column == reader.feature:
        raise SpecError(f"{reader.where}: column {column!r} is the feature's own; leave column out")


def resolve_categorical_reads(
    features: list[CategoricalFeature],
    raw_columns: Sequence[RawColumn],
    numeric: Sequence[str],
    reads: Sequence[ColumnRead],
) -> None:
    """Point each categorical feature reading another's column (``column = "..."``) at that column.

    Raises:
        SpecError: the column is missing, numeric, multi-hot or a time column, or its value type
            disagrees with the reader's own ``value_type`` / encoder.
    """
    by_name = {c.name: i for i, c in enumerate(raw_columns)}
    for reader in reads:
        _own_column(reader.column, reader)
        index = by_name.get(reader.column)
        if index is None:
            if reader.column in numeric:
                raise SpecError(
                    f"{reader.where}: column {reader.column!r} is numeric; a categorical feature reads a "
                    "categorical column (bucketize a numeric one)"
                )
            raise SpecError(f"{reader.where}: column {reader.column!r} is no column of the spec")
        source = raw_columns[index]
        if source.separator or source.as_list or source.value_type == "time":
            kind = "a time column" if source.value_type == "time" else "a multi-hot column"
            raise SpecError(f"{reader.where}: column {reader.column!r} is {kind}; it reads a single value")
        written = reader.raw.get("value_type", source.value_type)
        if written != source.value_type:
            raise SpecError(
                f"{reader.where}: column {reader.column!r} holds {source.value_type} values, "
                f"the feature says value_type {written!r}; leave value_type out or make them agree"
            )
        for i, feature in enumerate(features):
            if feature.name != reader.feature:
                continue
            if feature.encoder == "identity" and source.value_type != "int64":
                raise SpecError(f"{reader.where}: the identity encoder needs an int64 column")
            features[i] = replace(feature, column=index)


def resolve_numeric_reads(
    numeric: list[NumericColumn], raw_columns: Sequence[RawColumn], reads: Sequence[ColumnRead]
) -> None:
    """Point each numeric feature reading another's column at it: a numeric column, or a number column.

    Raises:
        SpecError: the column is missing, itself read from another column, or a categorical column
            whose values are no numbers.
    """
    own = {c.name for c in numeric if not c.reads}
    by_name = {c.name: i for i, c in enumerate(raw_columns)}
    for reader in reads:
        _own_column(reader.column, reader)
        at = next(i for i, c in enumerate(numeric) if c.name == reader.feature)
        if reader.column in own:
            continue  # a column of ``dense``: ``reads`` names it already
        if any(c.name == reader.column for c in numeric):
            raise SpecError(
                f"{reader.where}: column {reader.column!r} is itself read from another column; "
                "name that column"
            )
        index = by_name.get(reader.column)
        if index is None:
            raise SpecError(f"{reader.where}: column {reader.column!r} is no column of the spec")
        source = raw_columns[index]
        if source.value_type not in NUMBER_TYPES or source.separator:
            raise SpecError(
                f"{reader.where}: column {reader.column!r} holds {source.value_type} values; a numeric "
                f"feature reads a numeric column or a single-valued {' or '.join(NUMBER_TYPES)} one"
            )
        numeric[at] = replace(numeric[at], categorical=index)
