"""What ``recserve import`` checks and derives from the values it is given.

* Vocabulary tokens in their canonical form (:func:`~recserve.core.values.canonical_value`), as
  serving reads the values clients send.
* A time part's tokens are the part's numbers (``hour_of_day`` 0..23, ...), checked against the part's
  domain; a raw time is refused with the number to write in its place.
* A float32 table stored as float16 (``[tables.<name>] dtype = "fp16"``) is rounded: the largest
  change of a weight is reported.
* A table whose cardinality the spec omits takes it from the rows imported, in the spec the
  repository carries.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace

import numpy as np

from recserve.backends.store.table_data import TableArrays
from recserve.core.name_ranges import expand_names
from recserve.core.sections.features import TIME_PARTS
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import parse_spec
from recserve.core.spec.types import RawColumn
from recserve.core.times import time_part
from recserve.core.values import canonical_value, parse_times
from recserve.errors import InvalidInput, shorten

#: Rows of float32 vectors compared with their float16 rounding at a time.
ROUNDING_BLOCK_ROWS = 65536


def canonical_tokens(tokens: Sequence[object]) -> list[object]:
    """The tokens with every string in its canonical form (integers and nulls as they are)."""
    return [canonical_value(t).decode() if isinstance(t, str) else t for t in tokens]


def time_part_problem(spec: ModelSpec, table: str, tokens: Sequence[object], skip: Collection[int]) -> str:
    """Why ``tokens`` are no values of a time part's table (``""``: they are, or it is no such table).

    A token must be the part's number in its domain (``hour_of_day`` 0..23, ``weekday`` 0..6 from
    Monday, ``is_weekend`` 0..1, ``day_of_month`` 0..30, ``month`` 0..11); a raw time of the column
    (as clients send it) is refused naming the number it stands for. Tokens are named by their row in
    ``tokens`` (the ``oov`` and ``pad`` rows, in ``skip``, counted and not read).
    """
    feature = next((f for f in spec.categorical.features if f.table == table and f.part), None)
    if feature is None:
        return ""
    size = TIME_PARTS[feature.part]
    column = spec.categorical.raw_columns[feature.column]
    for row, token in enumerate(tokens):
        if row in skip:
            continue
        text = str(token)
        if isinstance(token, bool) or not isinstance(token, str | int):
            number = -1
        else:
            number = int(text) if text.isascii() and text.isdigit() and len(text) <= 20 else -1
        if 0 <= number < size:
            continue
        wanted = f"the {feature.part} of column {column.name!r}, a number in 0..{size - 1}"
        raw = _raw_time_part(text, column, feature.part)
        if raw is not None:
            return (
                f"token {row} is {shorten(token)}, a raw time of column {column.name!r}; this table's tokens "
                f"are {wanted}: write {raw} for it (serving turns each row's time into its "
                f"{feature.part} before the lookup)"
            )
        return f"token {row} is {shorten(token)}; this table's tokens are {wanted}"
    return ""


def _raw_time_part(text: str, column: RawColumn, part: str) -> int | None:
    """The ``part`` of ``text`` read as a time of ``column`` (None: it is no time of that column)."""
    if not text:
        return None
    try:
        seconds, _ = parse_times(np.array([text.encode()], dtype=object), column, column.name)
    except InvalidInput:
        return None
    return int(time_part(seconds, part, column.timezone)[0])


def fp16_rounding(spec: ModelSpec, table: str, vectors: np.ndarray) -> float | None:
    """The largest ``|float16(w) - w|`` of a float32 table the spec stores as float16 (None: not rounded).

    Read a block at a time, so a memory-mapped table is never held whole.
    """
    if table not in spec.store.float16_tables or vectors.dtype != np.float32:
        return None
    largest = 0.0
    for start in range(0, len(vectors), ROUNDING_BLOCK_ROWS):
        block = np.asarray(vectors[start : start + ROUNDING_BLOCK_ROWS], np.float32)
        rounded = block.astype(np.float16).astype(np.float32)
        largest = max(largest, float(np.max(np.abs(rounded - block), initial=0.0)))
    return largest


def with_imported_cardinalities(spec: ModelSpec, rows: Mapping[str, int]) -> ModelSpec:
    """``spec`` with each table whose cardinality it omits (or gives as 0) sized by its imported rows.

    The spec's document changes the same way, so the spec a repository carries (its configs' ``spec``
    parameter) says how many rows each table holds.
    """
    doc = copy.deepcopy(spec.source)
    changed = False
    for pattern, section in doc.get("tables", {}).items():
        names = expand_names(pattern)
        given = section.get("cardinality")
        counts = [rows.get(name, 0) for name in names]
        if not given and all(counts):
            section["cardinality"] = counts if len(names) > 1 else counts[0]
            changed = True
        elif isinstance(given, list) and len(given) == len(names) and not all(given):
            section["cardinality"] = [g or c for g, c in zip(given, counts, strict=True)]
            changed = True
    return replace(parse_spec(doc), access=spec.access) if changed else spec


def report_rounding(
    spec: ModelSpec, tables: Mapping[str, TableArrays], progress: Callable[[str], None]
) -> dict[str, float]:
    """:func:`fp16_rounding` of every table that is rounded, each told to ``progress``."""
    rounded = {}
    for name, table in tables.items():
        delta = fp16_rounding(spec, name, np.asarray(table.vectors))
        if delta is not None:
            rounded[name] = delta
            progress(
                f"[import] table {name!r} is stored as float16: its float32 weights are rounded by up to "
                f"{delta:.3g} (max |Δ|); scores of the float32 model differ by about as much "
                f'(dtype = "fp32" in [tables.{name}] keeps them)'
            )
    return rounded
