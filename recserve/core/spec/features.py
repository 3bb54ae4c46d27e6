"""Reading the spec's tables and features: each feature section into the columns and groups of the spec."""

from __future__ import annotations

import math
import re
import zoneinfo
from dataclasses import dataclass, field, replace
from typing import Any

from recserve.core.feature_columns import (
    ColumnRead,
    feature_tables,
    resolve_categorical_reads,
    resolve_numeric_reads,
)
from recserve.core.name_ranges import expand_names
from recserve.core.sections.base import SpecError, parse_section
from recserve.core.sections.features import (
    COMBINES,
    ENCODERS,
    MULTI_HOT_WIRE,
    NUMERIC_VALUE_TYPES,
    PADDING_SIDES,
    POOLINGS,
    TIME_PARTS,
    VALUE_TYPES,
    CategoricalFeatureSection,
    MultiHotFeatureSection,
    NumericFeatureSection,
    SequenceFeatureSection,
    TimeFeatureSection,
    parse_feature,
)
from recserve.core.sections.serving import TableSection
from recserve.core.spec.types import (
    TABLE_DTYPES,
    CategoricalFeature,
    MultiHotFeature,
    NumericColumn,
    RawColumn,
    SequenceFeature,
    TableSpec,
)


def parse_tables(raw_tables: Any, dim: int) -> dict[str, TableSpec]:
    """The spec's ``[tables.<name>]`` by name; ``dim`` is the default width."""
    if not isinstance(raw_tables, dict):
        raise SpecError(f"[tables] must be a table, got {raw_tables!r}")
    tables: dict[str, TableSpec] = {}
    for pattern, raw in raw_tables.items():
        names = expand_names(pattern)
        if not isinstance(raw, dict):
            raise SpecError(f"[tables.{pattern}] must be a table, got {raw!r}")
        cards: Any = raw.get("cardinality")
        if (
            len(names) > 1
            and cards is not None
            and not (isinstance(cards, list) and len(cards) == len(names))
        ):
            raise SpecError(
                f"[tables.{pattern}] names {len(names)} tables: cardinality must list {len(names)}"
            )
        for i, name in enumerate(names):
            one = dict(raw, cardinality=cards[i]) if len(names) > 1 and cards is not None else raw
            table = parse_section(TableSection, one, f"tables.{pattern}")
            if table.dtype not in TABLE_DTYPES:
                raise SpecError(f"[tables.{pattern}] dtype must be fp32 or fp16, got {table.dtype!r}")
            if name in tables:
                raise SpecError(f"table {name!r} is defined twice")
            tables[name] = TableSpec(
                name, table.dim or dim, table.cardinality, table.zipf_exponent, table.dtype
            )
    return tables


