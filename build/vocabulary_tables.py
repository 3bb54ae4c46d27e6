"""A table's vocabulary file (``<table>.vocab.json``): read, checked, its rows keyed as serving keys values.

``{"tokens": [...], "oov": i, "pad": j}``: ``tokens[r]`` is the raw value of row ``r`` as clients send it;
``oov`` (optional) is the row served for unknown values, ``pad`` (optional) a row never served.
Used by ``recserve import`` for a vocabulary table's vectors file and, with ``[model] lookups =
"in_model"``, for the tables an in-model network holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from recserve.backends.base.bounded_files import read_json
from recserve.backends.features.vocabulary import vocabulary_keys
from recserve.backends.store.table_data import TableArrays
from recserve.build.import_values import canonical_tokens, time_part_problem
from recserve.core.in_model import IN_MODEL
from recserve.core.spec.model import ModelSpec
from recserve.errors import ArtifactError, InvalidInput, shorten

if TYPE_CHECKING:
    from recserve.build.in_model_split import SplitModel

VOCAB_SUFFIX = ".vocab.json"
VOCAB_KEYS = frozenset({"tokens", "oov", "pad"})
#: A vocabulary file may hold this many bytes plus :data:`VOCAB_ROW_BYTES` per row of its vectors.
VOCAB_BASE_BYTES = 1 << 20
VOCAB_ROW_BYTES = 1024


class TableImportError(ArtifactError):
    """A table, vocabulary or dense model that cannot be imported; nothing was written."""


def read_vocabulary(table: str, path: Path, rows: int) -> tuple[list[object], int | None, int | None]:
    """``(tokens, oov, pad)`` of a table of ``rows`` rows, checked (the file's size bounded by the rows)."""
    doc = read_json(path, VOCAB_BASE_BYTES + rows * VOCAB_ROW_BYTES, f"table {table!r}: ")
    if not isinstance(doc, dict) or not isinstance(doc.get("tokens"), list):
        raise TableImportError(f'table {table!r}: {path.name} must be an object {{"tokens": [...], ...}}')
    extra = sorted(set(doc) - VOCAB_KEYS)
    if extra:
        raise TableImportError(
            f"table {table!r}: {path.name} has unknown keys {extra}; known: {sorted(VOCAB_KEYS)}"
        )
    tokens = doc["tokens"]
    odd = next(
        (i for i, t in enumerate(tokens) if not isinstance(t, str | int | None) or t is True or t is False),
        None,
    )
    if odd is not None:
        raise TableImportError(
            f"table {table!r}: token {odd} of {path.name} is {shorten(tokens[odd])}, "
            "not a string, integer or null"
        )
    if len(tokens) != rows:
        raise TableImportError(
            f"table {table!r}: the vocabulary has {len(tokens)} tokens, the vectors {rows} rows"
        )
    special = {}
    for name in ("oov", "pad"):
        value = doc.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < rows
        ):
            raise TableImportError(f"table {table!r}: {name} is {value!r}, expected a row in 0..{rows - 1}")
        special[name] = value
    if special["oov"] is not None and special["oov"] == special["pad"]:
        raise TableImportError(f"table {table!r}: oov and pad are the same row {special['oov']}")
    return tokens, special["oov"], special["pad"]


def vocabulary_table(spec: ModelSpec, table: str, vectors: np.ndarray, vocabulary: Path) -> TableArrays:
    """A table's rows ``[rows, dim]`` keyed by its vocabulary file, as serving keys the tokens."""
    dim = spec.tables[table].dim
    tokens, oov, pad = read_vocabulary(table, vocabulary, len(vectors))
    tokens = canonical_tokens(tokens)  # as serving reads the values clients send
    skip = [r for r in (oov, pad) if r is not None]
    problem = time_part_problem(spec, table, tokens, skip)
    if problem:
        raise TableImportError(f"table {table!r}, {vocabulary.name}: {problem}")
    rows = np.array([r for r in range(len(tokens)) if r not in (oov, pad)], np.int64)
    try:
        keys = vocabulary_keys(spec, table, tokens, skip=skip)
    except InvalidInput as exc:
        raise TableImportError(f"table {table!r}, {vocabulary.name}: {exc.detail}") from None
    unique, first, counts = np.unique(keys, return_index=True, return_counts=True)
    if len(unique) != len(keys):
        again = int(np.flatnonzero(keys == unique[np.argmax(counts > 1)])[1])
        same = int(first[np.argmax(counts > 1)])
        raise TableImportError(
            f"table {table!r}: tokens {shorten(tokens[rows[same]])} (row {rows[same]}) and "
            f"{shorten(tokens[rows[again]])} "
            f"(row {rows[again]}) are the same value; each value needs one row"
        )
    default = np.zeros(dim, np.float32) if oov is None else np.asarray(vectors[oov], np.float32)
    return TableArrays(table, keys, vectors, default, rows)


def read_in_model_tables(
    spec: ModelSpec, folder: Path, split: SplitModel
) -> tuple[dict[str, TableArrays], dict[str, str]]:
    """Every table of an in-model network: its rows from the graph, its keys from ``<table>.vocab.json``."""
    if not folder.is_dir():
        raise TableImportError(f"tables folder {folder} does not exist")
    others = sorted(p.name for p in folder.iterdir() if not p.name.endswith(VOCAB_SUFFIX))
    if others:
        raise TableImportError(
            f'{folder} holds {shorten(others)}; with [model] lookups = "{IN_MODEL}" the tables are the '
            f"model's own weights and the folder holds one <table>{VOCAB_SUFFIX} per table"
        )
    tables = {}
    for table in spec.table_names:
        vocabulary = folder / f"{table}{VOCAB_SUFFIX}"
        if not vocabulary.is_file():
            raise TableImportError(f"table {table!r}: no {vocabulary.name} in {folder}")
        tables[table] = vocabulary_table(spec, table, split.tables[table], vocabulary)
    for feature, named in split.shared.items():  # one row input, several tables: one vocabulary
        vocabularies = [
            read_vocabulary(t, folder / f"{t}{VOCAB_SUFFIX}", len(split.tables[t])) for t in named
        ]
        if any(v != vocabularies[0] for v in vocabularies):
            raise TableImportError(
                f"feature {feature!r} feeds tables {list(named)} through one row input: their "
                f"vocabularies must be the same, row for row (they differ)"
            )
    return tables, dict.fromkeys(tables, f"vocabulary ({IN_MODEL})")
