"""A bucketed hash index from 64-bit keys to row numbers, built and probed with numpy.

Layout: ``buckets`` is an int64 matrix with one row per bucket (a power of two of them): ``BUCKET``
slot keys, then the ``BUCKET`` int32 row numbers of those slots packed in ``BUCKET // 2`` words
(``-1`` for an empty slot), 96 contiguous bytes. A key lives in the bucket given by the top bits of
``key * 0x9E3779B97F4A7C15`` (Fibonacci hashing). The few keys whose bucket is full go to a small
sorted overflow list. A lookup is one gather of each key's bucket row (keys and rows together, so
one random memory access per key), one compare, and a ``searchsorted`` in the overflow list for
keys whose bucket was full: whole arrays at a time, no loop per key or per probe step. The arrays
are plain ``.npy`` files, memory-mapped by every process serving the table, so model instances
share one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
EMPTY_ROW = -1
BUCKET = 8  # slots per bucket: 64 bytes of keys
MAX_LOAD = 0.6


def buckets_for(count: int, max_load: float = MAX_LOAD) -> int:
    """Power-of-two bucket count that keeps the slot load at or below ``max_load``."""
    return 1 << max(1, int(np.ceil(np.log2(max(count, 1) / (max_load * BUCKET)))))


@dataclass(frozen=True)
class KeyIndex:
    """Read-only key -> row index (see the module docstring for the layout)."""

    buckets: np.ndarray  # int64 [buckets, BUCKET + BUCKET // 2]: slot keys, then packed int32 rows
    overflow_keys: np.ndarray  # int64 [m], sorted
    overflow_rows: np.ndarray  # int32 [m]

    @property
    def slot_keys(self) -> np.ndarray:
        """Slot keys ``[buckets, BUCKET]`` (a view)."""
        return self.buckets[:, :BUCKET]

    @property
    def slot_rows(self) -> np.ndarray:
        """Slot rows ``[buckets, BUCKET]``, -1 where empty (a view)."""
        return self.buckets[:, BUCKET:].view(np.int32)

    @property
    def nbytes(self) -> int:
        """Bytes of all index arrays."""
        return int(sum(a.nbytes for a in (self.buckets, self.overflow_keys, self.overflow_rows)))

    def arrays(self) -> dict[str, np.ndarray]:
        """The index arrays by name (how they are saved)."""
        return {
            "buckets": self.buckets,
            "overflow_keys": self.overflow_keys,
            "overflow_rows": self.overflow_rows,
        }

    @staticmethod
    def bucket_of(keys: np.ndarray, buckets: int) -> np.ndarray:
        """Bucket number of each key."""
        shift = np.uint64(64 - (buckets.bit_length() - 1))
        return ((keys.view(np.uint64) * GOLDEN) >> shift).astype(np.int64)

    @classmethod
    def build(cls, keys: np.ndarray, rows: np.ndarray | None = None, buckets: int | None = None) -> KeyIndex:
        """Index ``keys`` (unique int64) to ``rows`` (default: their positions).

        Raises:
            ValueError: ``keys`` holds duplicates.
        """
        keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        rows = np.arange(len(keys), dtype=np.int32) if rows is None else np.asarray(rows, dtype=np.int32)
        buckets = buckets or buckets_for(len(keys))
        bucket = cls.bucket_of(keys, buckets)
        order = np.lexsort((keys, bucket))
        sorted_keys, sorted_bucket = keys[order], bucket[order]
        if np.any((sorted_keys[1:] == sorted_keys[:-1]) & (sorted_bucket[1:] == sorted_bucket[:-1])):
            raise ValueError("keys must be unique")
        first = np.searchsorted(sorted_bucket, sorted_bucket, side="left")
        rank = np.arange(len(keys)) - first  # position of each key inside its bucket
        fits = rank < BUCKET
        table = np.zeros((buckets, BUCKET + BUCKET // 2), np.int64)
        table[:, BUCKET:].view(np.int32)[:] = EMPTY_ROW
        table[:, :BUCKET][sorted_bucket[fits], rank[fits]] = sorted_keys[fits]
        table[:, BUCKET:].view(np.int32)[sorted_bucket[fits], rank[fits]] = rows[order[fits]]
        spill = order[~fits]
        spill = spill[np.argsort(keys[spill], kind="stable")]
        return cls(table, keys[spill], rows[spill])

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Row of each key, ``-1`` where the key is absent; same shape as ``keys``."""
        flat = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        gathered = self.buckets.take(self.bucket_of(flat, len(self.buckets)), axis=0)
        slot_keys, slot_rows = gathered[:, :BUCKET], gathered[:, BUCKET:].view(np.int32)
        # at most one slot of a bucket matches; empty slots hold row -1, so they add (row + 1) = 0
        result = ((slot_keys == flat[:, None]) * (slot_rows + 1)).sum(axis=1, dtype=np.int32) - 1
        if self.overflow_keys.size:
            spilled = np.flatnonzero((result == EMPTY_ROW) & (slot_rows[:, -1] != EMPTY_ROW))
            if spilled.size:
                pos = np.minimum(
                    np.searchsorted(self.overflow_keys, flat[spilled]), self.overflow_keys.size - 1
                )
                found = self.overflow_keys[pos] == flat[spilled]
                result[spilled[found]] = self.overflow_rows[pos[found]]
        return result.reshape(np.shape(keys))
