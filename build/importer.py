"""``recserve import``: a servable repository from trained tables and a dense ONNX, with no training.

One file (or folder) per table of the spec in the tables folder, in one of three formats:

* **vocabulary** (what open model zoos produce): ``<table>.npy`` or ``<table>.safetensors``
  (tensor ``vectors``) with rows ``[rows, dim]`` float32 or float16, plus ``<table>.vocab.json``
  ``{"tokens": [...], "oov": i, "pad": j}``: ``tokens[r]`` is the raw value of row ``r`` as clients
  send it, keyed exactly as serving keys it; ``oov`` (optional) is the row served for unknown
  values, ``pad`` (optional) a row never served; their tokens are ignored (``null`` is fine).
* **keyed**: ``<table>.safetensors`` or ``<table>.npz`` with ``keys`` int64 ``[N]`` and
  ``vectors`` ``[N, dim]`` (recserve's 64-bit keys), optionally ``default`` ``[dim]``: the layout
  and checks of ``recserve update`` deltas.
* **HugeCTR/HPS sparse model**: a folder ``<table>/`` with ``key`` (raw int64) and
  ``emb_vector`` (raw float32, ``N * dim``), optionally ``default`` (raw float32, ``dim``).

A table without an out-of-vocabulary row is served zeros for unknown values (as HPS serves its
default value). Vectors are memory-mapped and copied into the shards a block at a time, so a large
table is never held twice. Everything is written into a staging folder beside the repository and
moved into place at the end: the repository appears whole, or not at all.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recserve.backends.base.artifacts import map_safetensors
from recserve.backends.base.bounded_files import Header, check_onnx_file, load_npz, map_npy
from recserve.backends.dense.compatibility import check_onnx_contract
from recserve.backends.store.table_data import TableArrays
from recserve.backends.store.updates.deltas import little_endian
from recserve.backends.store.updates.versions import check_delta
from recserve.build import configs
from recserve.build.import_values import (
    report_rounding,
    with_imported_cardinalities,
)
from recserve.build.progress import Progress, stderr_progress
from recserve.build.vocabulary_tables import (
    VOCAB_SUFFIX,
    TableImportError,
    read_in_model_tables,
    vocabulary_table,
)
from recserve.core.in_model import IN_MODEL
from recserve.core.names import DENSE, EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.errors import ArtifactError, shorten

VECTOR_SUFFIXES = (".npy", ".safetensors")
KEYED_SUFFIXES = (".safetensors", ".npz")
HUGECTR_FILES = ("key", "emb_vector")
STORED_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class TableSource:
    """Where one table's trained rows are, and in which format (``vocabulary``, ``keyed``, ``hugectr``)."""

    table: str
    format: str
    path: Path  # the vectors file, the keyed file, or the HugeCTR folder
    vocabulary: Path | None = None


@dataclass(frozen=True)
class ImportReport:
    """What an import wrote and how fast."""

    repository: Path
    rows: dict[str, int]  # keyed rows per table
    formats: dict[str, str]
    seconds: float
    rounded: dict[str, float] = field(default_factory=dict)  # float16 tables: largest |change| of a weight

    @property
    def rows_per_second(self) -> float:
        """Imported table rows per second of the whole import."""
        return sum(self.rows.values()) / max(self.seconds, 1e-9)


def find_table_sources(spec: ModelSpec, folder: Path) -> dict[str, TableSource]:
    """One source per table of the spec in ``folder``; refuses unknown, missing and doubled tables."""
    if not folder.is_dir():
        raise TableImportError(f"tables folder {folder} does not exist")
    found: dict[str, list[TableSource]] = {}
    vocabularies = {p.name[: -len(VOCAB_SUFFIX)]: p for p in folder.glob(f"*{VOCAB_SUFFIX}")}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.name.endswith(VOCAB_SUFFIX):
            continue
        if path.is_dir():
            source = TableSource(path.name, "hugectr", path)
        elif not path.is_file():
            raise TableImportError(f"{shorten(path.name)} is not a regular file or a folder")
        elif path.stem in vocabularies and path.suffix in VECTOR_SUFFIXES:
            source = TableSource(path.stem, "vocabulary", path, vocabularies[path.stem])
        elif path.suffix in KEYED_SUFFIXES:
            source = TableSource(path.stem, "keyed", path)
        else:
            raise TableImportError(
                f"{path.name}: not a table file (use <table>.npy or .safetensors with <table>{VOCAB_SUFFIX}, "
                "<table>.safetensors or .npz with keys, or a HugeCTR folder <table>/)"
            )
        found.setdefault(source.table, []).append(source)
    for table, path in vocabularies.items():
        if table not in found:
            raise TableImportError(
                f"table {table!r}: {path.name} has no vectors file ({table}.npy or .safetensors)"
            )
    unknown = sorted(set(found) - set(spec.table_names))
    if unknown:
        raise TableImportError(
            f"unknown table(s) {unknown} in {folder}; "
            f"the tables of spec {spec.name!r} are {list(spec.table_names)}"
        )
    missing = [t for t in spec.table_names if t not in found]
    if missing:
        raise TableImportError(f"missing table(s) {missing} in {folder}")
    doubled = {t: [s.path.name for s in sources] for t, sources in found.items() if len(sources) > 1}
    if doubled:
        raise TableImportError(f"more than one file for a table: {doubled}")
    return {t: found[t][0] for t in spec.table_names}


