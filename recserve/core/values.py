"""The value codec: raw column values (hex, decimal, times, strings, lists) parsed into numbers and ids."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from recserve.core.spec.types import CategoricalGroup, RawColumn
from recserve.core.times import unix_seconds
from recserve.errors import InvalidInput, cap_message, shorten

_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i

#: Raw ``target_item`` value meaning "no target item".
ABSENT_ITEM = -1

#: What may surround a categorical value without being part of it: ASCII whitespace (what
#: ``bytes.strip()`` removes). Inner whitespace is part of the value.
BLANKS = b" \t\n\r\x0b\x0c"


def canonical_value(value: object) -> bytes:
    """A raw categorical value in its one canonical form: UTF-8 bytes, surrounding ASCII whitespace removed.

    Every path reads values by this rule: the file reader behind ``predict`` and ``verify`` (which
    sends the canonical form), the server's transform (so a request from the SDK or any other client
    is read the same way), ``import``'s vocabulary tokens and ``explain``. So ``" a "``, ``"a"`` and
    ``b"a "`` are one value everywhere, and a vocabulary written with its tokens' spaces serves the
    rows that send them without (two tokens that differ only by such spaces are refused at import as
    the same value). Other values are written as ``str()`` gives them (an int token as its digits).
    """
    data = value if isinstance(value, bytes) else str(value).encode()
    return data.strip(BLANKS)


def canonical_fields(values: np.ndarray) -> np.ndarray:
    """:func:`canonical_value` of every field of ``values``: an object array of ``bytes``, same shape."""
    flat = [canonical_value(v) for v in np.asarray(values, dtype=object).ravel()]
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(np.shape(values))


#: A parser of hex strings with :func:`parse_hex`'s signature and results.
HexParser = Callable[[np.ndarray, int, str], tuple[np.ndarray, np.ndarray]]


def hex_bytes(values: np.ndarray, max_digits: int, input_name: str) -> np.ndarray:
    """``values`` as NUL-padded fixed-width bytes, ``max_digits + 1`` wide (a longer string shows).

    Raises:
        InvalidInput: a value is not ASCII.
    """
    try:
        return np.asarray(values, dtype=f"S{max_digits + 1}")
    except (UnicodeEncodeError, ValueError, TypeError):
        bad = next(v for v in values.ravel() if not _is_ascii(v))
        raise InvalidInput(input_name, f"value {shorten(bad)} is not an ASCII hex string") from None


def parse_hex(values: np.ndarray, max_digits: int, input_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse an array of hex byte strings into ``uint64`` values, vectorised.

    Args:
        values: object array of ``bytes`` (or ``str``), any shape.
        max_digits: longest accepted string (at most 16 digits fit 64 bits).
        input_name: named in errors.

    Returns:
        ``(values, missing)``: parsed values and a mask of empty strings, both of ``values.shape``.

    Raises:
        InvalidInput: a string is too long or holds a non-hex character.
    """
    parsed, bad_rows = _parse_hex_fixed(values, max_digits, input_name)
    if bad_rows.any():  # the fast path takes values as sent: read them again in their canonical form
        parsed, bad_rows = _parse_hex_fixed(canonical_fields(values), max_digits, input_name)
    if bad_rows.any():
        index = int(np.flatnonzero(bad_rows)[0])
        raw = values.reshape(-1)[index]
        raise InvalidInput(
            input_name,
            f"value {shorten(raw)} at flat index {index} is not a hex string of at most {max_digits} digits",
        )
    return parsed


def _parse_hex_fixed(
    values: np.ndarray, max_digits: int, input_name: str
) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """``((values, missing), bad)`` of :func:`parse_hex`, ``bad`` flagging the flat indices it refuses."""
    fixed = hex_bytes(values, max_digits, input_name)
    width = fixed.dtype.itemsize
    flat = fixed.reshape(-1)
    raw_bytes = flat.view(np.uint8).reshape(-1, width)
    # a fixed-width bytes array pads with NUL and keeps no trailing NUL: the length is the non-NUL count
    # (an embedded NUL counts as a character, and LUT 255 refuses it)
    nonzero = raw_bytes != 0
    lengths = width - np.argmax(nonzero[:, ::-1], axis=1)
    lengths[~nonzero.any(axis=1)] = 0
    digits = _HEX_LUT[raw_bytes]
    positions = np.arange(width)[None, :] < lengths[:, None]
    bad_rows = (lengths > max_digits) | ((digits == 255) & positions).any(axis=1)
    acc = np.zeros(flat.shape[0], dtype=np.uint64)
    for pos in range(max_digits):
        take = positions[:, pos]
        acc = np.where(take, (acc << np.uint64(4)) | digits[:, pos].astype(np.uint64), acc)
    return (acc.reshape(values.shape), (lengths == 0).reshape(values.shape)), bad_rows


def _column_error(input_name: str, column: str, row: int, value: object, why: str) -> InvalidInput:
    return InvalidInput(input_name, f"{column} (row {row}) is {shorten(value)}: {why}")


