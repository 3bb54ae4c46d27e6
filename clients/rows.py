"""Criteo-style input rows: read TSV/CSV files into numpy and render the ``ctr`` request tensors.

Two text layouts are read by :func:`read_rows`:

* **Criteo TSV**, no header: ``label, I1..I13, C1..C26`` (40 columns) or the same without the label
  (39 columns), optionally followed by two extra columns ``history_items`` (item ids separated by
  spaces or commas, may be empty) and ``target_item`` (may be empty: absent). So 39, 40, 41 or 42
  columns; a label is present with 40 or 42 columns.
* **CSV with a header** naming the columns: ``I1..I13`` and ``C1..C26`` are required, ``label``,
  ``history_items`` and ``target_item`` are optional and the order is free. History ids are
  separated by spaces inside the field. A tab-separated file with such a header is read the same way.

Column names come from the model spec (dense and categorical columns, the sequence and target
feature names). Empty integer fields are missing values, negative dense values are allowed, empty
categorical fields are sent as ``b""``. Any other malformed field raises :class:`RowFormatError`
naming the line and column.

:func:`write_tsv` and :func:`write_csv` write :class:`recserve.build.synthetic.RawRows` in those
layouts, so tests and examples can produce input files.
"""

from __future__ import annotations

import csv
import gzip
import io
import logging
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, BinaryIO, cast

import numpy as np

from recserve.errors import InvalidInput
from recserve.spec import NUMPY_DTYPES, ModelSpec
from recserve.wire import ABSENT_ITEM, RawRows, parse_hex

LOGGER = logging.getLogger(__name__)

#: Name of the optional label column in files with a header.
LABEL_COLUMN = "label"

_WHITESPACE = np.array([ord(c) for c in " \t\r\n\v\f"], dtype=np.uint32)

PathOrFile = str | os.PathLike[str] | IO[str] | IO[bytes]


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


