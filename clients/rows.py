"""Input rows: read TSV/CSV files into numpy and render the spec's request tensors.

Two text layouts are read by :func:`read_rows` (``ctr`` shown; every name comes from the spec):

* **Headerless TSV** (Criteo's): ``label, I1..I13, C1..C26`` (40 columns) or the same without the
  label (39 columns): the numeric then the categorical and time columns in spec order. A spec with
  a sequence may add two columns, ``history_items`` (item ids separated by spaces or commas, may be
  empty) and ``target_item`` (may be empty: absent). So 39, 40, 41 or 42 columns for ``ctr``.
* **CSV with a header** naming the columns: the numeric, categorical and time columns are required;
  the label (``[inputs] label``), the sequence and its target are optional; columns listed in
  ``[inputs] ignore`` are skipped, other unknown columns too (with a warning); the order is free.
  History ids are separated by spaces inside the field. A tab-separated file with such a header is
  read the same way. With ``[user_state]`` on, a ``user_seq`` column (the sequence number of each
  row's newest history event) makes the history each row's real-time tail: the user is then the
  ``[inputs] user`` column (a ``user_id`` column when the spec names none), an integer or a
  string (sent as its ``user_key``), and the rows carry both (:attr:`Rows.users`,
  :attr:`Rows.user_seqs`), which the clients send as ``user_id`` and ``user_seq``.

Empty numeric fields are missing values, negative numeric values are allowed, empty categorical
fields are sent as ``b""``. Any other malformed field raises :class:`RowFormatError` naming the line
and column.

:mod:`recserve.clients.writers` writes :class:`recserve.core.rows.Rows` in those layouts, so tests and
examples can produce input files; :mod:`recserve.clients.fields` parses the columns.
"""

from __future__ import annotations

import csv
import gzip
import io
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, cast

import numpy as np

from recserve.clients.fields import (
    RowFormatError,
    parse_categorical,
    parse_floats,
    parse_history,
    parse_ints,
    parse_numbers,
    text_array,
)
from recserve.core.names import USER_ID, USER_SEQ
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec
from recserve.core.user_state_wire import serves_user_state, user_key
from recserve.core.values import ABSENT_ITEM

LOGGER = logging.getLogger(__name__)

#: The default name of the label column in files with a header (``[inputs] label``).
LABEL_COLUMN = "label"

PathOrFile = str | os.PathLike[str] | IO[str] | IO[bytes]


# ---- reading ---------------------------------------------------------------------------------


@dataclass
class _Tokens:
    """Raw string fields of all rows, before conversion."""

    lines: list[int]
    dense: list[list[str]]
    categorical: list[list[str]]
    labels: list[str] | None
    sequences: dict[str, list[str]]  # by name: the sequences and targets the file has
    user_state: tuple[list[str], list[str]] | None = None  # each row's user and user_seq fields


def user_state_columns(spec: ModelSpec) -> tuple[str, str] | None:
    """The columns of a row's user and of its newest event's number (None: the spec serves no state)."""
    if not serves_user_state(spec):
        return None
    return spec.inputs.user or USER_ID, USER_SEQ


def _sequence_columns(spec: ModelSpec) -> list[str]:
    """Names of the optional sequence columns, in headerless file order: the histories, then the targets."""
    return [f.name for f in spec.sequences] + list(spec.target_names)


