"""Table data of the store in memory: tables as training writes them, L2 shards, delta row blocks.

Each structure that is probed for keys binds its compiled probe once (:mod:`.kernels`); without the
compiled loops the probe is ``None`` and the store takes its numpy path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from recserve.backends.store import kernels
from recserve.backends.store.keyindex import KeyIndex
from recserve.errors import ArtifactError

STORAGE_DTYPES = ("float32", "float16")
KERNELS = kernels.load()  # the compiled probe-and-gather loops; None: the numpy path


@dataclass(frozen=True)
class TableArrays:
    """One table as training or an import produces it: keys (any order), their vectors, the default.

    ``vectors`` may be memory-mapped and hold rows that no key describes (an imported vocabulary's
    padding and out-of-vocabulary rows): then ``rows`` lists, for each key, its row of ``vectors``.
    Readers take the keyed rows a block at a time (:meth:`block`), so a table is never copied whole.
    """

    name: str
    keys: np.ndarray  # int64 [rows]
    vectors: np.ndarray  # float32 (or float16) [rows, dim], or [any, dim] with ``rows``
    default: np.ndarray  # float32 [dim]
    rows: np.ndarray | None = None  # int64 [rows]: the row of ``vectors`` of each key; None: row i

    def __post_init__(self) -> None:
        if len(np.unique(self.keys)) != len(self.keys):
            raise ArtifactError(f"table {self.name!r} has duplicate keys")
        keyed = len(self.vectors) if self.rows is None else len(self.rows)
        if keyed != len(self.keys) or self.vectors.shape[1:] != self.default.shape:
            raise ArtifactError(
                f"table {self.name!r}: vectors {list(self.vectors.shape)} do not fit {len(self.keys)} keys"
            )

    def block(self, start: int, stop: int) -> np.ndarray:
        """The vectors of keys ``start..stop`` as float32."""
        source = self.vectors[start:stop] if self.rows is None else self.vectors[self.rows[start:stop]]
        return np.asarray(source, np.float32)


@dataclass(frozen=True)
class TableInfo:
    """Where a table lives: its shard and its rows there."""

    name: str
    table_id: int
    shard: int
    row_start: int
    row_end: int
    default_row: int


@dataclass(frozen=True)
class Shard:
    """L2: the rows of all tables of one storage dtype, with their key index (memory-mapped)."""

    dtype: str
    keys: np.ndarray  # int64 [rows]: the key of each row
    vectors: np.ndarray  # [rows + tables, dim]: rows, then one default row per table
    index: KeyIndex

    @property
    def nbytes(self) -> int:
        """Bytes of the shard's arrays (keys, vectors, index)."""
        return int(self.keys.nbytes + self.vectors.nbytes + self.index.nbytes)

    @cached_property
    def probe(self) -> kernels.IndexProbe | None:
        """The compiled probe of this shard (None without the kernels)."""
        return _index_probe(self.index, self.vectors)


@dataclass(frozen=True)
class RowBlock:
    """Rows held in private memory (the delta overlay): a key index and float32 vectors."""

    index: KeyIndex
    vectors: np.ndarray  # float32 [rows, dim]
    keys: np.ndarray  # int64 [rows]

    @classmethod
    def of(cls, keys: np.ndarray, vectors: np.ndarray) -> RowBlock:
        """Index ``keys`` (unique) over ``vectors``."""
        return cls(
            KeyIndex.build(keys), np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(keys, np.int64)
        )

    @cached_property
    def probe(self) -> kernels.IndexProbe | None:
        """The compiled probe of these rows (None without the kernels)."""
        return _index_probe(self.index, self.vectors)


def _index_probe(index: KeyIndex, vectors: np.ndarray) -> kernels.IndexProbe | None:
    return (
        None
        if KERNELS is None
        else KERNELS.index_probe(index.buckets, index.overflow_keys, index.overflow_rows, vectors)
    )