@dataclass
class CriteoRows:
    """Parsed rows, column-wise as numpy arrays.

    Attributes:
        dense: float32 ``[N, D]`` raw dense counts, 0 where missing.
        dense_missing: bool ``[N, D]``, True where a dense value is absent.
        categorical: object ``[N, C]`` of ``bytes`` hex strings, ``b""`` when empty.
        target: int64 ``[N]`` target item id, -1 when absent.
        history: int64 ``[N, W]`` history item ids, newest last, zero padded; ``W >= 1``.
        lengths: int32 ``[N]`` number of valid history positions per row.
        labels: float32 ``[N]`` click labels, or None when the input had no label column.
    """

    dense: np.ndarray
    dense_missing: np.ndarray
    categorical: np.ndarray
    target: np.ndarray
    history: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def take(self, index: slice | np.ndarray) -> CriteoRows:
        """Rows selected by a slice or an index array (the history keeps its padded width)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return CriteoRows(**{k: None if v is None else v[index] for k, v in values.items()})

    def batches(self, size: int) -> Iterator[CriteoRows]:
        """Consecutive slices of at most ``size`` rows, in order.

        Args:
            size: rows per batch, at least 1.

        Raises:
            ValueError: ``size`` is not positive.
        """
        if size < 1:
            raise ValueError(f"batch size must be at least 1, got {size}")
        for start in range(0, len(self), size):
            yield self.take(slice(start, start + size))

    def to_inputs(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        """Request tensors of the spec's ensemble for these rows.

        The history is trimmed or zero padded to ``W = max(1, longest history of these rows)``.

        Args:
            spec: the model spec naming the wire inputs and their dtypes.

        Returns:
            One array per wire input, keyed by input name, dtypes as in ``spec.wire_inputs()``.
        """
        width = max(int(self.lengths.max(initial=0)), 1)
        history = np.zeros((len(self), width), dtype=np.int64)
        keep = min(width, self.history.shape[1])
        history[:, :keep] = self.history[:, :keep]
        values = {
            spec.dense.name: self.dense,
            spec.dense_missing_input: self.dense_missing,
            spec.categorical.name: self.categorical,
            spec.target.name: self.target.reshape(-1, 1),
            spec.sequence.name: history,
            spec.sequence_length_input: self.lengths.reshape(-1, 1),
        }
        return {
            wire.name: np.ascontiguousarray(values[wire.name], dtype=NUMPY_DTYPES[wire.dtype])
            for wire in spec.wire_inputs()
        }


# ---- reading ---------------------------------------------------------------------------------


@dataclass
class _Tokens:
    """Raw string fields of all rows, before conversion."""

    lines: list[int]
    dense: list[list[str]]
    categorical: list[list[str]]
    labels: list[str] | None
    history: list[str] | None
    target: list[str] | None


def read_rows(path_or_file: PathOrFile, spec: ModelSpec, max_rows: int | None = None) -> CriteoRows:
    """Read Criteo TSV or headed CSV rows (see the module docstring for the layouts).

    Args:
        path_or_file: a path (``.gz`` is decompressed) or an open text or binary file.
        spec: the model spec giving column names and the maximum history length.
        max_rows: stop after this many data rows (None: read everything).

    Returns:
        The parsed rows.

    Raises:
        RowFormatError: a line has the wrong number of columns or a malformed field.
    """
    with _TextSource(path_or_file) as text:
        first = text.readline().lstrip("\ufeff")
        header = _header_fields(first, spec)
        if header is not None:
            delimiter, names = header
            tokens = _read_headed(text, spec, delimiter, names, max_rows)
        else:
            tokens = _read_tsv(_chain([first], text), spec, max_rows)
    rows = _convert(tokens, spec)
    LOGGER.debug("read %d rows (labels: %s)", len(rows), rows.labels is not None)
    return rows


class _TextSource:
    """Context manager yielding a text stream; closes only what it opened itself."""

    def __init__(self, path_or_file: PathOrFile) -> None:
        self._owned: IO[str] | None = None
        self._wrapper: io.TextIOWrapper | None = None
        if isinstance(path_or_file, (str, os.PathLike)):
            path = Path(path_or_file)
            if path.suffix == ".gz":
                self._owned = gzip.open(path, "rt", encoding="utf-8-sig", newline="")
            else:
                self._owned = open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115
            self.stream: IO[str] = self._owned
        elif isinstance(path_or_file, io.TextIOBase) or isinstance(path_or_file.read(0), str):
            self.stream = path_or_file  # type: ignore[assignment]
        else:
            binary = cast(BinaryIO, path_or_file)
            self._wrapper = io.TextIOWrapper(binary, encoding="utf-8-sig", newline="")
            self.stream = self._wrapper

    def __enter__(self) -> IO[str]:
        return self.stream

    def __exit__(self, *exc: object) -> None:
        if self._owned is not None:
            self._owned.close()
        if self._wrapper is not None:
            self._wrapper.detach()  # leave the caller's binary stream open


def _chain(head: list[str], rest: Iterable[str]) -> Iterator[str]:
    yield from head
    yield from rest


def _header_fields(first: str, spec: ModelSpec) -> tuple[str, list[str]] | None:
    """``(delimiter, column names)`` when the first line is a header, else None."""
    line = first.rstrip("\r\n")
    markers = {spec.dense.columns[0].lower(), spec.categorical.columns[0].lower()}
    for delimiter in (",", "\t"):
        if delimiter in line:
            names = [n.strip().strip('"').strip().lower() for n in line.split(delimiter)]
            if markers & set(names):
                return delimiter, names
    return None


def _read_headed(
    text: IO[str], spec: ModelSpec, delimiter: str, names: list[str], max_rows: int | None
) -> _Tokens:
    """Tokens of a file whose first line (already consumed) names the columns."""
    index = {name: i for i, name in enumerate(names)}
    if len(index) != len(names):
        duplicated = sorted({n for n in names if names.count(n) > 1})
        raise RowFormatError(f"duplicated column names {duplicated}", line=1)
    columns = (*spec.dense.columns, *spec.categorical.columns)
    required = [c.lower() for c in columns]
    missing = [c for c in columns if c.lower() not in index]
    if missing:
        raise RowFormatError(f"header lacks required columns {missing}", line=1)
    known = {*required, LABEL_COLUMN, spec.sequence.name.lower(), spec.target.name.lower()}
    ignored = [n for n in names if n not in known]
    if ignored:
        LOGGER.warning("ignoring unknown columns %s", ignored)
    dense_idx = [index[c.lower()] for c in spec.dense.columns]
    cat_idx = [index[c.lower()] for c in spec.categorical.columns]
    label_idx = index.get(LABEL_COLUMN)
    history_idx = index.get(spec.sequence.name.lower())
    target_idx = index.get(spec.target.name.lower())

    tokens = _Tokens(
        lines=[],
        dense=[],
        categorical=[],
        labels=None if label_idx is None else [],
        history=None if history_idx is None else [],
        target=None if target_idx is None else [],
    )
    reader = csv.reader(text, delimiter=delimiter, skipinitialspace=True)
    for fields_ in reader:
        line = reader.line_num + 1  # the header was read before the reader started
        if not fields_ or (len(fields_) == 1 and not fields_[0].strip()):
            continue
        if max_rows is not None and len(tokens.lines) >= max_rows:
            break
        if len(fields_) != len(names):
            raise RowFormatError(
                f"expected {len(names)} columns as in the header, got {len(fields_)}", line=line
            )
        tokens.lines.append(line)
        tokens.dense.append([fields_[i] for i in dense_idx])
        tokens.categorical.append([fields_[i] for i in cat_idx])
        if tokens.labels is not None:
            tokens.labels.append(fields_[label_idx])  # type: ignore[index]
        if tokens.history is not None:
            tokens.history.append(fields_[history_idx])  # type: ignore[index]
        if tokens.target is not None:
            tokens.target.append(fields_[target_idx])  # type: ignore[index]
    return tokens


def _read_tsv(lines: Iterable[str], spec: ModelSpec, max_rows: int | None) -> _Tokens:
    """Tokens of a headerless Criteo TSV file (39, 40, 41 or 42 columns)."""
    n_dense, n_cat = len(spec.dense.columns), len(spec.categorical.columns)
    base = n_dense + n_cat
    layouts = {base: (False, False), base + 1: (True, False), base + 2: (False, True), base + 3: (True, True)}
    tokens: _Tokens | None = None
    width = 0
    for number, raw in enumerate(lines, start=1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        if max_rows is not None and (0 if tokens is None else len(tokens.lines)) >= max_rows:
            break
        parts = line.split("\t")
        if tokens is None:
            if len(parts) not in layouts:
                raise RowFormatError(
                    f"expected {', '.join(map(str, sorted(layouts)))} tab-separated columns, "
                    f"got {len(parts)}",
                    line=number,
                )
            width = len(parts)
            has_label, has_extras = layouts[width]
            tokens = _Tokens(
                lines=[],
                dense=[],
                categorical=[],
                labels=[] if has_label else None,
                history=[] if has_extras else None,
                target=[] if has_extras else None,
            )
        elif len(parts) != width:
            raise RowFormatError(
                f"expected {width} tab-separated columns like the first row, got {len(parts)}", line=number
            )
        offset = 1 if tokens.labels is not None else 0
        tokens.lines.append(number)
        if tokens.labels is not None:
            tokens.labels.append(parts[0])
        tokens.dense.append(parts[offset : offset + n_dense])
        tokens.categorical.append(parts[offset + n_dense : offset + base])
        if tokens.history is not None and tokens.target is not None:
            tokens.history.append(parts[offset + base])
            tokens.target.append(parts[offset + base + 1])
    if tokens is None:
        return _Tokens(lines=[], dense=[], categorical=[], labels=None, history=None, target=None)
    return tokens


def _convert(tokens: _Tokens, spec: ModelSpec) -> CriteoRows:
    """Turn string tokens into typed arrays, naming the line and column of the first bad field."""
    n = len(tokens.lines)
    lines = np.asarray(tokens.lines, dtype=np.int64)
    dense_cols = list(spec.dense.columns)
    cat_cols = list(spec.categorical.columns)

    dense_text = _text_array(tokens.dense, (n, len(dense_cols)))
    dense_missing = dense_text == ""
    dense = _parse_ints(np.where(dense_missing, "0", dense_text), lines, dense_cols).astype(np.float32)

    categorical = _parse_categorical(tokens.categorical, spec, lines, cat_cols)

    if tokens.target is None:
        target = np.full(n, ABSENT_ITEM, dtype=np.int64)
    else:
        target_text = _text_array(tokens.target, (n, 1))
        absent = target_text == ""
        target = _parse_ints(np.where(absent, str(ABSENT_ITEM), target_text), lines, [spec.target.name])[:, 0]
        bad = target < ABSENT_ITEM
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise RowFormatError(
                f"{int(target[r])} is not an item id (ids are >= 0; leave the field empty when absent)",
                line=int(lines[r]),
                column=spec.target.name,
            )

    history, lengths = _parse_history(tokens.history, n, lines, spec)

    labels = None
    if tokens.labels is not None:
        label_text = _text_array(tokens.labels, (n, 1))
        labels = _parse_floats(label_text, lines, [LABEL_COLUMN])[:, 0]

    return CriteoRows(dense, dense_missing, categorical, target, history, lengths, labels)


def _codepoints(text: np.ndarray) -> np.ndarray:
    """Code points ``[..., chars]`` of a ``str`` array (0 past the end of each string)."""
    return text.view(np.uint32).reshape(*text.shape, text.dtype.itemsize // 4)


def _text_array(fields_: list[list[str]] | list[str], shape: tuple[int, ...]) -> np.ndarray:
    """A ``str`` array of ``shape``, stripped of surrounding whitespace where there is any."""
    text = np.asarray(fields_, dtype=str).reshape(shape)
    if np.isin(_codepoints(text), _WHITESPACE).any():  # rare: skip the slow strip otherwise
        text = np.char.strip(text)
    return text


def _parse_ints(text: np.ndarray, lines: np.ndarray, columns: list[str]) -> np.ndarray:
    """int64 values of a ``[N, K]`` string array; raises on the first malformed field."""
    try:
        if (_codepoints(text) == ord("_")).any():  # int() would accept "1_000"
            raise ValueError("underscore")
        return text.astype(np.int64)
    except (ValueError, OverflowError):
        pass
    values = np.zeros(text.shape, dtype=np.int64)
    for (r, c), value in np.ndenumerate(text):  # slow path: find and name the offending field
        try:
            if "_" in value:
                raise ValueError(value)
            values[r, c] = int(value)
        except (ValueError, OverflowError):
            raise RowFormatError(
                f"{value!r} is not an integer", line=int(lines[r]), column=columns[c]
            ) from None
    return values


def _parse_floats(text: np.ndarray, lines: np.ndarray, columns: list[str]) -> np.ndarray:
    """float32 values of a ``[N, K]`` string array; raises on the first malformed or non-finite field."""
    try:
        values = text.astype(np.float32)
    except ValueError:
        values = None
    if values is not None and np.isfinite(values).all():
        return values
    for (r, c), value in np.ndenumerate(text):
        try:
            ok = np.isfinite(float(value))
        except ValueError:
            ok = False
        if not ok:
            raise RowFormatError(f"{value!r} is not a finite number", line=int(lines[r]), column=columns[c])
    raise AssertionError("unreachable")  # pragma: no cover


def _parse_categorical(
    rows: list[list[str]], spec: ModelSpec, lines: np.ndarray, columns: list[str]
) -> np.ndarray:
    """Object array ``[N, C]`` of ASCII ``bytes``, checked to be hex strings the server accepts."""
    n = len(rows)
    text = _text_array(rows, (n, len(columns)))
    try:
        encoded: np.ndarray | None = text.astype(bytes)  # ASCII only
    except UnicodeEncodeError:
        encoded = None
    if encoded is not None:
        values = encoded.astype(object)
        try:
            parse_hex(values, spec.categorical.max_hex_digits, spec.categorical.name)
            return values
        except InvalidInput:
            pass
    digits = spec.categorical.max_hex_digits
    for (r, c), value in np.ndenumerate(text):
        if len(value) > digits or not all(ch in "0123456789abcdefABCDEF" for ch in value):
            raise RowFormatError(
                f"{value!r} is not a hex string of at most {digits} digits",
                line=int(lines[r]),
                column=columns[c],
            )
    raise AssertionError("unreachable")  # pragma: no cover


def _parse_history(
    fields_: list[str] | None, n: int, lines: np.ndarray, spec: ModelSpec
) -> tuple[np.ndarray, np.ndarray]:
    """Padded history ``[N, max(1, longest)]`` and lengths ``[N]`` from id lists in text."""
    name, max_length = spec.sequence.name, spec.sequence.max_length
    if fields_ is None:
        return np.zeros((n, 1), dtype=np.int64), np.zeros(n, dtype=np.int32)
    normalised = [field.replace(",", " ") for field in fields_]
    lengths = np.fromiter((len(field.split()) for field in normalised), dtype=np.int32, count=n)
    too_long = np.flatnonzero(lengths > max_length)
    if too_long.size:
        r = int(too_long[0])
        raise RowFormatError(
            f"history of {int(lengths[r])} items is longer than the maximum {max_length}",
            line=int(lines[r]),
            column=name,
        )
    row_of = np.repeat(np.arange(n), lengths)
    flat = _parse_id_text(" ".join(normalised), int(lengths.sum()))
    if flat is None:  # something other than plain ids: parse token by token to name the line
        tokens = np.asarray([t for field in normalised for t in field.split()], dtype=str)
        flat = _parse_ints(tokens.reshape(-1, 1), lines[row_of], [name])[:, 0]
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


def _parse_id_text(text: str, count: int) -> np.ndarray | None:
    """Fast path: ``count`` non-negative ids separated by whitespace, or None if ``text`` is anything else."""
    if not text.isascii():
        return None
    data = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    digit = (data >= ord("0")) & (data <= ord("9"))
    if not (digit | np.isin(data, _WHITESPACE.astype(np.uint8))).all():
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


def _text_columns(
    raw: RawRows, spec: ModelSpec, with_label: bool, history_separator: str
) -> list[np.ndarray]:
    """String columns ``[N, K]`` in file order: label, dense, categorical, history, target."""
    dense = np.char.mod("%d", raw.dense.astype(np.int64)).astype(object)
    dense[raw.dense_missing] = ""
    categorical = np.char.mod("%08x", raw.categorical).astype(object)
    categorical[raw.categorical_empty] = ""
    history = np.array(
        [history_separator.join(map(str, raw.history[r, : raw.lengths[r]])) for r in range(len(raw))],
        dtype=object,
    ).reshape(-1, 1)
    target = np.char.mod("%d", raw.target).astype(object).reshape(-1, 1)
    target[raw.target == ABSENT_ITEM] = ""
    columns = [dense, categorical, history, target]
    if with_label:
        columns.insert(0, np.char.mod("%d", raw.labels.astype(np.int64)).astype(object).reshape(-1, 1))
    return columns


def write_tsv(
    path: str | os.PathLike[str],
    raw_rows: RawRows,
    spec: ModelSpec,
    with_label: bool = True,
    with_sequence: bool = True,
) -> Path:
    """Write rows in the headerless Criteo TSV layout.

    Args:
        path: output file (``.gz`` is compressed).
        raw_rows: the rows, e.g. from :func:`recserve.build.synthetic.generate`.
        spec: the model spec (column counts).
        with_label: write the label as the first column.
        with_sequence: append the ``history_items`` (space-separated ids) and ``target_item`` columns.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    return _write_table(path, raw_rows, spec, with_label, with_sequence, delimiter="\t", header=False)


