"""L1: the direct-mapped cache of hot rows and the key frequencies that decide what it holds."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from recserve.backends.store import kernels
from recserve.backends.store.keyindex import GOLDEN
from recserve.backends.store.table_data import KERNELS

TRACKED_KEYS_PER_REFRESH = 1 << 18  # at most this many recent keys feed the frequency count
COUNT_DECAY = 0.5  # weight of older counts at each L1 rebuild
CLAIM_ROUNDS = 4  # an L1 rebuild passes a slot on this many times when its claimant is in no tier


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
    def claimants(cls, keys: np.ndarray, slots: int) -> np.ndarray:
        """Positions in ``keys`` (hottest first) of each slot's hottest claimant, in ``keys``' order."""
        first = np.full(slots, keys.size, np.intp)
        np.minimum.at(first, cls.slot_of(keys, slots), np.arange(keys.size))
        return np.sort(first[first < keys.size])

    @classmethod
    def placed(
        cls, slots: int, keys: np.ndarray, vectors: np.ndarray, base: HotCache | None = None
    ) -> HotCache:
        """A cache of ``keys`` (hottest first, at most one per slot).

        ``vectors``: every key's, in order; with ``base`` (a cache of as many slots, for the same
        rows), only those of the keys ``base`` does not hold: the others are copied from it. Empty
        slots hold a key that maps to another slot, so no lookup can match them.
        """
        slot_keys = np.zeros(slots, np.int64)
        home_of_zero = int(cls.slot_of(np.zeros(1, np.int64), slots)[0])
        slot_keys[home_of_zero] = next(
            k for k in range(1, 64) if cls.slot_of(np.array([k], np.int64), slots)[0] != home_of_zero
        )
        slot = cls.slot_of(keys, slots)
        slot_keys[slot] = keys
        if base is None:
            cached = np.zeros((slots, vectors.shape[1]), np.float32)
            cached[slot] = vectors
        else:
            cached = base.vectors.copy()
            cached[slot_keys != base.slot_keys] = 0.0
            cached[slot[base.slot_keys[slot] != keys]] = vectors
        return cls(slot_keys, cached, keys)

    @classmethod
    def claimed(
        cls,
        slots: int,
        keys: np.ndarray,
        dim: int,
        resolve: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
        known: HotCache | None = None,
    ) -> HotCache:
        """A cache where each slot holds its hottest claimant in ``keys`` (hottest first) that a tier holds.

        Only the claimants are resolved (``resolve``: their vectors and which a tier holds), and a
        key ``known`` holds is copied from it instead. A slot whose claimants are in no tier in
        :data:`CLAIM_ROUNDS` rounds stays empty.
        """
        held = known.holds(keys) if known is not None else np.zeros(keys.size, bool)
        found, asked, live = held.copy(), held.copy(), np.arange(keys.size)
        resolved, row = [np.zeros((0, dim), np.float32)], np.zeros(keys.size, np.intp)
        for _ in range(CLAIM_ROUNDS):
            chosen = live[cls.claimants(keys[live], slots)]
            todo = chosen[~asked[chosen]]
            if not todo.size:
                break
            vectors, found[todo] = resolve(keys[todo])
            row[todo] = sum(len(r) for r in resolved) + np.arange(todo.size)
            resolved.append(vectors)
            asked[todo] = True
            live = live[found[live] | ~asked[live]]  # a claimant no tier holds gives way to the next
        chosen = chosen[found[chosen]]
        new = chosen[~held[chosen]]
        return cls.placed(slots, keys[chosen], np.concatenate(resolved)[row[new]], known)

    def holds(self, keys: np.ndarray) -> np.ndarray:
        """Which of ``keys`` this cache holds."""
        return self.slot_keys[self.slot_of(keys, self.slot_keys.size)] == keys

    @property
    def nbytes(self) -> int:
        """Bytes of the cache."""
        return int(self.slot_keys.nbytes + self.vectors.nbytes + self.keys.nbytes)

    @cached_property
    def probe(self) -> kernels.CacheProbe | None:
        """The compiled probe of this cache (None without the kernels)."""
        return None if KERNELS is None else KERNELS.cache_probe(self.slot_keys, self.vectors)


class FrequencyTracker:
    """Counts recent keys for LFU admission; counts decay at each refresh.

    The counted keys are kept sorted, so a refresh sorts only the keys recorded since the last one
    and merges them in, instead of sorting every counted key again.
    """

    def __init__(self, budget: int, decay: float) -> None:
        self.budget = budget
        self.decay = decay
        self._recent: list[np.ndarray] = []
        self._seen = 0
        self._keys = np.empty(0, np.int64)  # sorted, distinct
        self._counts = np.empty(0, np.float64)  # each key's decayed count
        self._lock = threading.Lock()

    def record(self, keys: np.ndarray) -> None:
        """Remember a batch's keys (cheap: a reference, until the budget is used).

        An empty batch is not kept: a device tier given keys made on the device records only the
        keys it sends on to the host, often none.
        """
        if keys.size and self._seen < self.budget:
            with self._lock:
                self._recent.append(keys)
                self._seen += keys.size

    def seed(self, keys: np.ndarray) -> None:
        """Start from known hot keys (hottest first)."""
        keys = np.asarray(keys, np.int64)
        order = np.argsort(keys, kind="stable")
        with self._lock:
            self._keys = keys[order]
            self._counts = np.linspace(2.0, 1.0, num=len(keys))[order]

    def hottest(self, limit: int) -> np.ndarray:
        """Fold the recent keys into the decayed counts; the ``limit`` most frequent keys, hottest first.

        Twice ``limit`` keys are remembered for the next refresh; where counts tie at a cut, the
        lower keys stay.
        """
        with self._lock:
            recent, self._recent, self._seen = self._recent, [], 0
        keys, counts = self._keys, self._counts * self.decay
        if recent:
            keys, counts = _merged(keys, counts, np.sort(np.concatenate(recent).astype(np.int64, copy=False)))
        remembered, hot = _top(counts, (2 * limit, limit))
        hot = hot[np.argsort(-counts[hot])]
        self._keys, self._counts = keys[remembered], counts[remembered]
        return keys[hot]


def _merged(keys: np.ndarray, counts: np.ndarray, recent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct ``keys`` and ``counts`` (updated in place), plus one per sorted ``recent`` key."""
    starts = np.flatnonzero(np.concatenate(([True], recent[1:] != recent[:-1])))
    fresh = recent[starts]
    times = np.diff(np.append(starts, recent.size)).astype(np.float64)
    at = np.searchsorted(keys, fresh)
    known = at < keys.size
    known[known] = keys[at[known]] == fresh[known]
    counts[at[known]] += times[known]
    new = ~known
    return np.insert(keys, at[new], fresh[new]), np.insert(counts, at[new], times[new])


def _top(counts: np.ndarray, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """For each size, the positions of that many highest counts, ascending (ties at the cut: the first)."""
    cuts = [counts.size - size for size in sizes if 0 < size < counts.size]
    thresholds = iter(np.partition(counts, cuts)[cuts].tolist() if cuts else [])
    tops = []
    for size in sizes:
        if size <= 0 or size >= counts.size:
            tops.append(np.arange(counts.size if size > 0 else 0))
            continue
        cut = next(thresholds)
        above = np.flatnonzero(counts > cut)
        tied = np.flatnonzero(counts == cut)[: size - above.size]
        tops.append(np.sort(np.concatenate((above, tied))))
    return tops
