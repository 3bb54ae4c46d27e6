"""Write raw rows as the input files :func:`recserve.clients.rows.read_rows` reads (TSV or CSV)."""

from __future__ import annotations

import csv
import gzip
import os
from pathlib import Path

import numpy as np

from recserve.core.names import USER_ID, USER_SEQ
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec
from recserve.core.values import ABSENT_ITEM


def numeric_text(values: np.ndarray) -> np.ndarray:
    """Numeric fields as text: integral values as integers, others as their shortest exact text.

    The shortest text that reads back as the same float32: ``8.3``, not ``8.30000019``.
    """
    real = (values != np.trunc(values)) | (np.abs(values) >= 2**53)
    text = np.char.mod("%d", np.where(real, 0, values).astype(np.int64)).astype(object)
    text[real] = [str(np.float32(v)) for v in values[real]]
    return text


def _text_columns(raw: Rows, spec: ModelSpec, with_label: bool) -> list[np.ndarray]:
    """String columns ``[N, K]`` in file order: label, dense, categorical, the histories, their targets."""
    dense = numeric_text(raw.dense)
    dense[raw.dense_missing] = ""
    categorical = np.vectorize(bytes.decode, otypes=[object])(raw.categorical)
    columns = [dense, categorical]
    for group in spec.attention_groups:
        lengths = raw.lengths_of(group.length_input)
        for sequence in group.sequences:
            ids = raw.sequence(sequence.name)
            separator = sequence.separator or " "
            texts = [separator.join(map(str, ids[r, : lengths[r]])) for r in range(len(raw))]
            columns.append(np.array(texts, dtype=object).reshape(-1, 1))
    for target in spec.target_names:
        values = raw.target_ids(target)
        text = np.char.mod("%d", values).astype(object).reshape(-1, 1)
        text[values == ABSENT_ITEM] = ""
        columns.append(text)
    if with_label:
        columns.insert(
            0, np.char.mod("%d", raw.label_values().astype(np.int64)).astype(object).reshape(-1, 1)
        )
    return columns


def write_tsv(
    path: str | os.PathLike[str],
    raw_rows: Rows,
    spec: ModelSpec,
    with_label: bool = True,
    with_sequence: bool = True,
) -> Path:
    """Write rows in the headerless Criteo TSV layout.

    Rows carrying users' real-time tails (:meth:`Rows.with_user_state`, for a spec with
    ``[user_state]`` on) get a header instead, naming their user and ``user_seq`` columns too.

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
    raw_rows: Rows,
    spec: ModelSpec,
    with_label: bool = True,
    with_sequence: bool = True,
) -> Path:
    """Write rows as CSV with a header row (history ids space-separated inside their field).

    Rows carrying users' real-time tails (:meth:`Rows.with_user_state`, for a spec with
    ``[user_state]`` on) get their user and ``user_seq`` columns too.

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
    raw_rows: Rows,
    spec: ModelSpec,
    with_label: bool,
    with_sequence: bool,
    delimiter: str,
    header: bool,
) -> Path:
    columns = _text_columns(raw_rows, spec, with_label)
    names = [*spec.numeric_columns, *spec.categorical.columns]
    if with_sequence:
        names += [f.name for f in spec.sequences] + list(spec.target_names)
    else:
        columns = columns[: 2 + int(with_label)]
    if with_label:
        names.insert(0, spec.inputs.label)
    state = raw_rows.user_state_wire(spec) if with_sequence else {}
    if state:  # the rows are users' real-time tails: their users and newest events' numbers
        header = True  # read back by name only
        user_column, seq_column = (spec.inputs.user or USER_ID), USER_SEQ
        for name, values in ((user_column, state[USER_ID]), (seq_column, state[USER_SEQ])):
            if name not in names:
                names.append(name)
                columns.append(np.char.mod("%d", values).astype(object))
    table = np.concatenate(columns, axis=1)
    out = Path(path)
    opener = gzip.open if out.suffix == ".gz" else open
    with opener(out, "wt", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh, delimiter=delimiter, lineterminator="\n")
        if header:
            writer.writerow(names)
        writer.writerows(table.tolist())
    return out