def read_rows(path_or_file: PathOrFile, spec: ModelSpec, max_rows: int | None = None) -> Rows:
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
                self._owned = open(path, encoding="utf-8-sig", newline="")  # closed in __exit__
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
    markers = {c.lower() for c in (*spec.numeric_columns[:1], spec.categorical.columns[0])}
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
    columns = (*spec.numeric_columns, *spec.categorical.columns)
    required = [c.lower() for c in columns]
    missing = [c for c in columns if c.lower() not in index]
    if missing:
        raise RowFormatError(f"header lacks required columns {missing}", line=1)
    sequence = [name.lower() for name in _sequence_columns(spec)]
    label = spec.inputs.label.lower()
    state_columns = user_state_columns(spec)
    state_names = [c.lower() for c in state_columns] if state_columns else []
    known = {*required, label, *sequence, *state_names, *(c.lower() for c in spec.inputs.ignore)}
    unknown = [n for n in names if n not in known]
    if unknown:
        LOGGER.warning("ignoring unknown columns %s", unknown)
    dense_idx = [index[c.lower()] for c in spec.numeric_columns]
    cat_idx = [index[c.lower()] for c in spec.categorical.columns]
    label_idx = index.get(label)
    sequence_idx = {name: index[name.lower()] for name in _sequence_columns(spec) if name.lower() in index}
    state_idx = None
    if state_columns and state_names[1] in index:
        if state_names[0] not in index:
            raise RowFormatError(
                f"a {state_columns[1]} column needs the user's column {state_columns[0]!r}", line=1
            )
        state_idx = (index[state_names[0]], index[state_names[1]])
    tokens = _Tokens(
        lines=[],
        dense=[],
        categorical=[],
        labels=None if label_idx is None else [],
        sequences={name: [] for name in sequence_idx},
        user_state=None if state_idx is None else ([], []),
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
        for name, i in sequence_idx.items():
            tokens.sequences[name].append(fields_[i])
        if tokens.user_state is not None and state_idx is not None:
            tokens.user_state[0].append(fields_[state_idx[0]])
            tokens.user_state[1].append(fields_[state_idx[1]])
    return tokens


def _read_tsv(lines: Iterable[str], spec: ModelSpec, max_rows: int | None) -> _Tokens:
    """Tokens of a headerless Criteo TSV file (39, 40, 41 or 42 columns)."""
    n_dense, n_cat = len(spec.numeric_columns), len(spec.categorical.columns)
    base = n_dense + n_cat
    extras = _sequence_columns(spec)
    layouts = {base: (False, False), base + 1: (True, False)}
    if extras:
        layouts |= {base + len(extras): (False, True), base + len(extras) + 1: (True, True)}
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
                sequences={name: [] for name in extras} if has_extras else {},
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
        for i, name in enumerate(tokens.sequences):
            tokens.sequences[name].append(parts[offset + base + i])
    if tokens is None:
        return _Tokens(lines=[], dense=[], categorical=[], labels=None, sequences={})
    return tokens


def _convert(tokens: _Tokens, spec: ModelSpec) -> Rows:
    """Turn string tokens into typed arrays, naming the line and column of the first bad field."""
    n = len(tokens.lines)
    lines = np.asarray(tokens.lines, dtype=np.int64)
    dense_cols = list(spec.numeric_columns)
    cat_cols = list(spec.categorical.columns)

    dense_text = text_array(tokens.dense, (n, len(dense_cols)))
    dense_missing = dense_text == ""
    dense = parse_numbers(np.where(dense_missing, "0", dense_text), lines, dense_cols)

    categorical = parse_categorical(tokens.categorical, spec, lines, cat_cols)

    targets = {t.name: _parse_target(tokens.sequences.get(t.name), t.name, lines) for t in spec.targets}
    histories = {q.name: parse_history(tokens.sequences.get(q.name), n, lines, q) for q in spec.sequences}
    target = next(iter(targets.values()), np.full(n, ABSENT_ITEM, dtype=np.int64))
    history, lengths = next(iter(histories.values()), (np.zeros((n, 1), np.int64), np.zeros(n, np.int32)))
    side = {name: values for name, values in list(targets.items())[1:]}
    for g, group in enumerate(spec.attention_groups):
        primary_ids, primary_lengths = histories[group.primary.name]
        if g > 0:
            side[group.primary.name], side[group.length_input] = primary_ids, primary_lengths
        for sequence in group.sequences[1:]:
            ids, own = histories[sequence.name]
            if tokens.sequences.get(sequence.name) is not None and (own != primary_lengths).any():
                r = int(np.flatnonzero(own != primary_lengths)[0])
                raise RowFormatError(
                    f"{int(own[r])} ids where {group.primary.name} has {int(primary_lengths[r])} "
                    "(shared positions)",
                    line=int(lines[r]),
                    column=sequence.name,
                )
            present = tokens.sequences.get(sequence.name) is not None
            side[sequence.name] = ids if present else np.zeros_like(primary_ids)

    labels = None
    if tokens.labels is not None:
        label_text = text_array(tokens.labels, (n, 1))
        labels = parse_floats(label_text, lines, [spec.inputs.label])[:, 0]

    rows = Rows(dense, dense_missing, categorical, target, history, lengths, labels, side)
    columns = user_state_columns(spec)
    if tokens.user_state is None or columns is None:
        return rows
    users, seq_fields = tokens.user_state
    for r, user in enumerate(users):
        try:
            user_key(user)
        except ValueError as exc:
            raise RowFormatError(str(exc), line=int(lines[r]), column=columns[0]) from None
    seqs = parse_ints(text_array(seq_fields, (n, 1)), lines, [columns[1]])[:, 0]
    bad = np.flatnonzero(seqs < lengths)
    if bad.size:
        r = int(bad[0])
        raise RowFormatError(
            f"{int(seqs[r])} is not >= the row's {int(lengths[r])} history events",
            line=int(lines[r]),
            column=columns[1],
        )
    return rows.with_user_state(spec, users, seqs)


def _parse_target(fields_: list[str] | None, name: str, lines: np.ndarray) -> np.ndarray:
    """Target ids ``[N]`` (-1 where empty or when the file has no such column)."""
    if fields_ is None:
        return np.full(len(lines), ABSENT_ITEM, dtype=np.int64)
    text = text_array(fields_, (len(lines), 1))
    target = parse_ints(np.where(text == "", str(ABSENT_ITEM), text), lines, [name])[:, 0]
    bad = target < ABSENT_ITEM
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise RowFormatError(
            f"{int(target[r])} is not an item id (ids are >= 0; leave the field empty when absent)",
            line=int(lines[r]),
            column=name,
        )
    return target


__all__ = [
    "LABEL_COLUMN",
    "Rows",
    "RowFormatError",
    "read_rows",
]