@dataclass
class ParsedFeatures:
    """The ``[[features]]`` entries sorted into the parts the model is made of."""

    numeric: list[NumericColumn] = field(default_factory=list)
    raw_columns: list[RawColumn] = field(default_factory=list)
    categorical: list[CategoricalFeature] = field(default_factory=list)
    multi_hot: list[MultiHotFeature] = field(default_factory=list)
    sequences: list[SequenceFeature] = field(default_factory=list)
    targets: list[tuple[CategoricalFeature, str]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    # the features reading another feature's column (``column = "..."``), resolved at the end
    categorical_reads: list[ColumnRead] = field(default_factory=list)
    numeric_reads: list[ColumnRead] = field(default_factory=list)

    def add_name(self, name: str, where: str) -> None:
        """Record a feature's name; SpecError when it is used twice or is no valid name."""
        if name in self.names:
            raise SpecError(f"{where}: the name {name!r} is used twice")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SpecError(f"{where}: {name!r} is not a valid feature name (letters, digits, _)")
        self.names.add(name)


def _numeric(section: NumericFeatureSection, name: str, where: str) -> NumericColumn:
    pairs = {"clip": section.clip, "standardize": section.standardize, "minmax": section.minmax}
    for key, pair in pairs.items():
        if pair and len(pair) != 2:
            raise SpecError(f"{where}: {key} takes two numbers, got {list(pair)}")
    if section.standardize and section.minmax:
        raise SpecError(f"{where}: standardize and minmax exclude each other")
    shift, scale = 0.0, 1.0
    if section.standardize:
        shift, scale = section.standardize
    if section.minmax:
        shift, scale = section.minmax[0], section.minmax[1] - section.minmax[0]
    if scale <= 0:
        raise SpecError(f"{where}: the std or the max - min must be positive, got {scale:g}")
    low, high = section.clip or (-math.inf, math.inf)
    edges = section.bucketize
    if edges and any(b <= a for a, b in zip(edges[:-1], edges[1:], strict=True)):
        raise SpecError(f"{where}: bucketize needs increasing boundaries, got {list(edges)}")
    if section.log1p and low <= -1:
        raise SpecError(f"{where}: log1p needs clip with a minimum above -1, got {list(section.clip)}")
    if section.log1p and section.fill_na <= -1:
        raise SpecError(f"{where}: log1p needs fill_na above -1, got {section.fill_na:g}")
    if section.value_type not in NUMERIC_VALUE_TYPES:
        raise SpecError(
            f"{where}: value_type must be one of {', '.join(NUMERIC_VALUE_TYPES)}, got {section.value_type!r}"
        )
    return NumericColumn(
        name,
        section.fill_na,
        low,
        high,
        section.log1p,
        shift,
        scale,
        edges,
        reads=section.column,
        real=section.value_type == "real",
    )


def parse_features(raw_features: Any, tables: dict[str, TableSpec]) -> ParsedFeatures:
    """The spec's ``[[features]]`` as columns and features, each checked against ``tables``."""
    if not isinstance(raw_features, list):
        raise SpecError("features must be a list of [[features]] tables")
    out = ParsedFeatures()
    for position, raw in enumerate(raw_features):
        section = parse_feature(raw, position)
        where = f"features[{position}] ({section.name})"
        names = expand_names(section.name)
        for name in names:
            out.add_name(name, where)
        if isinstance(section, NumericFeatureSection):
            if section.column and len(names) > 1:
                raise SpecError(f"{where}: column names one column; {section.name!r} names several features")
            out.numeric_reads += [
                ColumnRead(name, section.column, where, raw) for name in names if section.column
            ]
            for name in names:
                column = _numeric(section, name, where)
                if column.boundaries:
                    tables.setdefault(name, TableSpec(name, 0, len(column.boundaries) + 1, 0.0))
                    out.categorical.append(CategoricalFeature(name, name, numeric=len(out.numeric)))
                out.numeric.append(column)
                if section.missing_flag:  # reads the feature's column: sent once
                    flag = f"{name}_missing"
                    out.add_name(flag, where)
                    read = section.column or name
                    out.numeric.append(NumericColumn(flag, reads=read, indicator=True))
                    out.numeric_reads.append(ColumnRead(flag, read, where, raw))
        elif isinstance(section, SequenceFeatureSection):
            if re.search(r"[\d\-+]", section.separator):
                raise SpecError(f"{where}: separator {section.separator!r} may not hold digits, '-' or '+'")
            out.sequences += [
                SequenceFeature(
                    name,
                    section.table,
                    section.max_length,
                    section.mean_length,
                    section.positions,
                    section.padding,
                    section.separator,
                    section.combine,
                )
                for name in names
            ]
        elif isinstance(section, MultiHotFeatureSection):
            _multi_hot(section, names, where, out)
        elif isinstance(section, TimeFeatureSection):
            _time(section, names, where, tables, out)
        else:
            _categorical(section, names, where, out, raw)
    numeric = [c.name for c in out.numeric]
    resolve_categorical_reads(out.categorical, out.raw_columns, numeric, out.categorical_reads)
    resolve_numeric_reads(out.numeric, out.raw_columns, out.numeric_reads)
    return out


def _categorical(
    section: CategoricalFeatureSection,
    names: tuple[str, ...],
    where: str,
    out: ParsedFeatures,
    raw: Any,
) -> None:
    if section.value_type not in VALUE_TYPES:
        raise SpecError(
            f"{where}: value_type must be one of {', '.join(VALUE_TYPES)}, got {section.value_type!r}"
        )
    if section.encoder not in ENCODERS:
        raise SpecError(f"{where}: encoder must be one of {', '.join(ENCODERS)}, got {section.encoder!r}")
    if section.encoder == "identity" and section.value_type != "int64" and not section.column:
        raise SpecError(f"{where}: the identity encoder needs value_type int64 (the value is the key)")
    if not 1 <= section.max_hex_digits <= 16:
        raise SpecError(f"{where}: max_hex_digits must lie in 1..16 (64-bit values)")
    per_name = feature_tables(section.table, section.tables, section.name, names, where)
    if section.column and len(names) > 1:
        raise SpecError(f"{where}: column names one column; {section.name!r} names several features")
    for name, tables in zip(names, per_name, strict=True):
        if section.attends:
            if section.value_type != "int64" or section.encoder == "identity":
                raise SpecError(f"{where}: an attention target is an int64 id with the hash encoder")
            if len(tables) > 1 or section.column:
                raise SpecError(
                    f"{where}: an attention target feeds one table (its sequence's), from its own input"
                )
            target = CategoricalFeature(name, tables[0], section.encoder)
            out.targets += [(target, over) for over in section.attends]
            continue
        if section.column:  # the column is resolved once every feature is read
            out.categorical_reads.append(ColumnRead(name, section.column, where, raw))
        column = -1 if section.column else len(out.raw_columns)
        out.categorical += [CategoricalFeature(name, table, section.encoder, column) for table in tables]
        if not section.column:
            out.raw_columns.append(RawColumn(name, section.value_type, section.max_hex_digits))


def _multi_hot(
    section: MultiHotFeatureSection, names: tuple[str, ...], where: str, out: ParsedFeatures
) -> None:
    if section.value_type not in VALUE_TYPES:
        raise SpecError(
            f"{where}: value_type must be one of {', '.join(VALUE_TYPES)}, got {section.value_type!r}"
        )
    if section.pooling not in POOLINGS:
        raise SpecError(f"{where}: pooling must be one of {', '.join(POOLINGS)}, got {section.pooling!r}")
    if not section.separator or section.max_length < 1:
        raise SpecError(f"{where}: a multi-hot feature needs a separator and max_length >= 1")
    if section.wire not in MULTI_HOT_WIRE:
        raise SpecError(f"{where}: wire must be one of {', '.join(MULTI_HOT_WIRE)}, got {section.wire!r}")
    per_name = feature_tables(section.table, section.tables, section.name, names, where)
    for name, tables in zip(names, per_name, strict=True):
        column = len(out.raw_columns)
        out.raw_columns.append(
            RawColumn(
                name,
                section.value_type,
                section.max_hex_digits,
                separator=section.separator,
                max_length=section.max_length,
                as_list=section.wire == "list",
            )
        )
        out.multi_hot += [
            MultiHotFeature(name, table, column, section.max_length, section.pooling) for table in tables
        ]


def _time(
    section: TimeFeatureSection,
    names: tuple[str, ...],
    where: str,
    tables: dict[str, TableSpec],
    out: ParsedFeatures,
) -> None:
    if bool(section.format) == bool(section.unit) or section.unit not in ("", "s", "ms"):
        raise SpecError(f"{where}: give either format (strptime) or unit (s or ms)")
    try:
        zoneinfo.ZoneInfo(section.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise SpecError(f"{where}: unknown timezone {section.timezone!r}") from None
    unknown = [part for part in section.parts if part not in TIME_PARTS]
    if unknown or not section.parts:
        raise SpecError(f"{where}: parts must be some of {', '.join(TIME_PARTS)}, got {list(section.parts)}")
    for name in names:
        column = len(out.raw_columns)
        out.raw_columns.append(
            RawColumn(
                name, "time", time_format=section.format, time_unit=section.unit, timezone=section.timezone
            )
        )
        for part in section.parts:
            table = f"{name}_{part}"
            out.add_name(table, where)
            tables.setdefault(table, TableSpec(table, 0, TIME_PARTS[part], 0.0))
            out.categorical.append(CategoricalFeature(table, table, "hash", column, part))


def attention_features(
    features: ParsedFeatures,
) -> tuple[tuple[CategoricalFeature, ...], tuple[SequenceFeature, ...]]:
    """Every sequence, group by group, and the target of each.

    A group is a sequence with its own positions followed by the sequences sharing them (items and
    their categories); the built-in network attends over each group with one query: the group's
    sequences are summed per position, and so are their targets (or, with ``combine = "concat"``
    on the group's first sequence, concatenated).
    """
    own = [s for s in features.sequences if not s.positions]
    if not own:
        if features.sequences or features.targets:
            raise SpecError(
                "a sequence shares the positions of another, or a target attends, but no sequence has its own"
            )
        return (), ()
    names = {s.name for s in own}
    for sequence in features.sequences:
        if sequence.positions and sequence.positions not in names:
            raise SpecError(
                f"sequence {sequence.name!r} shares the positions of {sequence.positions!r}, "
                "not a sequence with positions of its own"
            )
    sequences: list[SequenceFeature] = []
    for primary in own:
        if primary.padding not in ("", *PADDING_SIDES):
            raise SpecError(
                f"sequence {primary.name!r}: padding must be one of {', '.join(PADDING_SIDES)}, "
                f"got {primary.padding!r}"
            )
        if primary.max_length < 1:
            raise SpecError(f"sequence {primary.name!r} needs max_length >= 1")
        if primary.combine not in ("", *COMBINES):
            raise SpecError(
                f"sequence {primary.name!r}: combine must be one of {', '.join(COMBINES)}, "
                f"got {primary.combine!r}"
            )
        primary = replace(primary, padding=primary.padding or "right", combine=primary.combine or "sum")
        sequences.append(primary)
        for sequence in features.sequences:
            if sequence.positions != primary.name:
                continue
            if sequence.max_length not in (0, primary.max_length):
                raise SpecError(
                    f"sequence {sequence.name!r} shares positions with {primary.name!r}: "
                    "no max_length of its own"
                )
            if sequence.padding not in ("", primary.padding):
                raise SpecError(
                    f"sequence {sequence.name!r} shares positions with {primary.name!r}: its padding is "
                    f"{primary.padding!r}, got {sequence.padding!r}"
                )
            if sequence.combine not in ("", primary.combine):
                raise SpecError(
                    f"sequence {sequence.name!r} shares positions with {primary.name!r}: its combine is "
                    f"{primary.combine!r}, got {sequence.combine!r}"
                )
            sequences.append(
                replace(
                    sequence, max_length=primary.max_length, padding=primary.padding, combine=primary.combine
                )
            )
    by_sequence: dict[str, CategoricalFeature] = {}
    for target, over in features.targets:
        if over not in {s.name for s in sequences}:
            raise SpecError(f"feature {target.name!r} attends over {over!r}, which is not a sequence feature")
        if over in by_sequence:
            raise SpecError(f"sequence {over!r} has two targets attending over it")
        by_sequence[over] = target
    for sequence in sequences:
        found = by_sequence.get(sequence.name)
        if found is None:
            raise SpecError(
                f"sequence {sequence.name!r} needs a categorical feature with attends = {sequence.name!r}"
            )
        if found.table != sequence.table:
            raise SpecError(
                f"{found.name!r} and {sequence.name!r} must share a table to attend, "
                f"got {found.table!r} and {sequence.table!r}"
            )
    return tuple(by_sequence[s.name] for s in sequences), tuple(sequences)
