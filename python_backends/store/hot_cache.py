"""L1: the direct-mapped cache of hot rows and the key frequencies that decide what it holds."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from recserve.backends.store import kernels
from recserve.backends.store.keyindex import GOLDEN
from recserve.backends.store.rows import KERNELS

TRACKED_KEYS_PER_REFRESH = 1 << 18  # at most this many recent keys feed the frequency count
COUNT_DECAY = 0.5  # weight of older counts at each L1 rebuild


@dataclass(frozen=True)
class HotCache:
    """L1: a direct-mapped cache of hot rows in private memory.

    Each key has exactly one slot, ``(top 32 bits of key * 0x9E3779B97F4A7C15) * slots >> 32``; a
    slot holds one key and its float32 vector. A lookup is one gather of slot keys, one compare and
    one gather of vectors: no probing. Admission is by frequency: when two hot keys want the same
    slot, the more frequent one gets it.
    """

    slot_keys: np.ndarray  # int64 [slots]
    vectors: np.ndarray  # float32 [slots, dim]; zero in empty slots
    keys: np.ndarray  # int64: the cached keys, hottest first

    @staticmethod
    def slot_of(keys: np.ndarray, slots: int) -> np.ndarray:
        """Slot of each key."""
        high = (keys.view(np.uint64) * GOLDEN) >> np.uint64(32)
        return ((high * np.uint64(slots)) >> np.uint64(32)).astype(np.intp)

    @classmethod
    def of(cls, slots: int, keys: np.ndarray, vectors: np.ndarray) -> HotCache:
        """Place ``keys`` (hottest first) and their vectors; a slot keeps its hottest claimant.

        Empty slots hold a key that maps to another slot, so no lookup can match them.
        """
        slot = cls.slot_of(np.asarray(keys, np.int64), slots)
        _, first = np.unique(slot, return_index=True)
        first.sort()
        slot_keys = np.zeros(slots, np.int64)
        home_of_zero = int(cls.slot_of(np.zeros(1, np.int64), slots)[0])
        slot_keys[home_of_zero] = next(
            k for k in range(1, 64) if cls.slot_of(np.array([k], np.int64), slots)[0] != home_of_zero
        )
        cache = cls(slot_keys, np.zeros((slots, vectors.shape[1]), np.float32), keys[first])
        cache.slot_keys[slot[first]] = keys[first]
        cache.vectors[slot[first]] = vectors[first]
        return cache

    @property
    def nbytes(self) -> int:
        """Bytes of the cache."""
        return int(self.slot_keys.nbytes + self.vectors.nbytes + self.keys.nbytes)

    @cached_property
    def probe(self) -> kernels.CacheProbe | None:
        """The compiled probe of this cache (None without the kernels)."""
        return None if KERNELS is None else KERNELS.cache_probe(self.slot_keys, self.vectors)


class FrequencyTracker:
    """Counts recent keys for LFU admission; counts decay at each refresh."""

    def __init__(self, budget: int, decay: float) -> None:
        self.budget = budget
        self.decay = decay
        self._recent: list[np.ndarray] = []
        self._seen = 0
        self._keys = np.empty(0, np.int64)
        self._counts = np.empty(0, np.float64)
        self._lock = threading.Lock()

    def record(self, keys: np.ndarray) -> None:
        """Remember a batch's keys (cheap: a reference, until the budget is used)."""
        if self._seen < self.budget:
            with self._lock:
                self._recent.append(keys)
                self._seen += keys.size

    def seed(self, keys: np.ndarray) -> None:
        """Start from known hot keys (hottest first)."""
        with self._lock:
            self._keys = np.asarray(keys, np.int64)
            self._counts = np.linspace(2.0, 1.0, num=len(self._keys))

    def hottest(self, limit: int) -> np.ndarray:
        """Fold the recent keys into the decayed counts; the ``limit`` most frequent keys, hottest first."""
        with self._lock:
            recent, self._recent, self._seen = self._recent, [], 0
        keys = np.concatenate([self._keys, *recent]) if recent else self._keys
        weights = np.concatenate([self._counts * self.decay, *(np.ones(r.size) for r in recent)])
        unique, inverse = np.unique(keys, return_inverse=True)
        counts = np.bincount(inverse, weights=weights, minlength=len(unique))
        keep = min(limit * 2, len(unique))  # remember twice the cache's worth of candidates
        top = np.argpartition(-counts, keep - 1)[:keep] if keep < len(unique) else np.arange(len(unique))
        top = top[np.argsort(-counts[top], kind="stable")]
        self._keys, self._counts = unique[top], counts[top]
        return self._keys[:limit]
