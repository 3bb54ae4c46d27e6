"""Rows whose categorical values take every awkward shape the text can: for both wire forms' tests."""

from __future__ import annotations

from recserve.build.synthetic import generate
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec


def column_index(spec: ModelSpec, name: str) -> int:
    """The raw categorical column's index."""
    return spec.categorical.columns.index(name)


def edge_rows(spec: ModelSpec, count: int = 64, seed: int = 3) -> Rows:
    """Synthetic rows with empty values, values no table holds, and awkward text in every column kind."""
    rows = generate(spec, count, seed)
    cat = rows.categorical
    for i, column in enumerate(spec.categorical.raw_columns):
        cat[1, i] = b""  # empty
        if column.separator:  # multi-hot: empty elements, more than max_length, one value
            sep = column.separator.encode()
            cat[2, i] = sep.join([b"7", b"", b"12"])
            cat[3, i] = sep.join(str(v).encode() for v in range(column.max_length + 5))
            cat[4, i] = b"123456789"
        elif column.value_type == "hex":
            cat[2, i] = b"00FfA"  # case and leading zeros
            cat[3, i] = b"f" * column.max_hex_digits  # the widest value, in no table
        elif column.value_type == "string":
            cat[2, i] = "café ☕".encode()
            cat[3, i] = b"x" * 300  # hashed one by one
        elif column.value_type in ("int64", "uint64"):
            cat[2, i] = b"-5" if column.value_type == "int64" else b"18446744073709551615"
            cat[3, i] = b"9223372036854775807"
    return rows
