"""Typed sections of the spec's features (numeric, categorical, sequence, multi-hot, time), its top keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from recserve.core.sections.base import SpecError, parse_section

VALUE_TYPES = ("hex", "int64", "uint64", "string")
#: How a categorical value becomes a key: ``hash`` (64-bit keys of table and value), ``vocab`` (the
#: same keys; the rows are the tokens listed at import), ``identity`` (the int64 value is the key).
ENCODERS = ("hash", "vocab", "identity")
#: Derived parts of a time feature, each a small categorical with its own table (its cardinality).
#: ``weekday`` counts from Monday = 0.
TIME_PARTS = {"hour_of_day": 24, "weekday": 7, "is_weekend": 2, "day_of_month": 31, "month": 12}


@dataclass(frozen=True)
class NumericFeatureSection:
    """``kind = "numeric"``: a number; ops in the order fill_na, clip, log1p, standardize or minmax."""

    name: str
    kind: str
    fill_na: float = 0.0  # the value of a missing field
    clip: tuple[float, ...] = ()  # [min, max]
    log1p: bool = False
    standardize: tuple[float, ...] = ()  # [mean, std]: (x - mean) / std
    minmax: tuple[float, ...] = ()  # [min, max]: (x - min) / (max - min)
    # increasing boundaries: the value's bucket becomes a categorical feature with its own table
    bucketize: tuple[float, ...] = ()
    # another feature's column read as this feature's value ("": a column of its own): a numeric
    # column, or an int64 / uint64 categorical one (Avazu's C15 as a number too); sent once
    column: str = ""
    # "integer" (counts) or "real" (prices, bids, ratios): what synthetic rows hold; every reader
    # takes both
    value_type: str = "integer"
    # a second dense input column, "<name>_missing": 1.0 where the value is missing, else 0.0
    missing_flag: bool = False


#: What a numeric feature's values are (``value_type``).
NUMERIC_VALUE_TYPES = ("integer", "real")


@dataclass(frozen=True)
class CategoricalFeatureSection:
    """``kind = "categorical"``: one value per row, looked up in a table; an empty value has its own key."""

    name: str
    kind: str
    value_type: str = "hex"
    encoder: str = "hash"
    table: str = ""  # "": the table named like the feature
    # several tables, each keyed with its own salt (an embedding and a 1-wide first-order weight)
    tables: tuple[str, ...] = ()
    max_hex_digits: int = 16
    # another categorical feature's column read by this one ("": a column of its own); sent once
    column: str = ""
    # sequence features this one is the target of, attending over each (int64 ids); one name or a list
    attends: tuple[str, ...] = ()


@dataclass(frozen=True)
class SequenceFeatureSection:
    """``kind = "sequence"``: item ids of the user's history, newest last, padded to a sequence bucket."""

    name: str
    kind: str
    table: str
    max_length: int = 0  # 0: that of the sequence whose positions it shares
    mean_length: float = 8.0  # of the synthetic rows
    positions: str = ""  # another sequence whose positions this one shares (e.g. the items' categories)
    # where the dense network finds the padding: "right" (real positions first, the newest at the
    # row's length - 1) or "left" (real positions last, the newest at the last position);
    # "": right, or that of the sequence whose positions it shares
    padding: str = ""
    # between the ids in one field of a file; "": whitespace or commas
    separator: str = ""
    # how the sequences sharing these positions reach the dense network (and their targets):
    # "sum" (one embedding_dim row per position) or "concat" (their rows side by side, the sum of
    # their tables' widths); "": sum, or that of the sequence whose positions it shares
    combine: str = ""


#: Where a sequence's padding goes in the dense network's inputs (``padding``).
PADDING_SIDES = ("right", "left")
#: How the sequences sharing positions, and their targets, are combined (``combine``).
COMBINES = ("sum", "concat")
#: How requests carry a multi-hot feature (``wire``): a joined field of ``categorical``, or a list.
MULTI_HOT_WIRE = ("string", "list")
#: How a multi-hot feature's embeddings are pooled: their sum, mean, or sum over the root of the count.
POOLINGS = ("sum", "mean", "sqrtn")


@dataclass(frozen=True)
class MultiHotFeatureSection:
    """``kind = "multi_hot"``: several values in one field (``a|b|c``), pooled into one embedding."""

    name: str
    kind: str
    max_length: int  # values kept per row (the first ones)
    value_type: str = "string"
    separator: str = "|"  # between the values in one field (of files, and of the wire's "string" form)
    # how requests carry it: "string", one field of the ``categorical`` tensor joined by the
    # separator; "list", a BYTES tensor of its own named after the feature, one value per element
    # (ragged: rows padded with empty elements)
    wire: str = "string"
    pooling: str = "mean"
    table: str = ""  # "": the table named like the feature
    tables: tuple[str, ...] = ()  # several tables, each pooled into an embedding of its own
    max_hex_digits: int = 16


@dataclass(frozen=True)
class TimeFeatureSection:
    """``kind = "time"``: a timestamp (``format`` for strptime, or ``unit`` s / ms), split into parts."""

    name: str
    kind: str
    format: str = ""
    unit: str = ""
    timezone: str = "UTC"
    parts: tuple[str, ...] = ("hour_of_day", "weekday")


#: The section of each ``[[features]]`` kind.
FEATURE_SECTIONS: dict[str, type] = {
    "numeric": NumericFeatureSection,
    "categorical": CategoricalFeatureSection,
    "sequence": SequenceFeatureSection,
    "time": TimeFeatureSection,
    "multi_hot": MultiHotFeatureSection,
}
#: The spec's top-level tables.
TOP_LEVEL_KEYS = (
    "model",
    "dense_net",
    "serving",
    "training",
    "inputs",
    "features",
    "tables",
    "hashing",
    "store",
    "access",
    "user_state",
    "logging",
    "loop",
    "degrade",
)


def parse_feature(raw: Any, position: int) -> Any:
    """The section of one ``[[features]]`` entry, by its ``kind``.

    Raises:
        SpecError: the kind is unknown, or a key is unknown or missing for that kind.
    """
    if not isinstance(raw, Mapping):
        raise SpecError(f"features[{position}] must be a table, got {raw!r}")
    kind = raw.get("kind")
    where = f"features[{position}] ({raw.get('name', '?')})"
    if kind == "categorical" and isinstance(raw.get("attends"), str):
        raw = {**raw, "attends": [raw["attends"]]}  # one sequence, or a list of them
    if kind not in FEATURE_SECTIONS:
        raise SpecError(f"{where}: unknown feature kind {kind!r}; known kinds: {', '.join(FEATURE_SECTIONS)}")
    return parse_section(FEATURE_SECTIONS[kind], raw, where)