def write_csv(
    path: str | os.PathLike[str],
    raw_rows: RawRows,
    spec: ModelSpec,
    with_label: bool = True,
    with_sequence: bool = True,
) -> Path:
    """Write rows as CSV with a header row (history ids space-separated inside their field).

    Args:
        path: output file (``.gz`` is compressed).
        raw_rows: the rows, e.g. from :func:`recserve.build.synthetic.generate`.
        spec: the model spec (column names).
        with_label: write a ``label`` column first.
        with_sequence: add the ``history_items`` and ``target_item`` columns.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    return _write_table(path, raw_rows, spec, with_label, with_sequence, delimiter=",", header=True)


def _write_table(
    path: str | os.PathLike[str],
    raw_rows: RawRows,
    spec: ModelSpec,
    with_label: bool,
    with_sequence: bool,
    delimiter: str,
    header: bool,
) -> Path:
    columns = _text_columns(raw_rows, spec, with_label, " ")
    names = [*spec.dense.columns, *spec.categorical.columns, spec.sequence.name, spec.target.name]
    if with_label:
        names.insert(0, LABEL_COLUMN)
    if not with_sequence:
        columns, names = columns[:-2], names[:-2]
    table = np.concatenate(columns, axis=1)
    out = Path(path)
    opener = gzip.open if out.suffix == ".gz" else open
    with opener(out, "wt", encoding="utf-8", newline="") as fh:  # type: ignore[operator]
        writer = csv.writer(fh, delimiter=delimiter, lineterminator="\n")
        if header:
            writer.writerow(names)
        writer.writerows(table.tolist())
    return out


__all__ = [
    "LABEL_COLUMN",
    "CriteoRows",
    "RowFormatError",
    "read_rows",
    "write_csv",
    "write_tsv",
]
