"""Embedding tables keyed by 64-bit feature keys, looked up in whole batches with numpy.

A table is a sorted ``int64`` key array, a ``[rows, dim]`` vector matrix and a default vector
(the trained out-of-vocabulary row) served for unknown keys. Lookups are ``searchsorted`` over the
whole batch: no per-key Python loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recserve.backends.artifacts import load_array, read_manifest
from recserve.backends.errors import ArtifactError
from recserve.spec import ModelSpec

LOGGER = logging.getLogger(__name__)

MANIFEST_FORMAT = "recserve-embeddings/1"


@dataclass
class TableStats:
    """Counters of one table."""

    lookups: int = 0
    unknown: int = 0


@dataclass
class EmbeddingTable:
    """One keyed table."""

    name: str
    keys: np.ndarray  # sorted int64 [rows]
    vectors: np.ndarray  # [rows + 1, dim]; the last row is the default vector
    version: int
    stats: TableStats = field(default_factory=TableStats)

    @property
    def dim(self) -> int:
        """Embedding width."""
        return int(self.vectors.shape[1])

    @property
    def bytes_per_key(self) -> float:
        """Resident bytes per stored key (key + vector)."""
        return (self.keys.nbytes + self.vectors.nbytes) / max(len(self.keys), 1)

    @classmethod
    def from_arrays(cls, name: str, keys: np.ndarray, vectors: np.ndarray, default: np.ndarray, version: int = 1) -> EmbeddingTable:
        """Build a table from unsorted keys, their vectors and the default vector."""
        keys = np.asarray(keys, dtype=np.int64)
        if len(np.unique(keys)) != len(keys):
            raise ArtifactError(f"table {name!r} has duplicate keys")
        order = np.argsort(keys, kind="stable")
        rows = np.concatenate([np.asarray(vectors)[order], np.asarray(default)[None, :]]).astype(np.float32)
        return cls(name, keys[order], rows, version)

    def rows_for(self, keys: np.ndarray) -> np.ndarray:
        """Row index of each key (the default row for unknown keys), any shape."""
        flat = keys.reshape(-1)
        pos = np.searchsorted(self.keys, flat)
        pos_clipped = np.minimum(pos, len(self.keys) - 1)
        found = self.keys[pos_clipped] == flat
        rows = np.where(found, pos_clipped, len(self.keys))
        self.stats.lookups += flat.size
        self.stats.unknown += int(flat.size - np.count_nonzero(found))
        return rows.reshape(keys.shape)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Vectors for ``keys`` of any shape: result shape is ``keys.shape + (dim,)``."""
        return self.vectors[self.rows_for(keys)]

    def lookup_pooled(self, keys: np.ndarray, mask: np.ndarray, mode: str) -> np.ndarray:
        """Sum- or mean-pool multi-valued features: ``keys``/``mask`` ``[rows, values]`` to ``[rows, dim]``."""
        vectors = self.lookup(keys) * mask[..., None]
        pooled = vectors.sum(axis=1)
        if mode == "mean":
            pooled /= np.maximum(mask.sum(axis=1, keepdims=True), 1.0)
        elif mode != "sum":
            raise ValueError(f"unknown pooling {mode!r}")
        return pooled.astype(np.float32)


class EmbeddingStore:
    """All tables of a model, loaded from a checked manifest."""

    def __init__(self, tables: dict[str, EmbeddingTable], version: int) -> None:
        self.tables = tables
        self.version = version

    @classmethod
    def load(cls, root: Path, spec: ModelSpec) -> EmbeddingStore:
        """Load and verify the tables under ``root`` (a model version directory) against ``spec``."""
        manifest = read_manifest(root)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ArtifactError(f"manifest format {manifest.get('format')!r} is not {MANIFEST_FORMAT!r}")
        tables: dict[str, EmbeddingTable] = {}
        for name, table_spec in spec.tables.items():
            entry = manifest["tables"].get(name)
            if entry is None:
                raise ArtifactError(f"table {name!r} of spec {spec.name!r} is not in the manifest")
            keys = load_array(root, entry["keys"])
            vectors = load_array(root, entry["vectors"])
            if vectors.shape != (len(keys) + 1, table_spec.dim):
                raise ArtifactError(
                    f"table {name!r} has vectors {list(vectors.shape)}, expected [{len(keys) + 1}, {table_spec.dim}]"
                )
            tables[name] = EmbeddingTable(name, keys, vectors, int(manifest["version"]))
        LOGGER.info("loaded %d tables, version %s", len(tables), manifest["version"])
        return cls(tables, int(manifest["version"]))
