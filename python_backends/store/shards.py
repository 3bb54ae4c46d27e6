"""L2 on disk: tables grouped into one shard per storage dtype and width, written as ``.npy`` and mapped back.

A shard holds the rows of all its tables (then one default row per table) under one hash index, so
one probe serves the keys of every feature stored in that dtype and width. The manifest lists every file with
its SHA-256; mapping verifies them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from recserve.backends.base.artifacts import (
    MAX_EMBEDDING_VALUE,
    file_entry,
    load_array,
    read_manifest,
    save_array,
)
from recserve.backends.store.keyindex import KeyIndex
from recserve.backends.store.table_data import STORAGE_DTYPES, Shard, TableArrays, TableInfo
from recserve.errors import ArtifactError

LOGGER = logging.getLogger(__name__)

MANIFEST_FORMAT = "recserve-embeddings/3"
INDEX_ARRAYS = ("buckets", "overflow_keys", "overflow_rows")


def plan_shards(
    tables: Mapping[str, TableArrays], dtypes: Mapping[str, str]
) -> tuple[list[TableInfo], list[tuple[str, list[str]]]]:
    """Group tables into one shard per storage dtype and width: rows of each table, then their defaults.

    Returns:
        Each table's place, and per shard its dtype and member tables in row order.
    """
    names = sorted(tables)
    by_kind: dict[tuple[str, int], list[str]] = {}
    for name in names:
        dtype = dtypes.get(name, "float32")
        if dtype not in STORAGE_DTYPES:
            raise ArtifactError(f"table {name!r}: storage dtype {dtype!r} is not one of {STORAGE_DTYPES}")
        by_kind.setdefault((dtype, int(tables[name].default.shape[0])), []).append(name)
    infos, plan = [], []
    for shard_number, ((dtype, _), members) in enumerate(sorted(by_kind.items())):
        start, starts = 0, {}
        for name in members:
            starts[name] = start
            start += len(tables[name].keys)
        for offset, name in enumerate(members):
            rows = len(tables[name].keys)
            infos.append(
                TableInfo(
                    name, names.index(name), shard_number, starts[name], starts[name] + rows, start + offset
                )
            )
        plan.append((dtype, members))
    return infos, plan


def shard_index(tables: Mapping[str, TableArrays], members: list[str]) -> tuple[np.ndarray, KeyIndex]:
    """The keys of a shard's rows (members in order) and their hash index."""
    keys = np.concatenate([tables[n].keys for n in members]).astype(np.int64)
    try:
        return keys, KeyIndex.build(keys)
    except ValueError:
        raise ArtifactError(f"tables {members} share a key; keys must be unique across tables") from None


def layout_shards(
    tables: Mapping[str, TableArrays], dtypes: Mapping[str, str]
) -> tuple[list[TableInfo], list[Shard]]:
    """The shards of :func:`plan_shards` in memory."""
    infos, plan = plan_shards(tables, dtypes)
    shards = []
    for dtype, members in plan:
        keys, index = shard_index(tables, members)
        vectors = np.concatenate(
            [*(tables[n].block(0, len(tables[n].keys)) for n in members)]
            + [tables[n].default[None, :] for n in members]
        ).astype(dtype)
        shards.append(Shard(dtype, keys, vectors, index))
    return infos, shards


#: Rows copied at a time when a shard's vectors are written (bounded memory for any table size).
COPY_ROWS = 1 << 16


def write_vectors(
    path: Path, tables: Mapping[str, TableArrays], members: list[str], dtype: str
) -> np.ndarray:
    """Write a shard's vectors to ``path`` (``.npy``) a block of rows at a time; refuse unservable values.

    The sources may be memory-mapped: no table is ever held whole in memory.

    Raises:
        ArtifactError: a vector holds NaN, Inf or a value over
            :data:`~recserve.backends.base.artifacts.MAX_EMBEDDING_VALUE` in magnitude (named by
            table and row): what L3 would refuse when read back from Redis.
    """
    rows = sum(len(tables[n].keys) for n in members) + len(members)
    dim = tables[members[0]].default.shape[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(rows, dim))
    position = 0
    for name in members:
        table = tables[name]
        for start in range(0, len(table.keys), COPY_ROWS):
            block = table.block(start, start + COPY_ROWS)
            _refuse_non_finite(table, block, start)
            out[position : position + len(block)] = block
            position += len(block)
    for name in members:
        _refuse_non_finite(tables[name], tables[name].default[None, :], None)
        out[position] = tables[name].default
        position += 1
    out.flush()
    return out


