"""Whole tables resident on a torch device: the keyed lookup done where the dense step runs.

On a GPU instance (config profile ``cuda``) the embedding step holds every local table that fits
the spec's budget (``[store] device_memory_mib``) on the instance's device, as one sorted int64 key
tensor and one float32 vector tensor per L2 shard, and the delta rows of the served version the
same way. A batch's keys go to the device once; ``torch.searchsorted`` and a gather answer them
there; the tier of each key comes back to the host (one byte per key) for the counters::

    keys ──► device: delta keys ─ searchsorted ─► hit? delta row
                     shard keys ─ searchsorted ─► hit? shard row ──► [n, dim] on the device
                     resident table, no L3 ─────► its default row
             the rest (tables not resident; L3) ─► DeviceL1 / TieredStore.lookup, one call

The keys and tiers follow the host store (:class:`~recserve.backends.store.tiered.TieredStore`):
the delta rows first (any table), then the key's own table's shard, then L3 and the default, so
every vector equals the host path's bit for bit; keys answered on the device are counted as tier
``device`` (:data:`~recserve.backends.store.tiers.DEVICE`). The shards never change while served;
an update (``install``) or rollback brings a new delta: its tensors are built aside
(:meth:`DeviceTier.follow` on the upkeep thread, or the first lookup that sees it) and swapped in
as one reference, so a batch reads one whole version. Tables that do not fit are served by the
fallback: the device L1 (:class:`~recserve.backends.store.device.cache.DeviceL1`, hot rows on the
device) or the host store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from recserve.backends.base.device_copies import DeviceCopies
from recserve.backends.store.device.cache import DeviceL1, DeviceLookup, first_whole
from recserve.backends.store.device.resident import KEY_BYTES, DeviceDelta, SortedRows
from recserve.backends.store.table_data import RowBlock
from recserve.backends.store.tiered import DEFAULT, DEVICE, TIERS, Snapshot, TieredStore
from recserve.core.names import EMBEDDING_LOOKUP

LOGGER = logging.getLogger(__name__)

#: Tier mark of a key the device does not answer (sent to the fallback); never leaves :class:`DeviceTier`.
ELSEWHERE = -1


def resident_tables(store: TieredStore, budget_bytes: int) -> tuple[str, ...]:
    """The local tables that fit ``budget_bytes`` on the device, in table order (each whole or not at all).

    A row costs its key and its vector at the store's width (:attr:`TieredStore.dim`, float32).
    Tables held only in L3 (``[store] remote_tables``) have no local rows and are never resident.
    """
    remote = set(store.options.remote_tables)
    row_bytes = KEY_BYTES + store.dim * 4
    chosen, used = [], 0
    for name in store.table_names:
        info = store.tables[name]
        cost = (info.row_end - info.row_start) * row_bytes
        if name not in remote and used + cost <= budget_bytes:
            chosen.append(name)
            used += cost
    return tuple(chosen)


#: Batch layouts (shapes) whose constants a device tier keeps (:meth:`DeviceTier.layout`).
LAYOUTS = 8


@dataclass(frozen=True)
class BatchLayout:
    """Per-key constants of one layout of tables, on the device: what a batch of that shape reads.

    ``table_ids`` (host, int16 ``[n]``); on the device each key's default row ``[n, dim]``, its tier
    when no row answers it (``default``; :data:`ELSEWHERE` for a table left to the fallback),
    ``table_id * len(TIERS)`` (int64, for the counters) and per resident shard whether the key's
    table is held there (None: every key's).
    """

    table_ids: np.ndarray
    defaults: torch.Tensor
    tiers: torch.Tensor
    count_base: torch.Tensor
    shard_masks: tuple[torch.Tensor | None, ...]

    @classmethod
    def of(cls, tier: DeviceTier, table_ids: np.ndarray) -> BatchLayout:
        """The constants of ``table_ids`` for ``tier`` (made once per shape, on the first batch of it)."""
        ids = torch.from_numpy(table_ids.astype(np.int64)).to(tier.device)
        shard = tier.shard_of.index_select(0, ids)
        masks = []
        for number in range(len(tier.shards)):
            mine = shard == number
            masks.append(None if bool(mine.all()) else mine)
        tiers = torch.where(tier.local_default.index_select(0, ids), DEFAULT, ELSEWHERE).to(torch.int8)
        return cls(table_ids, tier.defaults.index_select(0, ids), tiers, ids * len(TIERS), tuple(masks))


class DeviceTier:
    """:meth:`TieredStore.lookup` with whole tables searched on a torch device and the result left there.

    Same arguments, same vectors bit for bit and the same counters as the host path; keys the
    device answers are counted as tier ``device``.

    Args:
        store: the host store (its shards, snapshot, counters and key frequencies).
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        tables: the tables to hold on the device (:func:`resident_tables`).
        fallback: serves the keys of the other tables (and every miss when the store has L3); None:
            the host store.
    """

    def __init__(
        self,
        store: TieredStore,
        device: str | torch.device,
        tables: Sequence[str],
        fallback: DeviceL1 | None = None,
    ) -> None:
        self.store = store
        self.device = torch.device(device)
        self.tables = tuple(tables)
        self.fallback = fallback
        #: the host-device bytes of every batch, the fallback's included (its counter is this one)
        self.copies = fallback.copies if fallback is not None else DeviceCopies(EMBEDDING_LOOKUP)
        shard_of = np.full(len(store.table_names), -1, np.int64)  # table id -> its resident shard, or -1
        self.shards: list[SortedRows] = []
        for number, shard in enumerate(store.shards):
            members = [store.tables[name] for name in self.tables if store.tables[name].shard == number]
            if not members:
                continue
            rows = np.concatenate([np.arange(t.row_start, t.row_end) for t in members])
            self.shards.append(SortedRows.of(shard.keys[rows], shard.vectors[rows], store.dim, self.device))
            shard_of[[t.table_id for t in members]] = len(self.shards) - 1
        self.shard_of = torch.from_numpy(shard_of).to(self.device)
        # without L3, a resident table's unknown key gets its default on the device
        local_default = np.zeros(len(store.table_names), bool)
        if store.remote is None:
            local_default[shard_of >= 0] = True
        self.local_default = torch.from_numpy(local_default).to(self.device)
        self.defaults = torch.from_numpy(store_defaults(store)).to(self.device)
        self._delta = DeviceDelta(None, None)
        self._lock = threading.Lock()
        #: every key is answered here (all local tables resident, no L3): no key goes to the host
        self.whole = fallback is None and store.remote is None and bool(local_default[shard_of >= 0].all())
        self.whole = self.whole and len(self.tables) == len(store.table_names)
        #: the per-key constants of a batch's layout of tables, on the device (:meth:`layout`)
        self._layouts: dict[tuple, BatchLayout] = {}
        #: keys per (table, tier) counted on the device, added to the store's counters off the request path
        self._counts = torch.zeros(len(store.table_names) * len(TIERS), dtype=torch.int64, device=self.device)
        self._one = torch.ones(1, dtype=torch.int64, device=self.device)
        self._device_tier = torch.tensor(DEVICE, dtype=torch.int8, device=self.device)
        self._counts_lock = threading.Lock()
        store.stats.pending.append(self.take_counts)
        self.delta_for(store.snapshot.delta)
        LOGGER.info(
            "%d of %d tables resident on %s: %d rows, %d bytes",
            len(self.tables),
            len(store.table_names),
            self.device,
            sum(int(s.keys.numel()) for s in self.shards),
            self.nbytes,
        )

    @property
    def nbytes(self) -> int:
        """Device bytes of the resident shards and the current delta rows."""
        delta = self._delta.rows
        return sum(s.nbytes for s in self.shards) + (0 if delta is None else delta.nbytes)

    def delta_for(self, delta: RowBlock | None) -> DeviceDelta:
        """The device copy of a version's delta rows, made on first use (once, by the first thread asking)."""
        current = self._delta
        if current.source is delta:
            return current
        with self._lock:
            if self._delta.source is not delta:
                rows = (
                    None
                    if delta is None
                    else SortedRows.of(delta.keys, delta.vectors, self.store.dim, self.device)
                )
                self._delta = DeviceDelta(delta, rows)  # one reference swap: a lookup sees the old or the new
            return self._delta

    def take_counts(self) -> np.ndarray:
        """The keys per (table, tier) counted on the device since the last call (a read of the device)."""
        with self._counts_lock:
            taken, self._counts = self._counts, torch.zeros_like(self._counts)
        return taken.cpu().numpy().reshape(len(self.store.table_names), len(TIERS))

    def layout(
        self, row_tables: np.ndarray, rows: int, history_tables: np.ndarray, owners: int
    ) -> BatchLayout:
        """The table ids of a batch of ``rows`` rows and ``owners`` histories, their constants on the device.

        Keys laid out as :meth:`EmbeddingLookup.key_blocks
        <recserve.backends.steps.lookup.EmbeddingLookup.key_blocks>` joins them: ``row_tables`` per
        row, then ``history_tables`` per history owner. Made once per shape (the last
        :data:`LAYOUTS` kept), so a batch of a known shape uploads no table id.
        """
        key = (rows, owners, row_tables.tobytes(), history_tables.tobytes())
        made = self._layouts.get(key)
        if made is None:
            table_ids = np.concatenate([np.tile(row_tables, rows), np.tile(history_tables, owners)]).astype(
                np.int16
            )
            made = BatchLayout.of(self, table_ids)
            while len(self._layouts) >= LAYOUTS:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = made
        return made

    def follow(self) -> None:
        """Copy the store's current delta rows to the device now (the upkeep thread, after each round)."""
        self.delta_for(self.store.snapshot.delta)
        if self.fallback is not None:
            self.fallback.follow()

    def lookup(
        self, keys: np.ndarray | torch.Tensor, table_ids: np.ndarray | BatchLayout, record: bool = True
    ) -> DeviceLookup:
        """Vectors of ``keys`` (flat int64) whose tables are ``table_ids`` (same length), on the device.

        ``keys`` may already be on the device (made there: :mod:`recserve.backends.features.device_keys`);
        then only the keys left to the fallback come to the host, and only they are recorded as the
        batch's keys for the host tiers' hot set (the device answers the others).
        """
        started = time.perf_counter()
        if isinstance(table_ids, BatchLayout) and self.whole and isinstance(keys, torch.Tensor):
            return self._whole(keys, table_ids, record, started)
        if isinstance(table_ids, BatchLayout):
            table_ids = table_ids.table_ids
        host: np.ndarray | None = None
        if isinstance(keys, torch.Tensor):
            device_keys = keys.to(self.device, torch.int64).reshape(-1)
        else:
            host = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
            self.copies.to_device(host.nbytes)
            device_keys = torch.from_numpy(host).to(self.device)
        table_ids = np.ascontiguousarray(table_ids, dtype=np.int16).reshape(-1)
        served = first_whole(lambda: self._serve(device_keys, table_ids))
        if served is None:  # updates kept landing mid-batch: the host path reads one snapshot by itself
            every = host if host is not None else self._host_keys(device_keys)
            result = self.store.lookup(every, table_ids, record=False)
            self.copies.to_device(result.vectors.nbytes)
            served = DeviceLookup(
                torch.from_numpy(result.vectors).to(self.device), result.tiers, result.snapshot, every
            )
        if record:
            seen = host if host is not None else served.fallback_keys
            self.store.record_lookup(seen, table_ids, np.asarray(served.tiers), time.perf_counter() - started)
        return served

    def _whole(self, keys: torch.Tensor, layout: BatchLayout, record: bool, started: float) -> DeviceLookup:
        """Every key answered on the device with the layout's constants: no copy, no host synchronisation.

        The tiers stay on the device and are counted there (:meth:`take_counts` reads them off the
        request path); the store counts the call and its seconds.
        """
        snapshot = self.store.snapshot
        vectors, served = layout.defaults, None
        delta = self.delta_for(snapshot.delta)
        sources: list[tuple[SortedRows, torch.Tensor | None]] = []
        if delta.rows is not None:  # the delta rows first, whatever the table (as the host path)
            sources.append((delta.rows, None))
        sources += [(rows, layout.shard_masks[number]) for number, rows in enumerate(self.shards)]
        for rows, mine in sources:
            found_at, found = rows.find(keys)
            if served is not None:
                found &= ~served
            if mine is not None:
                found &= mine
            vectors = torch.where(found[:, None], rows.vectors.index_select(0, found_at), vectors)
            served = found if served is None else served | found
        tiers = layout.tiers if served is None else torch.where(served, self._device_tier, layout.tiers)
        with self._counts_lock:
            self._counts.index_add_(0, layout.count_base + tiers, self._one.expand(keys.numel()))
        if record:
            none = np.empty(0, np.int64)
            self.store.record_lookup(
                none, none.astype(np.int16), none.astype(np.int8), time.perf_counter() - started
            )
        return DeviceLookup(vectors, tiers, snapshot)

    def _host_keys(self, keys: torch.Tensor, rows: torch.Tensor | None = None) -> np.ndarray:
        """``keys`` (those at ``rows``, when given) copied to the host, counted."""
        picked = keys if rows is None else keys.index_select(0, rows)
        host = picked.cpu().numpy()
        if keys.device.type != "cpu":
            self.copies.to_host(host.nbytes)
        return host

    def _serve(self, keys: torch.Tensor, table_ids: np.ndarray) -> DeviceLookup | None:
        """One attempt on the current snapshot; None when an update landed before the fallback answered."""
        snapshot = self.store.snapshot
        delta = self.delta_for(snapshot.delta)
        device_tables = torch.from_numpy(table_ids.astype(np.int64)).to(self.device)
        vectors, tiers = self._on_device(keys, device_tables, delta)
        host_tiers = tiers.cpu().numpy()
        self.copies.to_device(keys.numel() * 8)  # the table ids (int64)
        self.copies.to_host(host_tiers.nbytes)
        elsewhere = np.flatnonzero(host_tiers == ELSEWHERE)
        fallback_keys = np.empty(0, np.int64)
        if elsewhere.size:
            rows = torch.from_numpy(elsewhere).to(self.device)
            self.copies.to_device(elsewhere.nbytes)
            fallback_keys = self._host_keys(keys, rows)
            rest = (self.fallback or self.store).lookup(fallback_keys, table_ids[elsewhere], record=False)
            if not same_version(rest.snapshot, snapshot):
                return None
            host_tiers[elsewhere] = rest.tiers
            if isinstance(rest.vectors, np.ndarray):  # the host store's: copied here
                self.copies.to_device(rest.vectors.nbytes)
            vectors.index_copy_(0, rows, torch.as_tensor(rest.vectors).to(self.device))
        return DeviceLookup(vectors, host_tiers, snapshot, fallback_keys)

    def _on_device(
        self, keys: torch.Tensor, table_ids: torch.Tensor, delta: DeviceDelta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Vectors ``[n, dim]`` and tiers ``[n]`` (int8; :data:`ELSEWHERE` for keys left to the fallback)."""
        vectors = self.defaults.index_select(0, table_ids)
        tiers = torch.where(
            self.local_default.index_select(0, table_ids),
            torch.tensor(DEFAULT, dtype=torch.int8, device=self.device),
            torch.tensor(ELSEWHERE, dtype=torch.int8, device=self.device),
        )
        shard = self.shard_of.index_select(0, table_ids)
        served = torch.zeros(keys.shape, dtype=torch.bool, device=self.device)
        sources: list[tuple[SortedRows, torch.Tensor | None]] = [
            (rows, shard == number) for number, rows in enumerate(self.shards)
        ]
        if delta.rows is not None:  # the delta rows first, whatever the table (as the host path)
            sources.insert(0, (delta.rows, None))
        for rows, mine in sources:
            found_at, found = rows.find(keys)
            found &= ~served
            if mine is not None:
                found &= mine
            vectors = torch.where(found[:, None], rows.vectors.index_select(0, found_at), vectors)
            served |= found
        tiers = torch.where(served, self._device_tier, tiers)
        return vectors, tiers


def same_version(a: Snapshot, b: Snapshot) -> bool:
    """True when two snapshots serve the same rows (the same versions and delta; L1 may differ)."""
    return a is b or (a.delta is b.delta and a.versions == b.versions)


def store_defaults(store: TieredStore) -> np.ndarray:
    """float32 ``[tables, dim]``: each table's default row at the store's width (zeros beyond its own)."""
    out = np.zeros((len(store.table_names), store.dim), np.float32)
    for info in store.tables.values():
        row = store.shards[info.shard].vectors[info.default_row]
        out[info.table_id, : row.shape[0]] = row
    return out


def device_lookup(store: TieredStore, device: str, budget_bytes: int) -> DeviceTier | DeviceL1:
    """What a device step looks keys up with: the tables that fit ``budget_bytes`` resident, L1 for the rest.

    With no table resident, the device L1 alone (hot rows on the device, the rest on the host).
    """
    tables = resident_tables(store, budget_bytes)
    if not tables:
        return DeviceL1(store, device)
    local = [n for n in store.table_names if n not in store.options.remote_tables]
    fallback = None if len(tables) == len(local) and store.remote is None else DeviceL1(store, device)
    return DeviceTier(store, device, tables, fallback)
