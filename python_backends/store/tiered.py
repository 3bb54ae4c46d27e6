"""The sparse parameter store: tiered, keyed embedding lookup over whole batches.

Tiers, tried in order for every key of a batch at once (no per-key Python loop anywhere)::

    L1     hot-row cache, bounded in bytes, rebuilt from the most frequent recent keys (LFU with
           periodic batch admission); also preloaded at start-up from the recorded hot keys
    delta  rows of online updates published after the base version (``recserve update``)
    L2     the full local table: memory-mapped shard files (keys, vectors, hash index) that every
           model instance on the machine shares through the page cache
    L3     optional remote tier (Redis Cluster) behind a deadline and a circuit breaker
    default  the table's trained out-of-vocabulary row

Every table has its own width (``[tables.NAME] dim``, else the model's ``embedding_dim``). Rows are
grouped into one *shard* per storage dtype and width (:mod:`.shards`); the L1 cache is in
:mod:`.hot_cache`. A lookup returns every vector at the widest table's width
(:attr:`TieredStore.dim`), a narrower table's zero-padded to it. A lookup reads the current
:class:`Snapshot` once and uses only it: an update builds a new snapshot and swaps one reference,
so a batch sees a whole version of every table or none of it. The tiers' names, the snapshot, a
lookup's result and the L3 tier's protocol are in :mod:`.tiers` (re-exported here).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from recserve.backends.store.hot_cache import (
    COUNT_DECAY,
    TRACKED_KEYS_PER_REFRESH,
    FrequencyTracker,
    HotCache,
)
from recserve.backends.store.shards import layout_shards, map_shards
from recserve.backends.store.table_data import KERNELS, RowBlock, Shard, TableArrays, TableInfo
from recserve.backends.store.tiers import (  # the tiers' names and types stay importable from here
    DEFAULT,
    DELTA,
    DEVICE,
    L1,
    L2,
    L3,
    TIERS,
    Lookup,
    RemoteTier,
    Snapshot,
    StoreStats,
)
from recserve.core.sections.serving import StoreSection
from recserve.core.spec.model import ModelSpec

LOGGER = logging.getLogger(__name__)

__all__ = [
    "DEFAULT",
    "DEFAULT_STORE",
    "DELTA",
    "DEVICE",
    "L1",
    "L2",
    "L3",
    "TIERS",
    "Lookup",
    "RemoteTier",
    "Snapshot",
    "StoreStats",
    "TieredStore",
]

DEFAULT_STORE = StoreSection()  # the ``[store]`` defaults (frozen, so one shared instance)


class TieredStore:
    """All embedding tables of a model behind L1 -> delta -> L2 -> L3 -> default."""

    def __init__(
        self,
        tables: Sequence[TableInfo],
        shards: Sequence[Shard],
        base_version: int,
        options: StoreSection = DEFAULT_STORE,
        remote: RemoteTier | None = None,
        compiled: bool = True,
    ) -> None:
        self.tables = {t.name: t for t in tables}
        self.table_names = tuple(t.name for t in sorted(tables, key=lambda t: t.table_id))
        self.shards = tuple(shards)
        # vectors travel at the widest table's width; a narrower table's are zero-padded to it
        self.dim = max(int(shard.vectors.shape[1]) for shard in self.shards)
        self.base_version = base_version
        self.options = options
        self.remote = remote
        self.compiled = compiled and KERNELS is not None  # the compiled loops, else the numpy path
        ids = sorted(tables, key=lambda t: t.table_id)
        self._table_shard = np.array([t.shard for t in ids], np.int16)
        self._table_width = np.array([self.shards[t.shard].vectors.shape[1] for t in ids], np.int64)
        self._one_width = bool((self._table_width == self.dim).all())  # L3 rows need no per-key widths
        self._defaults = np.zeros((len(ids), self.dim), np.float32)
        for t in ids:
            default = self.shards[t.shard].vectors[t.default_row]
            self._defaults[t.table_id, : default.shape[0]] = default
        self.tracker = FrequencyTracker(TRACKED_KEYS_PER_REFRESH, COUNT_DECAY)
        self.stats = StoreStats(np.zeros((len(ids), len(TIERS)), np.int64))
        self.snapshot = Snapshot(tuple(base_version for _ in ids))
        self._swap_lock = threading.Lock()
        self.refreshed_at = time.monotonic()

    # ---- lookup --------------------------------------------------------------------------------
    def table_dim(self, name: str) -> int:
        """Width of one table's vectors as stored (:attr:`dim` is the widest table's)."""
        return int(self.shards[self.tables[name].shard].vectors.shape[1])

    def table_id(self, name: str) -> int:
        """Numeric id of a table (its position in :attr:`table_names`)."""
        return self.tables[name].table_id

    def lookup(self, keys: np.ndarray, table_ids: np.ndarray, record: bool = True) -> Lookup:
        """Vectors of ``keys`` (flat int64) whose tables are ``table_ids`` (same length)."""
        started = time.perf_counter()
        keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        table_ids = np.ascontiguousarray(table_ids, dtype=np.int16).reshape(-1)
        snapshot = self.snapshot  # read once: the whole batch uses one version of everything
        vectors = np.empty((keys.size, self.dim), np.float32)  # every row is written by one tier below
        tiers = np.empty(keys.size, np.int8)
        todo = (
            self._take_cache(snapshot.cache, keys, vectors, tiers)
            if snapshot.cache is not None
            else np.arange(keys.size)
        )
        if snapshot.delta is not None and todo.size:
            todo = self._take_rows(snapshot.delta, keys, todo, vectors, tiers, DELTA)
        if todo.size:
            todo = self._take_local(keys, table_ids, todo, vectors, tiers)
        if todo.size and self.remote is not None:
            todo = self._take_remote(keys, todo, vectors, tiers, table_ids)
        if todo.size:
            self._take_defaults(table_ids, todo, vectors, tiers)
        if record:
            self.record_lookup(keys, table_ids, tiers, time.perf_counter() - started)
        return Lookup(vectors, tiers, snapshot)

    def record_lookup(
        self, keys: np.ndarray, table_ids: np.ndarray, tiers: np.ndarray, seconds: float
    ) -> None:
        """Count a batch served partly outside :meth:`lookup` (the device L1) as ``lookup`` counts its own."""
        self.tracker.record(keys)
        self._count(table_ids, tiers, seconds)

    def _take_defaults(
        self, table_ids: np.ndarray, todo: np.ndarray, out: np.ndarray, tiers: np.ndarray
    ) -> None:
        """Each table's default row for the keys no tier holds (in a padded history: every padding key)."""
        if self.compiled:
            assert KERNELS is not None  # compiled is set only when the kernels loaded
            KERNELS.fill_rows(todo, table_ids, self._defaults, out, tiers, DEFAULT)
            return
        out[todo] = self._defaults[table_ids[todo]]
        tiers[todo] = DEFAULT

    def _take_cache(
        self, cache: HotCache, keys: np.ndarray, out: np.ndarray, tiers: np.ndarray
    ) -> np.ndarray:
        """L1 rows of ``keys``; the positions it does not hold."""
        if self.compiled:
            probe = cache.probe
            assert probe is not None  # compiled: the kernels are loaded, so every cache has its probe
            misses = np.empty(keys.size, np.int64)
            return misses[: probe.take(keys, out, tiers, L1, misses)]
        slots = HotCache.slot_of(keys, len(cache.slot_keys))
        hit = cache.slot_keys.take(slots) == keys
        cache.vectors.take(slots, axis=0, out=out)  # one gather for the whole batch; misses overwritten later
        tiers[hit] = L1
        return np.flatnonzero(~hit)

    def _take_rows(
        self,
        rows: Shard | RowBlock,
        keys: np.ndarray,
        todo: np.ndarray,
        out: np.ndarray,
        tiers: np.ndarray,
        tier: int,
    ) -> np.ndarray:
        """Rows of ``keys[todo]`` held by ``rows`` (a shard or the delta rows).

        Rows narrower than ``out`` (a shard of narrower tables) fill its first columns and zeros.
        Returns the positions it does not hold.
        """
        width = rows.vectors.shape[1]
        if width < out.shape[1]:  # the numpy path: the compiled gather writes whole rows of ``out``
            found = rows.index.find(keys[todo])
            hit = todo[found >= 0]
            out[hit, :width] = rows.vectors.take(found[found >= 0], axis=0)
            out[hit, width:] = 0.0
            tiers[hit] = tier
            return todo[found < 0]
        if self.compiled:
            probe = rows.probe
            assert probe is not None  # compiled: the kernels are loaded, so every row set has its probe
            misses = np.empty(todo.size, np.int64)
            return misses[: probe.take(keys, todo, out, tiers, tier, misses)]
        found = rows.index.find(keys[todo])
        hit = found >= 0
        if hit.all():  # the common case: no masks to apply
            out[todo] = rows.vectors.take(found, axis=0)
            tiers[todo] = tier
            return todo[:0]
        out[todo[hit]] = rows.vectors.take(found[hit], axis=0)
        tiers[todo[hit]] = tier
        return todo[~hit]

    def _take_local(
        self, keys: np.ndarray, table_ids: np.ndarray, todo: np.ndarray, out: np.ndarray, tiers: np.ndarray
    ) -> np.ndarray:
        missing = []
        for number, shard in enumerate(self.shards):
            part = todo if len(self.shards) == 1 else todo[self._table_shard[table_ids[todo]] == number]
            missing.append(self._take_rows(shard, keys, part, out, tiers, L2))
        return missing[0] if len(missing) == 1 else np.sort(np.concatenate(missing))

    def _take_remote(
        self,
        keys: np.ndarray,
        todo: np.ndarray,
        out: np.ndarray,
        tiers: np.ndarray,
        table_ids: np.ndarray | None,
    ) -> np.ndarray:
        assert self.remote is not None  # callers only come here with an L3 tier
        fetch = self.remote.fetch if table_ids is not None else self.remote.fetch_bulk  # bulk: the L1 rebuild
        widths = None  # L3 rows are checked against each key's table width (None: all ``dim``; 0: any)
        if not self._one_width:
            widths = self._table_width[table_ids[todo]] if table_ids is not None else np.zeros(todo.size, int)
        found_vectors, found = fetch(keys[todo], self.dim, widths)
        out[todo[found]] = found_vectors[found]
        tiers[todo[found]] = L3
        return todo[~found]

    def _count(self, table_ids: np.ndarray, tiers: np.ndarray, seconds: float) -> None:
        if self.compiled:
            assert KERNELS is not None  # compiled is set only when the kernels loaded
            KERNELS.count(table_ids, tiers, self.stats.by_table_tier)
        else:
            flat = table_ids * np.int16(len(TIERS)) + tiers  # stays int16: no widening copy
            self.stats.by_table_tier += np.bincount(flat, minlength=self.stats.by_table_tier.size).reshape(
                self.stats.by_table_tier.shape
            )
        self.stats.calls += 1
        self.stats.seconds += seconds
        if len(self.stats.latencies) < self.stats.MAX_LATENCIES:
            self.stats.latencies.append(seconds)

    # ---- state changes ---------------------------------------------------------------------------
    def resolve(self, keys: np.ndarray, delta: RowBlock | None) -> tuple[np.ndarray, np.ndarray]:
        """Vectors of keys through delta -> L2 -> L3 (no L1, no counting); found mask."""
        keys = np.ascontiguousarray(keys, np.int64).reshape(-1)
        vectors = np.zeros((keys.size, self.dim), np.float32)
        tiers = np.full(keys.size, DEFAULT, np.int8)
        todo = np.arange(keys.size)
        if delta is not None:
            todo = self._take_rows(delta, keys, todo, vectors, tiers, DELTA)
        for shard in self.shards:  # no table ids here: each shard in turn
            if todo.size:
                todo = self._take_rows(shard, keys, todo, vectors, tiers, L2)
        if todo.size and self.remote is not None:
            self._take_remote(keys, todo, vectors, tiers, None)  # no table ids: the L1 rebuild (bulk)
        return vectors, tiers != DEFAULT

    def build_cache(
        self, hot_keys: np.ndarray, delta: RowBlock | None, known: HotCache | None = None
    ) -> HotCache | None:
        """An L1 cache of the hottest keys that fit the byte budget, resolved for ``delta``.

        ``known``: a cache built for the same versions and delta, whose rows are copied rather
        than resolved again (see :meth:`HotCache.claimed`).
        """
        slots = self.cache_slots
        if slots == 0 or len(hot_keys) == 0:
            return None
        keys = np.asarray(hot_keys[: 2 * slots], np.int64)  # twice the slots: conflicts leave some out
        return HotCache.claimed(slots, keys, self.dim, lambda todo: self.resolve(todo, delta), known)

    @property
    def cache_slots(self) -> int:
        """L1 slots that fit the byte budget (vector, slot key and cached-key list per slot)."""
        return int(self.options.cache_bytes // (self.dim * 4 + 16))

    def install(self, versions: Mapping[str, int], delta: RowBlock | None) -> Snapshot:
        """Swap in new table versions and delta rows, with L1 rebuilt for them before the swap."""
        with self._swap_lock:
            current = self.snapshot
            ids = list(current.versions)
            for name, version in versions.items():
                ids[self.table_id(name)] = version
            cache = self.build_cache(
                current.cache.keys if current.cache is not None else np.empty(0, np.int64), delta
            )
            self.snapshot = Snapshot(tuple(ids), delta, cache)
            return self.snapshot

    def refresh_cache(self, seed: np.ndarray | None = None) -> int:
        """Rebuild L1 from the key frequencies (or from ``seed``, hottest first); rows cached."""
        with self._swap_lock:
            if seed is not None:
                self.tracker.seed(seed)
                hot = np.asarray(seed, np.int64)
            else:
                hot = self.tracker.hottest(2 * self.cache_slots)
            current = self.snapshot
            # rows stay what they were for the same versions and delta, except L3's: read again
            known = current.cache if self.remote is None else None
            cache = self.build_cache(hot, current.delta, known)
            self.snapshot = Snapshot(current.versions, current.delta, cache)
            self.refreshed_at = time.monotonic()
            return 0 if cache is None else len(cache.keys)

    def refresh_due(self) -> bool:
        """True when L1 has not been rebuilt for ``cache_refresh_s``."""
        return time.monotonic() - self.refreshed_at >= self.options.cache_refresh_s

    def hot_keys(self) -> np.ndarray:
        """Keys in L1 now, hottest first (what warm-up records)."""
        cache = self.snapshot.cache
        return np.empty(0, np.int64) if cache is None else cache.keys

    def healthy(self) -> bool:
        """Readiness: the local shards are mapped. A failing L3 only degrades (see ``remote.healthy``)."""
        return bool(self.shards)

    # ---- facts ---------------------------------------------------------------------------------
    def table_arrays(self, name: str) -> TableArrays:
        """The base rows of one table as stored locally (float32)."""
        info = self.tables[name]
        shard = self.shards[info.shard]
        return TableArrays(
            name,
            np.asarray(shard.keys[info.row_start : info.row_end]),
            np.asarray(shard.vectors[info.row_start : info.row_end], np.float32),
            np.asarray(shard.vectors[info.default_row], np.float32),
        )

    @property
    def key_count(self) -> int:
        """Keys stored locally."""
        return int(sum(len(s.keys) for s in self.shards))

    @property
    def bytes_per_key(self) -> float:
        """Bytes of the local tier per stored key (vector, key, index share)."""
        return sum(s.nbytes for s in self.shards) / max(self.key_count, 1)

    def version_of(self, name: str, snapshot: Snapshot | None = None) -> int:
        """Version of one table in ``snapshot`` (default: the current one)."""
        return (snapshot or self.snapshot).versions[self.table_id(name)]

    def table_of_row(self, shard: int, rows: np.ndarray) -> np.ndarray:
        """Table id owning each local row of ``shard`` (-1 for rows of no table)."""
        infos = sorted((t for t in self.tables.values() if t.shard == shard), key=lambda t: t.row_start)
        starts = np.array([t.row_start for t in infos])
        ends = np.array([t.row_end for t in infos])
        ids = np.array([t.table_id for t in infos])
        slot = np.searchsorted(starts, rows, side="right") - 1
        inside = (slot >= 0) & (rows < ends[np.maximum(slot, 0)])
        return np.where(inside, ids[np.maximum(slot, 0)], -1)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_tables(
        cls,
        tables: Mapping[str, TableArrays],
        dtypes: Mapping[str, str] | None = None,
        base_version: int = 1,
        options: StoreSection = DEFAULT_STORE,
        remote: RemoteTier | None = None,
    ) -> TieredStore:
        """A store held in memory (tests, benchmarks, ``build``)."""
        infos, shards = layout_shards(tables, dtypes or {})
        return cls(infos, shards, base_version, options, remote)

    @classmethod
    def load(cls, root: Path, spec: ModelSpec, remote: RemoteTier | None = None) -> TieredStore:
        """Memory-map and verify the shards under ``root`` (a model version folder) for ``spec``."""
        dims = {name: table.dim for name, table in spec.tables.items()}
        return cls.map(root, dims, spec.store, remote)

    @classmethod
    def map(
        cls,
        root: Path,
        dims: Mapping[str, int],
        options: StoreSection = DEFAULT_STORE,
        remote: RemoteTier | None = None,
    ) -> TieredStore:
        """Memory-map and verify the shards under ``root``; ``dims`` names the expected tables."""
        infos, shards, version = map_shards(root, dims)
        return cls(infos, shards, version, options, remote)
