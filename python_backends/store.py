"""The sparse parameter store: tiered, keyed embedding lookup over whole batches.

Tiers, tried in order for every key of a batch at once (no per-key Python loop anywhere)::

    L1     hot-row cache, bounded in bytes, rebuilt from the most frequent recent keys (LFU with
           periodic batch admission); also preloaded at start-up from the recorded hot keys
    delta  rows of online updates published after the base version (``recserve update``)
    L2     the full local table: memory-mapped shard files (keys, vectors, hash index) that every
           model instance on the machine shares through the page cache
    L3     optional remote tier (Redis Cluster) behind a deadline and a circuit breaker
    default  the table's trained out-of-vocabulary row

Every table has the model's embedding width. Rows are grouped into one *shard* per storage dtype
(``float32``, or ``float16`` for tables that ask for it); each shard holds the rows of all its
tables under one hash index, so one probe serves the keys of every feature. A lookup reads the
current :class:`Snapshot` once and uses only it: an update builds a new snapshot and swaps one
reference, so a batch sees a whole version of every table or none of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np

from recserve.backends import kernels
from recserve.backends.artifacts import load_array, read_manifest, save_array
from recserve.backends.errors import ArtifactError
from recserve.backends.keyindex import GOLDEN, KeyIndex
from recserve.backends.metrics import MetricSample
from recserve.spec import ModelSpec

LOGGER = logging.getLogger(__name__)

MANIFEST_FORMAT = "recserve-embeddings/3"
TIERS = ("l1", "delta", "l2", "l3", "default")
L1, DELTA, L2, L3, DEFAULT = range(len(TIERS))
STORAGE_DTYPES = ("float32", "float16")
INDEX_ARRAYS = ("buckets", "overflow_keys", "overflow_rows")
KERNELS = kernels.load()  # the compiled probe-and-gather loops; None: the numpy path below


@dataclass(frozen=True)
class TableArrays:
    """One table as training produces it: keys (any order), their vectors, the default vector."""

    name: str
    keys: np.ndarray  # int64 [rows]
    vectors: np.ndarray  # float32 [rows, dim]
    default: np.ndarray  # float32 [dim]

    def __post_init__(self) -> None:
        if len(np.unique(self.keys)) != len(self.keys):
            raise ArtifactError(f"table {self.name!r} has duplicate keys")
        if self.vectors.shape != (len(self.keys), self.default.shape[0]):
            raise ArtifactError(f"table {self.name!r}: vectors {list(self.vectors.shape)} do not fit {len(self.keys)} keys")


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
        return cls(KeyIndex.build(keys), np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(keys, np.int64))

    @cached_property
    def probe(self) -> kernels.IndexProbe | None:
        """The compiled probe of these rows (None without the kernels)."""
        return _index_probe(self.index, self.vectors)


def _index_probe(index: KeyIndex, vectors: np.ndarray) -> kernels.IndexProbe | None:
    return None if KERNELS is None else KERNELS.index_probe(index.buckets, index.overflow_keys, index.overflow_rows, vectors)


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
        slot_keys[home_of_zero] = next(k for k in range(1, 64) if cls.slot_of(np.array([k], np.int64), slots)[0] != home_of_zero)
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


@dataclass(frozen=True)
class Snapshot:
    """One consistent state of every table: versions, delta rows, and the L1 cache built for them."""

    versions: tuple[int, ...]  # by table id
    delta: RowBlock | None = None
    cache: HotCache | None = None


class RemoteTier(Protocol):
    """What the store needs of an L3 tier (see :mod:`recserve.backends.redis_tier`)."""

    def fetch(self, keys: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """Vectors ``[n, dim]`` and a found mask ``[n]``; never raises (misses on failure)."""

    def fetch_bulk(self, keys: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """The same for work off the serving path (no call deadline, does not hold the serving calls)."""

    def healthy(self) -> bool:
        """False while the tier is known to be failing (breaker open)."""

    def samples(self) -> list[MetricSample]:
        """The tier's metrics (errors, breaker state)."""


@dataclass(frozen=True)
class Lookup:
    """Result of one batch: vectors, the tier that served each key, the snapshot used."""

    vectors: np.ndarray  # float32 [n, dim]
    tiers: np.ndarray  # int8 [n], indexes TIERS
    snapshot: Snapshot


@dataclass
class StoreStats:
    """Counters since start: keys per (table, tier), lookup calls and their seconds."""

    by_table_tier: np.ndarray
    calls: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # since the last drain, at most MAX_LATENCIES

    MAX_LATENCIES = 100_000

    def drain_latencies(self) -> list[float]:
        """Latencies recorded since the last call."""
        taken, self.latencies = self.latencies, []
        return taken