def _vectors(table: str, path: Path, dim: int) -> np.ndarray:
    """The memory-mapped ``[rows, dim]`` float32/float16 vectors of a ``.npy`` or ``.safetensors`` file."""
    if path.suffix == ".npy":
        vectors = map_npy(path)
    else:
        arrays = map_safetensors(path)
        if "vectors" not in arrays:
            raise TableImportError(
                f"table {table!r}: {path.name} has no tensor 'vectors' (has {sorted(arrays)})"
            )
        vectors = arrays["vectors"]
    if vectors.dtype.name not in STORED_DTYPES:
        raise TableImportError(f"table {table!r}: vectors are {vectors.dtype}, expected float32 or float16")
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise TableImportError(
            f"table {table!r}: vectors are {list(vectors.shape)}, expected [rows, {dim}] (the spec's dim)"
        )
    return vectors


def read_vocabulary_table(spec: ModelSpec, source: TableSource) -> TableArrays:
    """Format (a): a row matrix plus its vocabulary, keyed as serving keys the tokens."""
    assert source.vocabulary is not None
    vectors = _vectors(source.table, source.path, spec.tables[source.table].dim)
    return vocabulary_table(spec, source.table, vectors, source.vocabulary)


def read_keyed_table(spec: ModelSpec, source: TableSource) -> TableArrays:
    """Format (b): ``keys``, ``vectors`` and optionally ``default``, as ``recserve update`` reads deltas."""
    table, dim = source.table, spec.tables[source.table].dim
    if source.path.suffix == ".npz":
        arrays = load_npz(source.path, lambda headers: _check_keyed_headers(table, source.path, headers, dim))
    else:
        arrays = map_safetensors(source.path)
    missing = {"keys", "vectors"} - set(arrays)
    if missing:
        raise TableImportError(
            f"table {table!r}: {source.path.name} has no array(s) {sorted(missing)}; "
            "it needs 'keys' and 'vectors'"
        )
    keys, vectors = arrays["keys"], little_endian(arrays["vectors"])  # the delta check takes little-endian
    check_delta(table, keys, vectors, dim, STORED_DTYPES, what="table")
    default = np.asarray(arrays.get("default", np.zeros(dim, np.float32)), np.float32)
    if default.shape != (dim,):
        raise TableImportError(f"table {table!r}: default is {list(default.shape)}, expected [{dim}]")
    return TableArrays(table, np.asarray(keys), vectors, default)


def _check_keyed_headers(table: str, path: Path, headers: dict[str, Header], dim: int) -> None:
    """Refuse an ``.npz`` keyed table whose arrays do not fit the spec, before any is inflated."""
    wanted = {
        "keys": ("int64[rows]", lambda s, d: len(s) == 1 and d == np.int64),
        "vectors": (
            f"float32 or float16 [rows, {dim}]",
            lambda s, d: s[1:] == (dim,) and d.name in STORED_DTYPES,
        ),
        "default": (f"[{dim}]", lambda s, d: s == (dim,) and d.kind == "f"),
    }
    for name, (shape, dtype) in headers.items():
        if name not in wanted:
            raise TableImportError(
                f"table {table!r}: {path.name} holds an array {shorten(name)}; "
                f"a keyed table holds {sorted(wanted)}"
            )
        expected, fits = wanted[name]
        if not fits(shape, dtype):
            raise TableImportError(
                f"table {table!r}: {path.name}: {name} is {dtype}{shorten(list(shape))}, expected {expected} "
                "(refused before inflating)"
            )
    rows = {name: headers[name][0][0] for name in ("keys", "vectors") if name in headers}
    if len(set(rows.values())) > 1:
        raise TableImportError(
            f"table {table!r}: {path.name} has {rows['keys']} keys and {rows['vectors']} vectors "
            "(refused before inflating)"
        )


