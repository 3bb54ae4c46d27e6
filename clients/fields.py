"""Typed columns from the text fields of input rows, naming the line and column of a bad field."""

from __future__ import annotations

import warnings

import numpy as np

from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import CategoricalGroup, RawColumn, SequenceFeature
from recserve.core.values import BLANKS, canonical_value, categorical_values, multi_hot_values
from recserve.errors import InvalidInput, shorten

WHITESPACE = np.frombuffer(BLANKS, dtype=np.uint8).astype(np.uint32)


class RowFormatError(ValueError):
    """A line of an input file cannot be parsed.

    Attributes:
        line: 1-based line number in the file (None when the error is not about one line).
        column: name of the offending column (None when the error is about the whole line).
    """

    def __init__(self, message: str, line: int | None = None, column: str | None = None) -> None:
        where = []
        if line is not None:
            where.append(f"line {line}")
        if column is not None:
            where.append(f"column {column}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.line = line
        self.column = column


def codepoints(text: np.ndarray) -> np.ndarray:
    """Code points ``[..., chars]`` of a ``str`` array (0 past the end of each string)."""
    return text.view(np.uint32).reshape(*text.shape, text.dtype.itemsize // 4)


def text_array(fields_: list[list[str]] | list[str], shape: tuple[int, ...]) -> np.ndarray:
    """A ``str`` array of ``shape``, stripped of surrounding whitespace where there is any."""
    text = np.asarray(fields_, dtype=str).reshape(shape)
    if np.isin(codepoints(text), WHITESPACE).any():  # rare: skip the slow strip otherwise
        text = np.char.strip(text)
    return text


def integral_text(text: np.ndarray) -> np.ndarray:
    """``text`` with integers written as floats (``"260.0"``, as pandas exports them) cut to ``"260"``.

    Only decimal digits followed by a point and zeros are cut, on the text itself, so ids of any
    size stay exact; ``"260.5"`` or ``"ab.0"`` are left alone (and refused by the column's parser).
    A hex column whose values are all decimal digits comes out of pandas the same way
    (``"30883035.0"``), and cutting gives back the hex string, up to leading zeros, which do not
    change its value.
    """
    pointed = np.char.find(text, ".") >= 0
    if not pointed.any():
        return text
    parts = np.char.partition(text, ".")
    head, tail = parts[..., 0], parts[..., 2]
    cut = pointed & (np.char.strip(tail, "0") == "") & np.char.isdigit(np.char.lstrip(head, "+-"))
    return np.where(cut, head, text)


def _as_ints(text: np.ndarray) -> np.ndarray | None:
    """int64 values of integral ``text`` in one numpy call; None when some field is no integer."""
    if (codepoints(text) == ord("_")).any():  # int() would accept "1_000"
        return None
    try:
        return text.astype(np.int64)
    except (ValueError, OverflowError):
        return None


def parse_ints(text: np.ndarray, lines: np.ndarray, columns: list[str]) -> np.ndarray:
    """int64 values of a ``[N, K]`` string array; raises on the first malformed field.

    Integers written as floats with a zero fraction (``"260.0"``) are accepted as integers.
    """
    text = integral_text(text)
    fast = _as_ints(text)
    if fast is not None:
        return fast
    values = np.zeros(text.shape, dtype=np.int64)
    for (r, c), value in np.ndenumerate(text):  # slow path: find and name the offending field
        try:
            if "_" in value:
                raise ValueError(value)
            values[r, c] = int(value)
        except (ValueError, OverflowError):
            raise RowFormatError(
                f"{shorten(value)} is not an integer", line=int(lines[r]), column=columns[c]
            ) from None
    return values


def parse_numbers(text: np.ndarray, lines: np.ndarray, columns: list[str]) -> np.ndarray:
    """float32 values of a ``[N, K]`` string array of numeric fields; raises on the first bad field.

    Integers (``"260"``, ``"260.0"``) are read as integers first, so each becomes the float32 nearest
    to it, as the SDK's own arrays do; real values (``"8.3"``, ``"1e-3"``) as floats. A field that is
    no number (``"1_000"`` included, which Python's ``float`` would take) or not finite is refused.
    """
    integers = _as_ints(integral_text(text))  # no per-field search for the first real value
    if integers is not None:
        return integers.astype(np.float32)
    underscore = (codepoints(text) == ord("_")).any(axis=-1)
    if underscore.any():
        r, c = np.argwhere(underscore)[0]
        raise RowFormatError(
            f"{shorten(str(text[r, c]))} is not a number", line=int(lines[r]), column=columns[c]
        )
    return parse_floats(text, lines, columns)


def parse_floats(text: np.ndarray, lines: np.ndarray, columns: list[str]) -> np.ndarray:
    """float32 values of a ``[N, K]`` string array; raises on the first malformed or non-finite field."""
    try:
        with np.errstate(over="ignore"):  # beyond float32: inf, refused below with its line
            values = text.astype(np.float32)
    except ValueError:
        values = None
    if values is not None and np.isfinite(values).all():
        return values
    for (r, c), value in np.ndenumerate(text):
        try:  # float32 holds up to 3.4e38: a larger finite double is no value either
            finite = abs(float(value)) <= np.finfo(np.float32).max
        except ValueError:
            raise RowFormatError(
                f"{shorten(value)} is not a number", line=int(lines[r]), column=columns[c]
            ) from None
        if not finite:
            raise RowFormatError(
                f"{shorten(value)} is not a finite number", line=int(lines[r]), column=columns[c]
            )
    raise AssertionError("unreachable")  # pragma: no cover


def parse_categorical(
    rows: list[list[str]], spec: ModelSpec, lines: np.ndarray, columns: list[str]
) -> np.ndarray:
    """Object array ``[N, C]`` of ``bytes``, each column checked to hold values the server accepts.

    Every field in its canonical form (:func:`~recserve.core.values.canonical_value`: surrounding
    ASCII whitespace is no part of a value), as the server and ``import`` read values. Integers
    written as floats (``"260.0"``) are cut to integers in hex, int and unix-time columns; strings
    and formatted times are kept as written.
    """
    n = len(rows)
    raw = np.asarray(rows, dtype=str).reshape(n, len(columns))
    out = np.empty((n, len(columns)), dtype=object)
    for c, column in enumerate(spec.categorical.raw_columns):
        text = np.ascontiguousarray(raw[:, c])
        if np.isin(codepoints(text), WHITESPACE).any():  # rare: skip the per-field pass otherwise
            text = np.array([canonical_value(value).decode() for value in text], dtype=str).reshape(n)
        canonical = text
        as_written = column.value_type == "string" or bool(column.time_format)
        text = text if as_written else integral_text(text)
        try:
            encoded = text.astype(bytes).astype(object)  # ASCII only: the fast path
        except UnicodeEncodeError:
            encoded = np.array([value.encode() for value in text], dtype=object)
        single = CategoricalGroup(spec.categorical.name, (column,), ())

        def check(values: np.ndarray, column: RawColumn = column, single: CategoricalGroup = single) -> None:
            if column.separator:
                multi_hot_values(values, column, single.name)
            else:
                categorical_values(values[:, None], single)

        try:
            check(encoded)
        except InvalidInput:
            for r in range(n):  # slow path: find and name the offending field
                try:
                    check(encoded[r : r + 1])
                except InvalidInput as exc:
                    raise RowFormatError(
                        _why(canonical[r], column, exc), line=int(lines[r]), column=columns[c]
                    ) from None
        out[:, c] = encoded
    return out


def _why(value: str, column: RawColumn, error: InvalidInput) -> str:
    if column.value_type == "hex" and not column.separator:
        return f"{shorten(value)} is not a hex string of at most {column.max_hex_digits} digits"
    reason = error.detail.split(": ", 1)[-1]
    return f"{shorten(value)} is {reason}"


def parse_history(
    fields_: list[str] | None, n: int, lines: np.ndarray, sequence: SequenceFeature
) -> tuple[np.ndarray, np.ndarray]:
    """Padded history ``[N, max(1, longest)]`` and lengths ``[N]`` from id lists in text.

    The ids are separated by the sequence's ``separator``, or by whitespace or commas. A history
    longer than the sequence's ``max_length`` keeps its newest (last) ids.
    """
    if fields_ is None:
        return np.zeros((n, 1), dtype=np.int64), np.zeros(n, dtype=np.int32)
    name, max_length = sequence.name, sequence.max_length
    normalised = [field.replace(sequence.separator or ",", " ") for field in fields_]
    lengths = np.fromiter((len(field.split()) for field in normalised), dtype=np.int32, count=n)
    for r in np.flatnonzero(lengths > max_length):
        normalised[r] = " ".join(normalised[r].split()[-max_length:])
        lengths[r] = max_length
    row_of = np.repeat(np.arange(n), lengths)
    flat = parse_id_text(" ".join(normalised), int(lengths.sum()))
    if flat is None:  # something other than plain ids: parse token by token to name the line
        tokens = np.asarray([t for field in normalised for t in field.split()], dtype=str)
        flat = parse_ints(tokens.reshape(-1, 1), lines[row_of], [name])[:, 0]
    negative = flat < 0
    if negative.any():
        k = int(np.flatnonzero(negative)[0])
        raise RowFormatError(
            f"{int(flat[k])} is not an item id (ids are >= 0)", line=int(lines[row_of[k]]), column=name
        )
    width = max(int(lengths.max(initial=0)), 1)
    history = np.zeros((n, width), dtype=np.int64)
    history[np.arange(width)[None, :] < lengths[:, None]] = flat
    return history, lengths


def parse_id_text(text: str, count: int) -> np.ndarray | None:
    """Fast path: ``count`` non-negative ids separated by whitespace, or None if ``text`` is anything else."""
    if not text.isascii():
        return None
    data = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    digit = (data >= ord("0")) & (data <= ord("9"))
    if not (digit | np.isin(data, WHITESPACE.astype(np.uint8))).all():
        return None
    # Longest run of digits: anything beyond 18 digits might not fit int64.
    edges = np.flatnonzero(np.diff(np.concatenate(([0], digit.view(np.int8), [0]))))
    if edges.size and (edges[1::2] - edges[::2]).max() > 18:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            values = np.fromstring(text, dtype=np.int64, sep=" ") if count else np.zeros(0, np.int64)
        except (ValueError, DeprecationWarning):
            return None
    return values if values.shape[0] == count else None


# ---- writing ---------------------------------------------------------------------------------