@dataclass(frozen=True)
class StoreOptions:
    """Serving settings of the store, from the spec's ``[store]`` section."""

    cache_bytes: int = 8 << 20  # L1 budget per model instance
    cache_refresh_s: float = 5.0  # how often L1 is rebuilt from the key frequencies
    update_poll_s: float = 1.0  # how often a server looks for new table versions
    table_dtypes: Mapping[str, str] = field(default_factory=dict)  # storage dtype by table (default float32)
    redis_nodes: tuple[str, ...] = ()  # "host:port" seeds of the L3 Redis Cluster; empty: no L3
    remote_tables: tuple[str, ...] = ()  # tables whose rows live only in L3 (not in the local shards)
    redis_deadline_ms: float = 5.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 2.0
    track_keys_per_refresh: int = 1 << 18  # at most this many recent keys feed the frequency count
    decay: float = 0.5  # weight of older counts at each refresh

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> StoreOptions:
        """Options from ``spec.source['store']`` (defaults where absent)."""
        raw = spec.source.get("store", {})
        for setting in ("float16_tables", "remote_tables"):
            unknown = sorted(set(raw.get(setting, [])) - set(spec.tables))
            if unknown:
                raise ArtifactError(f"[store] {setting} names unknown tables {unknown}")
        if raw.get("remote_tables") and not raw.get("redis_nodes"):
            raise ArtifactError("[store] remote_tables needs redis_nodes (the L3 Redis Cluster)")
        return cls(
            cache_bytes=int(float(raw.get("cache_mib", 8)) * (1 << 20)),
            cache_refresh_s=float(raw.get("cache_refresh_s", 5.0)),
            update_poll_s=float(raw.get("update_poll_s", 1.0)),
            table_dtypes={name: "float16" for name in raw.get("float16_tables", [])},
            redis_nodes=tuple(raw.get("redis_nodes", [])),
            remote_tables=tuple(raw.get("remote_tables", [])),
            redis_deadline_ms=float(raw.get("redis_deadline_ms", 5.0)),
            breaker_failures=int(raw.get("breaker_failures", 3)),
            breaker_cooldown_s=float(raw.get("breaker_cooldown_s", 2.0)),
        )


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