def read_hugectr_table(spec: ModelSpec, source: TableSource) -> TableArrays:
    """Format (c): a HugeCTR/HPS sparse-model folder (``key`` int64, ``emb_vector`` float32, raw)."""
    table, dim, folder = source.table, spec.tables[source.table].dim, source.path
    for name in HUGECTR_FILES:
        if not (folder / name).is_file():
            raise TableImportError(f"table {table!r}: the HugeCTR folder {folder.name}/ has no file {name!r}")
    key_bytes, vector_bytes = (folder / "key").stat().st_size, (folder / "emb_vector").stat().st_size
    if key_bytes % 8:
        raise TableImportError(
            f"table {table!r}: {folder.name}/key has {key_bytes} bytes, not whole int64 keys"
        )
    rows = key_bytes // 8
    if vector_bytes != rows * dim * 4:
        raise TableImportError(
            f"table {table!r}: {folder.name}/emb_vector has {vector_bytes} bytes; {rows} keys of dim {dim} "
            f"need {rows * dim * 4} (float32)"
        )
    if rows == 0:
        raise TableImportError(f"table {table!r}: {folder.name}/ holds no rows")
    keys = np.fromfile(folder / "key", dtype="<i8")
    vectors = np.memmap(folder / "emb_vector", dtype="<f4", mode="r", shape=(rows, dim))
    if len(np.unique(keys)) != rows:
        raise TableImportError(f"table {table!r}: {folder.name}/key repeats keys")
    default = np.zeros(dim, np.float32)
    if (folder / "default").is_file():
        default_bytes = (folder / "default").stat().st_size
        if default_bytes != dim * 4:  # checked before reading: the file may be of any size
            raise TableImportError(
                f"table {table!r}: {folder.name}/default has {default_bytes:,} bytes, not {dim} float32s"
            )
        default = np.fromfile(folder / "default", dtype="<f4")
    return TableArrays(table, keys.astype(np.int64), vectors, default)


READERS = {"vocabulary": read_vocabulary_table, "keyed": read_keyed_table, "hugectr": read_hugectr_table}


def read_tables(spec: ModelSpec, folder: Path) -> tuple[dict[str, TableArrays], dict[str, str]]:
    """Every table of the spec from ``folder``, checked; and the format each was read in."""
    sources = find_table_sources(spec, folder)
    tables = {}
    for name, source in sources.items():
        try:
            tables[name] = READERS[source.format](spec, source)
        except TableImportError:
            raise
        except ArtifactError as exc:  # the delta checks and array readers name the file, not always the table
            message = str(exc)
            raise TableImportError(
                message if repr(name) in message else f"table {name!r}: {message}"
            ) from None
    return tables, {name: s.format for name, s in sources.items()}


def import_repository(
    spec: ModelSpec,
    tables_dir: Path,
    dense: Path,
    repository: Path,
    progress: Progress = stderr_progress,
    replace: bool = False,
) -> ImportReport:
    """Write a complete, servable repository of ``spec`` from trained tables and a dense ONNX.

    Raises:
        ArtifactError: naming the table (TableImportError), the dense model or the file, and the problem;
            nothing was written.
    """
    started = time.perf_counter()
    if repository.exists() and any(repository.iterdir()) and not replace:
        raise TableImportError(f"{repository} exists and is not empty; pass --replace to overwrite it")
    if not dense.is_file():
        raise TableImportError(f"dense model {dense} does not exist")
    check_onnx_file(dense)
    split = None
    if spec.model.lookups == IN_MODEL:  # the user's network as written: split at its lookups
        from recserve.build.in_model_split import check_split, split_at_lookups  # torch

        split = split_at_lookups(spec, dense)
        tables, formats = read_in_model_tables(spec, tables_dir, split)
        check_split(spec, dense, split, progress)
    else:
        check_onnx_contract(spec, dense)
        tables, formats = read_tables(spec, tables_dir)
    rows = {name: len(t.keys) for name, t in tables.items()}
    spec = with_imported_cardinalities(spec, rows)
    rounded = report_rounding(spec, tables, progress)
    # torch comes with the writers: an import refused above answered before it loaded
    from recserve.build.imported_dense import write_imported_dense
    from recserve.build.repository import install_adapters, version_dir, write_tables

    staging = repository.parent / f".{repository.name}.import-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        progress(f"[import] writing {len(tables)} tables ({sum(rows.values())} rows) to {staging}")
        write_tables(spec, tables, version_dir(staging, EMBEDDING_LOOKUP, spec))
        progress(f"[import] checking {dense.name} at every sequence bucket")
        served = dense
        if split is not None:
            served = staging / f"{dense.stem}.split.onnx"
            served.write_bytes(split.model)
        write_imported_dense(spec, served, version_dir(staging, DENSE, spec), original=dense)
        if split is not None:
            served.unlink()
        install_adapters(spec, staging)
        configs.write_configs(spec, staging)
        _move_into_place(staging, repository)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report = ImportReport(repository, rows, formats, time.perf_counter() - started, rounded)
    progress(
        f"[import] repository ready: {repository} ({sum(rows.values())} rows in {report.seconds:.1f} s, "
        f"{report.rows_per_second:,.0f} rows/s)"
    )
    return report


def _move_into_place(staging: Path, repository: Path) -> None:
    """Replace ``repository`` by ``staging`` with renames (the old one is removed only after)."""
    old = repository.parent / f".{repository.name}.replaced-{os.getpid()}"
    if repository.exists():
        repository.rename(old)
    staging.rename(repository)
    shutil.rmtree(old, ignore_errors=True)