def _refuse_non_finite(table: TableArrays, block: np.ndarray, start: int | None) -> None:
    """Raise naming the first row of ``block`` (keys from ``start``; None: the default) not servable."""
    bad = ~(np.abs(block) <= MAX_EMBEDDING_VALUE).all(axis=1)  # NaN compares False
    if bad.any():
        if start is None:
            where = "the default row"
        else:
            key = start + int(np.flatnonzero(bad)[0])
            where = f"row {key if table.rows is None else int(table.rows[key])}"
        raise ArtifactError(
            f"table {table.name!r}: {where} holds NaN or Inf, or a value over {MAX_EMBEDDING_VALUE:g} "
            "in magnitude"
        )


def write_shards(root: Path, tables: Mapping[str, TableArrays], dtypes: Mapping[str, str]) -> dict:
    """Write the shards as ``.npy`` files under ``root``; the manifest's ``shards``/``tables`` entries."""
    infos, plan = plan_shards(tables, dtypes)
    shard_entries = []
    for number, (dtype, members) in enumerate(plan):
        prefix = f"shards/{number}-{dtype}"
        keys, index = shard_index(tables, members)
        vectors = write_vectors(root / f"{prefix}.vectors.npy", tables, members, dtype)
        shard_entries.append(
            {
                "dtype": dtype,
                "keys": save_array(root, f"{prefix}.keys.npy", keys),
                "vectors": {
                    **file_entry(root, root / f"{prefix}.vectors.npy"),
                    "shape": list(vectors.shape),
                    "dtype": dtype,
                },
                **{
                    name: save_array(root, f"{prefix}.{name}.npy", array)
                    for name, array in index.arrays().items()
                },
            }
        )
        del vectors
    dims = {name: int(table.default.shape[0]) for name, table in tables.items()}
    table_entries = {
        t.name: {
            "table_id": t.table_id,
            "shard": t.shard,
            "row_start": t.row_start,
            "row_end": t.row_end,
            "default_row": t.default_row,
            "rows": t.row_end - t.row_start,
            "dim": dims[t.name],
            "dtype": plan[t.shard][0],
        }
        for t in infos
    }
    return {"shards": shard_entries, "tables": table_entries}


def map_shards(root: Path, dims: Mapping[str, int]) -> tuple[list[TableInfo], list[Shard], int]:
    """Memory-map and verify the shards under ``root``; ``dims`` names the expected tables.

    Returns:
        The tables' places, the shards and the base version of the manifest.
    """
    manifest = read_manifest(root)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ArtifactError(
            f"manifest format {manifest.get('format')!r} is not {MANIFEST_FORMAT!r}; "
            "rebuild with 'recserve build'"
        )
    shards = []
    for entry in manifest["shards"]:
        vectors = load_array(root, entry["vectors"], mmap=True)
        index = KeyIndex(**{name: load_array(root, entry[name], mmap=True) for name in INDEX_ARRAYS})
        shards.append(Shard(entry["dtype"], load_array(root, entry["keys"], mmap=True), vectors, index))
    infos = []
    for name, dim in dims.items():
        entry = manifest["tables"].get(name)
        if entry is None:
            raise ArtifactError(f"table {name!r} is not in the manifest")
        if int(entry["dim"]) != dim:
            raise ArtifactError(f"table {name!r} has dim {entry['dim']}, the spec says {dim}")
        infos.append(
            TableInfo(
                name,
                int(entry["table_id"]),
                int(entry["shard"]),
                int(entry["row_start"]),
                int(entry["row_end"]),
                int(entry["default_row"]),
            )
        )
    LOGGER.info("mapped %d tables in %d shards, version %s", len(infos), len(shards), manifest["version"])
    return infos, shards, int(manifest["version"])