class TieredStore:
    """All embedding tables of a model behind L1 -> delta -> L2 -> L3 -> default."""

    def __init__(
        self,
        tables: Sequence[TableInfo],
        shards: Sequence[Shard],
        base_version: int,
        options: StoreOptions = StoreOptions(),
        remote: RemoteTier | None = None,
        compiled: bool = True,
    ) -> None:
        self.tables = {t.name: t for t in tables}
        self.table_names = tuple(t.name for t in sorted(tables, key=lambda t: t.table_id))
        self.shards = tuple(shards)
        self.dim = int(self.shards[0].vectors.shape[1])
        self.base_version = base_version
        self.options = options
        self.remote = remote
        self.compiled = compiled and KERNELS is not None  # the compiled loops, else the numpy path
        ids = sorted(tables, key=lambda t: t.table_id)
        self._table_shard = np.array([t.shard for t in ids], np.int16)
        self._defaults = np.stack([self.shards[t.shard].vectors[t.default_row].astype(np.float32) for t in ids])
        self.tracker = FrequencyTracker(options.track_keys_per_refresh, options.decay)
        self.stats = StoreStats(np.zeros((len(ids), len(TIERS)), np.int64))
        self.snapshot = Snapshot(tuple(base_version for _ in ids))
        self._swap_lock = threading.Lock()
        self.refreshed_at = time.monotonic()

    # ---- lookup --------------------------------------------------------------------------------
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
        todo = self._take_cache(snapshot.cache, keys, vectors, tiers) if snapshot.cache is not None else np.arange(keys.size)
        if snapshot.delta is not None and todo.size:
            todo = self._take_rows(snapshot.delta, keys, todo, vectors, tiers, DELTA)
        if todo.size:
            todo = self._take_local(keys, table_ids, todo, vectors, tiers)
        if todo.size and self.remote is not None:
            todo = self._take_remote(keys, todo, vectors, tiers)
        if todo.size:
            vectors[todo] = self._defaults[table_ids[todo]]
            tiers[todo] = DEFAULT
        if record:
            self.record_lookup(keys, table_ids, tiers, time.perf_counter() - started)
        return Lookup(vectors, tiers, snapshot)

    def record_lookup(self, keys: np.ndarray, table_ids: np.ndarray, tiers: np.ndarray, seconds: float) -> None:
        """Count a batch served partly outside :meth:`lookup` (the device L1) as ``lookup`` counts its own."""
        self.tracker.record(keys)
        self._count(table_ids, tiers, seconds)

    def _take_cache(self, cache: HotCache, keys: np.ndarray, out: np.ndarray, tiers: np.ndarray) -> np.ndarray:
        """L1 rows of ``keys``; the positions it does not hold."""
        if self.compiled:
            misses = np.empty(keys.size, np.int64)
            return misses[: cache.probe.take(keys, out, tiers, L1, misses)]
        slots = HotCache.slot_of(keys, len(cache.slot_keys))
        hit = cache.slot_keys.take(slots) == keys
        cache.vectors.take(slots, axis=0, out=out)  # one gather for the whole batch; misses overwritten later
        tiers[hit] = L1
        return np.flatnonzero(~hit)

    def _take_rows(self, rows: Shard | RowBlock, keys: np.ndarray, todo: np.ndarray, out: np.ndarray, tiers: np.ndarray, tier: int) -> np.ndarray:
        """Rows of ``keys[todo]`` held by ``rows`` (a shard or the delta rows); the positions it does not hold."""
        if self.compiled:
            misses = np.empty(todo.size, np.int64)
            return misses[: rows.probe.take(keys, todo, out, tiers, tier, misses)]
        found = rows.index.find(keys[todo])
        hit = found >= 0
        if hit.all():  # the common case: no masks to apply
            out[todo] = rows.vectors.take(found, axis=0)
            tiers[todo] = tier
            return todo[:0]
        out[todo[hit]] = rows.vectors.take(found[hit], axis=0)
        tiers[todo[hit]] = tier
        return todo[~hit]

    def _take_local(self, keys: np.ndarray, table_ids: np.ndarray, todo: np.ndarray, out: np.ndarray, tiers: np.ndarray) -> np.ndarray:
        missing = []
        for number, shard in enumerate(self.shards):
            part = todo if len(self.shards) == 1 else todo[self._table_shard[table_ids[todo]] == number]
            missing.append(self._take_rows(shard, keys, part, out, tiers, L2))
        return missing[0] if len(missing) == 1 else np.sort(np.concatenate(missing))

    def _take_remote(self, keys: np.ndarray, todo: np.ndarray, out: np.ndarray, tiers: np.ndarray, bulk: bool = False) -> np.ndarray:
        fetch = self.remote.fetch_bulk if bulk else self.remote.fetch
        found_vectors, found = fetch(keys[todo], self.dim)
        out[todo[found]] = found_vectors[found]
        tiers[todo[found]] = L3
        return todo[~found]

    def _count(self, table_ids: np.ndarray, tiers: np.ndarray, seconds: float) -> None:
        if self.compiled:
            KERNELS.count(table_ids, tiers, self.stats.by_table_tier)
        else:
            flat = table_ids * np.int16(len(TIERS)) + tiers  # stays int16: no widening copy
            self.stats.by_table_tier += np.bincount(flat, minlength=self.stats.by_table_tier.size).reshape(self.stats.by_table_tier.shape)
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
            self._take_remote(keys, todo, vectors, tiers, bulk=True)  # the L1 rebuild: off the serving path
        return vectors, tiers != DEFAULT

    def build_cache(self, hot_keys: np.ndarray, delta: RowBlock | None) -> HotCache | None:
        """An L1 cache of the hottest keys that fit the byte budget, resolved for ``delta``."""
        slots = self.cache_slots
        if slots == 0 or len(hot_keys) == 0:
            return None
        keys = np.asarray(hot_keys[: 2 * slots], np.int64)  # twice the slots: conflicts leave some out
        vectors, found = self.resolve(keys, delta)
        return HotCache.of(slots, keys[found], vectors[found])

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
            cache = self.build_cache(current.cache.keys if current.cache is not None else np.empty(0, np.int64), delta)
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
            cache = self.build_cache(hot, current.delta)
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
        options: StoreOptions = StoreOptions(),
        remote: RemoteTier | None = None,
    ) -> TieredStore:
        """A store held in memory (tests, benchmarks, ``build``)."""
        infos, shards = layout_shards(tables, dtypes or {})
        return cls(infos, shards, base_version, options, remote)

    @classmethod
    def load(cls, root: Path, spec: ModelSpec, remote: RemoteTier | None = None) -> TieredStore:
        """Memory-map and verify the shards under ``root`` (a model version folder) for ``spec``."""
        dims = {name: table.dim for name, table in spec.tables.items()}
        return cls.map(root, dims, StoreOptions.from_spec(spec), remote)

    @classmethod
    def map(cls, root: Path, dims: Mapping[str, int], options: StoreOptions = StoreOptions(), remote: RemoteTier | None = None) -> TieredStore:
        """Memory-map and verify the shards under ``root``; ``dims`` names the expected tables."""
        manifest = read_manifest(root)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ArtifactError(f"manifest format {manifest.get('format')!r} is not {MANIFEST_FORMAT!r}; rebuild with 'recserve build'")
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
            infos.append(TableInfo(name, int(entry["table_id"]), int(entry["shard"]), int(entry["row_start"]), int(entry["row_end"]), int(entry["default_row"])))
        LOGGER.info("mapped %d tables in %d shards, version %s", len(infos), len(shards), manifest["version"])
        return cls(infos, shards, int(manifest["version"]), options, remote)


def layout_shards(tables: Mapping[str, TableArrays], dtypes: Mapping[str, str]) -> tuple[list[TableInfo], list[Shard]]:
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
        vectors = np.concatenate([*(tables[n].vectors for n in members), *(tables[n].default[None, :] for n in members)]).astype(dtype)
        shards.append(Shard(dtype, keys, vectors, index))
        for offset, name in enumerate(members):
            rows = len(tables[name].keys)
            infos.append(TableInfo(name, names.index(name), shard_number, starts[name], starts[name] + rows, start + offset))
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
                **{name: save_array(root, f"{prefix}.{name}.npy", array) for name, array in shard.index.arrays().items()},
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

