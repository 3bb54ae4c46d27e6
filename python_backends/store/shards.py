"""L2 on disk: tables grouped into one shard per storage dtype, written as ``.npy`` and mapped back.

A shard holds the rows of all its tables (then one default row per table) under one hash index, so
one probe serves the keys of every feature stored in that dtype. The manifest lists every file with
its SHA-256; mapping verifies them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from recserve.backends.artifacts import load_array, read_manifest, save_array
from recserve.backends.store.keyindex import KeyIndex
from recserve.backends.store.rows import STORAGE_DTYPES, Shard, TableArrays, TableInfo
from recserve.errors import ArtifactError

LOGGER = logging.getLogger(__name__)

MANIFEST_FORMAT = "recserve-embeddings/3"
INDEX_ARRAYS = ("buckets", "overflow_keys", "overflow_rows")


def layout_shards(
    tables: Mapping[str, TableArrays], dtypes: Mapping[str, str]
) -> tuple[list[TableInfo], list[Shard]]:
    """Group tables into one shard per storage dtype: rows of each table, then their default rows."""
    dims = {t.default.shape[0] for t in tables.values()}
    if len(dims) != 1:
        raise ArtifactError(f"every table needs the same embedding width, got {sorted(dims)}")
    names = sorted(tables)
    by_dtype: dict[str, list[str]] = {}
    for name in names:
        dtype = dtypes.get(name, "float32")
        if dtype not in STORAGE_DTYPES:
            raise ArtifactError(f"table {name!r}: storage dtype {dtype!r} is not one of {STORAGE_DTYPES}")
        by_dtype.setdefault(dtype, []).append(name)
    infos, shards = [], []
    for shard_number, (dtype, members) in enumerate(sorted(by_dtype.items())):
        start, starts = 0, {}
        for name in members:
            starts[name] = start
            start += len(tables[name].keys)
        keys = np.concatenate([tables[n].keys for n in members]).astype(np.int64)
        try:
            index = KeyIndex.build(keys)
        except ValueError:
            raise ArtifactError(f"tables {members} share a key; keys must be unique across tables") from None
        vectors = np.concatenate(
            [*(tables[n].vectors for n in members), *(tables[n].default[None, :] for n in members)]
        ).astype(dtype)
        shards.append(Shard(dtype, keys, vectors, index))
        for offset, name in enumerate(members):
            rows = len(tables[name].keys)
            infos.append(
                TableInfo(
                    name, names.index(name), shard_number, starts[name], starts[name] + rows, start + offset
                )
            )
    return infos, shards


def write_shards(root: Path, tables: Mapping[str, TableArrays], dtypes: Mapping[str, str]) -> dict:
    """Write the shards as ``.npy`` files under ``root``; the manifest's ``shards``/``tables`` entries."""
    infos, shards = layout_shards(tables, dtypes)
    shard_entries = []
    for number, shard in enumerate(shards):
        prefix = f"shards/{number}-{shard.dtype}"
        shard_entries.append(
            {
                "dtype": shard.dtype,
                "keys": save_array(root, f"{prefix}.keys.npy", shard.keys),
                "vectors": save_array(root, f"{prefix}.vectors.npy", shard.vectors),
                **{
                    name: save_array(root, f"{prefix}.{name}.npy", array)
                    for name, array in shard.index.arrays().items()
                },
            }
        )
    table_entries = {
        t.name: {
            "table_id": t.table_id,
            "shard": t.shard,
            "row_start": t.row_start,
            "row_end": t.row_end,
            "default_row": t.default_row,
            "rows": t.row_end - t.row_start,
            "dim": int(shards[t.shard].vectors.shape[1]),
            "dtype": shards[t.shard].dtype,
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