def _as_text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def parse_decimal(
    values: np.ndarray, signed: bool, input_name: str, columns: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integers (``int64`` when ``signed``, else ``uint64``) of string columns ``[B, len(columns)]``.

    Returns:
        ``(values, empty)``: the values as ``uint64`` (a negative int64 as its two's complement)
        and a mask of empty strings.

    Raises:
        InvalidInput: a value is not a decimal integer of that type (naming the row).
    """
    parsed = _parse_decimal_fast(values, signed)
    if parsed is None:  # the fast path takes values as sent: read them again in their canonical form
        parsed = _parse_decimal_fast(canonical_fields(values), signed)
    if parsed is not None:
        return parsed
    low, high = (-(1 << 63), (1 << 63) - 1) if signed else (0, (1 << 64) - 1)
    for (row, col), value in np.ndenumerate(np.asarray(values, dtype=object)):  # slow path: name it
        text = canonical_value(value).decode("utf-8", "replace")
        digits = text[1:] if signed and text.startswith("-") else text
        # 20 digits hold any 64-bit value; a longer string is refused before int() reads it
        if text and not (
            digits.isascii() and digits.isdigit() and len(digits) <= 20 and low <= int(text) <= high
        ):
            kind = "an int64" if signed else "a uint64"
            raise _column_error(input_name, columns[col], row, value, f"not {kind} in decimal digits")
    raise AssertionError("unreachable")  # pragma: no cover


def _parse_decimal_fast(values: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`parse_decimal`'s result when every value is plainly a decimal of its type, else None."""
    try:
        fixed = np.asarray(values, dtype="S21")
        empty = np.char.str_len(fixed) == 0
        body = np.char.replace(fixed, b"-", b"", count=1) if signed else fixed
        sign_ok = np.char.find(fixed, b"-") <= 0 if signed else True
        if (np.char.isdigit(body) & sign_ok | empty).all() and (np.char.str_len(fixed) < 21).all():
            parsed = np.where(empty, b"0", fixed).astype(np.int64 if signed else np.uint64)
            return parsed.view(np.uint64).reshape(values.shape), empty.reshape(values.shape)
    except (UnicodeEncodeError, ValueError, TypeError, OverflowError):
        pass
    return None


#: Strings up to this many bytes are hashed together, one numpy step per byte position; longer ones
#: one by one (a step costs the same for one string as for a batch, so one long value would make the
#: whole batch pay a step per byte of it).
VECTOR_HASH_BYTES = 64
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def fnv1a64(data: bytes | str) -> int:
    """FNV-1a 64 of ``data`` (a string as its UTF-8 bytes): the project's one string hash.

    It hashes string values into ids (:func:`hash_strings`, vectorised) and names into salts.
    """
    if isinstance(data, str):
        data = data.encode()
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def hash_strings(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FNV-1a 64 of each string's canonical form (:func:`canonical_value`), vectorised; ``(values, empty)``.

    Work is linear in the bytes sent: strings over :data:`VECTOR_HASH_BYTES` are hashed one by one.
    """
    encoded = [canonical_value(v) for v in np.asarray(values, dtype=object).ravel()]
    long = [i for i, v in enumerate(encoded) if len(v) > VECTOR_HASH_BYTES]
    short = [b"" if len(v) > VECTOR_HASH_BYTES else v for v in encoded]
    width = max((len(v) for v in short), default=0) or 1
    fixed = np.array(short, dtype=f"S{width}")
    lengths = np.char.str_len(fixed)  # trailing NULs are not part of a value (as numpy reads it)
    data = fixed.view(np.uint8).reshape(-1, width).astype(np.uint64)
    acc = np.full(len(encoded), _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for pos in range(width):
            step = (acc ^ data[:, pos]) * np.uint64(_FNV_PRIME)
            acc = np.where(pos < lengths, step, acc)
    for i in long:
        value = encoded[i].rstrip(b"\0")
        acc[i] = fnv1a64(value)
        lengths[i] = len(value)
    return acc.reshape(values.shape), (lengths == 0).reshape(values.shape)


def parse_times(values: np.ndarray, column: RawColumn, input_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Unix seconds of a time column (``strptime`` format in its time zone, or unix s / ms).

    Raises:
        InvalidInput: a value does not match the format (naming the row).
    """
    sent, inverse = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
    unique = np.array([canonical_value(_as_text(t)).decode() for t in sent], dtype=str).reshape(-1)
    seconds = np.zeros(len(unique), dtype=np.uint64)
    for i, text in enumerate(unique):
        if text == "":
            continue
        try:
            seconds[i] = unix_seconds(text, column.time_format, column.time_unit, column.timezone)
        except ValueError as exc:
            row = int(np.flatnonzero(inverse == i)[0])
            wanted = f"format {column.time_format!r}" if column.time_format else f"unix {column.time_unit}"
            raise _column_error(
                input_name,
                column.name,
                row,
                values.reshape(-1)[row],
                f"not a time in {wanted} ({cap_message(str(exc), 96)})",
            ) from None
    return seconds[inverse].reshape(values.shape), (unique[inverse] == "").reshape(values.shape)


def categorical_values(
    values: np.ndarray,
    group: CategoricalGroup,
    hex_parser: HexParser | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Parse the categorical tensor ``[B, C]`` column by column, by each column's value type.

    ``hex_parser`` stands in for :func:`parse_hex` (the serving steps pass the compiled one).

    Returns:
        ``(values, empty)``, both ``[B, C]``: ``uint64`` values (hex and decimal numbers as such,
        strings as their FNV-1a 64, times as unix seconds) and a mask of empty fields.

    Raises:
        InvalidInput: a value is not of its column's type (naming the input, column and row).
    """
    out = np.zeros(values.shape, dtype=np.uint64)
    empty = np.zeros(values.shape, dtype=bool)
    columns = group.raw_columns
    by_type = group.single_by_type  # multi-hot columns: multi_hot_values
    hex_columns = by_type.get("hex", [])
    if hex_columns:
        parse = hex_parser or parse_hex
        digits = max(columns[i].max_hex_digits for i in hex_columns)
        if any(columns[i].max_hex_digits != digits for i in hex_columns):
            for i in hex_columns:
                out[:, i], empty[:, i] = parse(values[:, i], columns[i].max_hex_digits, group.name)
        else:
            out[:, hex_columns], empty[:, hex_columns] = parse(values[:, hex_columns], digits, group.name)
    string_columns = by_type.get("string", [])
    if string_columns:
        out[:, string_columns], empty[:, string_columns] = hash_strings(values[:, string_columns])
    for value_type in ("int64", "uint64"):
        index = by_type.get(value_type, [])
        if index:
            names = tuple(columns[i].name for i in index)
            parsed = parse_decimal(values[:, index], value_type == "int64", group.name, names)
            out[:, index], empty[:, index] = parsed
    for i, column in enumerate(columns):
        if column.value_type == "time":
            out[:, i], empty[:, i] = parse_times(values[:, i], column, group.name)
    return out, empty


def multi_hot_tokens(value: object, column: RawColumn) -> list[bytes]:
    """The elements of one multi-hot field kept for serving: the non-empty ones, the first ``max_length``.

    Each element in its canonical form (:func:`canonical_value`): ``"a | b"`` holds ``a`` and ``b``.
    """
    elements = (canonical_value(t) for t in canonical_value(value).split(column.separator.encode()))
    return [t for t in elements if t][: column.max_length]


def multi_hot_values(values: np.ndarray, column: RawColumn, input_name: str) -> tuple[np.ndarray, np.ndarray]:
    """The values of a multi-hot column ``[B]`` (``a|b|c``): ``uint64 [B, max_length]`` and a mask.

    Empty elements are skipped; past ``max_length`` the rest of a row's values are dropped.

    Raises:
        InvalidInput: an element is not of the column's value type (naming the row).
    """
    rows = [multi_hot_tokens(v, column) for v in values]
    lengths = np.array([len(r) for r in rows], dtype=np.intp)
    mask = np.arange(column.max_length)[None, :] < lengths[:, None]
    out = np.zeros(mask.shape, dtype=np.uint64)
    flat = np.array([t for r in rows for t in r], dtype=object)
    if flat.size:
        element = CategoricalGroup(input_name, (replace(column, separator="", max_length=1),), ())
        try:
            out[mask] = categorical_values(flat[:, None], element)[0][:, 0]
        except InvalidInput:
            for row, tokens in enumerate(rows):  # slow path: name the row
                try:
                    categorical_values(np.array(tokens or [b""], dtype=object)[:, None], element)
                except InvalidInput:
                    raise _column_error(
                        input_name, column.name, row, values[row], f"not a list of {column.value_type} values"
                    ) from None
    return out, mask


def join_list(values: np.ndarray, column: RawColumn, input_name: str) -> np.ndarray:
    """The fields ``[B]`` of a multi-hot list tensor ``[B, W]`` (``wire = "list"``), joined by its separator.

    Empty elements are padding. Elements are bytes or str.

    Raises:
        InvalidInput: an element holds the separator or is not text (naming the row and position).
    """
    separator = column.separator.encode()
    fields = np.empty(values.shape[0], dtype=object)
    for row, elements in enumerate(values):
        parts = []
        for position, element in enumerate(elements):
            if isinstance(element, str):
                element = element.encode()
            if not isinstance(element, bytes) or separator in element:
                raise InvalidInput(
                    input_name,
                    f"row {row} position {position} is {shorten(element)}: one value per element, "
                    f"without {column.separator!r}",
                )
            if element:
                parts.append(element)
        fields[row] = separator.join(parts)
    return fields


def split_list(fields: np.ndarray, column: RawColumn) -> np.ndarray:
    """A multi-hot column's fields ``[B]`` as its list tensor ``[B, W]`` (empty elements pad the rows)."""
    separator = column.separator.encode()
    lists = [
        [t for t in (f if isinstance(f, bytes) else str(f).encode()).split(separator) if t] for f in fields
    ]
    out = np.full((len(lists), max([len(v) for v in lists] + [1])), b"", dtype=object)
    for row, values in enumerate(lists):
        out[row, : len(values)] = values
    return out


def _is_ascii(value: object) -> bool:
    if isinstance(value, bytes):
        return value.isascii()
    return isinstance(value, str) and value.isascii()
