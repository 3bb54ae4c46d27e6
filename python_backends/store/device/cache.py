"""L1 on a torch device: the hot rows mirrored where the dense step runs, so hits never leave it.

On a GPU instance (config profile ``cuda``) the embedding step keeps the current snapshot's
:class:`~recserve.backends.store.hot_cache.HotCache` as two device tensors (slot keys and vectors, the same
bytes as the host cache). A batch's keys go to the device once; the slot function, the hit mask and
the gather of the hit rows run there. Only the misses (the cold tail) go through the host tiers
(:meth:`TieredStore.lookup <recserve.backends.store.tiered.TieredStore.lookup>`: delta, L2, L3, default)
and are scattered into the device result, which stays on the device for the dense step::

    keys (host) ──► device: slot ─► slot_keys[slot] == key ─► vectors[slot] ─┐
                      │ miss positions (host)                                 ├─► [n, dim] on the device
                      └─► TieredStore.lookup(keys[miss]) ─► copy, scatter ───┘

The mirror follows the store's snapshot: :meth:`DeviceL1.follow` copies a new L1 (after
``refresh_cache`` or ``install``) on the store's upkeep thread, right after the round that made it;
a lookup that finds a new L1 before that copies it itself (once). A batch uses one snapshot for its
hits and its misses; if an update lands between the two, the batch is redone on the new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from recserve.backends.base.device_copies import DeviceCopies
from recserve.backends.store.hot_cache import HotCache
from recserve.backends.store.keyindex import GOLDEN
from recserve.backends.store.tiered import L1, Snapshot, TieredStore
from recserve.core.names import EMBEDDING_LOOKUP

LOGGER = logging.getLogger(__name__)

#: :data:`~recserve.backends.store.keyindex.GOLDEN` as the int64 with the same bits
#: (torch has no uint64 arithmetic).
GOLDEN_INT64 = int(np.array(GOLDEN, np.uint64).view(np.int64))
LOW_32_BITS = 0xFFFFFFFF
#: Attempts to serve a batch on one snapshot while updates land, before the host path serves it whole.
ATTEMPTS = 3
#: Values of the embedding step's ``l1_device`` config parameter
#: (:data:`recserve.core.names.L1_DEVICE_PARAMETER`).
L1_DEVICES = ("cpu", "cuda")


def slot_of(keys: torch.Tensor, slots: int) -> torch.Tensor:
    """:meth:`HotCache.slot_of` in int64 torch ops, bit for bit.

    The product wraps modulo 2**64 as the uint64 one does; the arithmetic right shift is made logical
    by keeping the low 32 bits, and ``high * slots`` (below 2**32 * slots) cannot overflow.

    Args:
        keys: int64 keys, on any device.
        slots: slots of the cache (below 2**31).

    Returns:
        int64 slot of each key, on the keys' device.
    """
    if not 0 < slots < 1 << 31:
        raise ValueError(f"slots must be in 1..2**31-1, got {slots}")
    high = torch.bitwise_and(torch.bitwise_right_shift(keys * GOLDEN_INT64, 32), LOW_32_BITS)
    return torch.bitwise_right_shift(high * slots, 32)


def resolve_device(setting: str, instance_device: str) -> str:
    """The torch device of the L1 mirror, from the embedding step's ``l1_device`` config parameter.

    Args:
        setting: ``cpu``, or ``cuda`` (the instance's GPU).
        instance_device: ``cpu`` or ``cuda:N``, where Triton placed the instance.

    Raises:
        ValueError: an unknown setting, or ``cuda`` for an instance that is not on a GPU.
    """
    if setting not in L1_DEVICES:
        raise ValueError(f"l1_device {setting!r} is not one of {L1_DEVICES}")
    if setting == "cuda" and not instance_device.startswith("cuda"):
        raise ValueError(
            "l1_device 'cuda' needs a KIND_GPU instance (serve with --profile cuda on a GPU machine)"
        )
    return instance_device if setting == "cuda" else "cpu"


@dataclass(frozen=True)
class DeviceMirror:
    """One :class:`HotCache` copied to a device: its slot keys and vectors.

    The cached-key list stays on the host.
    """

    source: HotCache
    slot_keys: torch.Tensor  # int64 [slots]
    vectors: torch.Tensor  # float32 [slots, dim]

    @classmethod
    def of(cls, cache: HotCache, device: torch.device) -> DeviceMirror:
        """Copy ``cache`` to ``device``."""
        return cls(
            cache, torch.from_numpy(cache.slot_keys).to(device), torch.from_numpy(cache.vectors).to(device)
        )

    @property
    def slots(self) -> int:
        """Slots of the cache."""
        return int(self.slot_keys.shape[0])

    @property
    def nbytes(self) -> int:
        """Device bytes of the mirror."""
        return (
            self.slot_keys.numel() * self.slot_keys.element_size()
            + self.vectors.numel() * self.vectors.element_size()
        )


@dataclass(frozen=True)
class DeviceLookup:
    """Result of one batch: vectors on the device, the tier that served each key, the snapshot used."""

    vectors: torch.Tensor  # float32 [n, dim], on the device
    #: int8 [n], indexes store.TIERS; on the device where every key was answered there (DeviceTier)
    tiers: np.ndarray | torch.Tensor
    snapshot: Snapshot
    #: the keys sent on to the host tiers, on the host (where the keys came to the step on the device)
    fallback_keys: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


def first_whole(attempt: Callable[[], DeviceLookup | None]) -> DeviceLookup | None:
    """The first of :data:`ATTEMPTS` tries that read one snapshot whole; None when updates kept landing."""
    for _ in range(ATTEMPTS):
        served = attempt()
        if served is not None:
            return served
    LOGGER.debug("snapshot changed %d times during one batch; served by the host path", ATTEMPTS)
    return None


class DeviceL1:
    """:meth:`TieredStore.lookup` with L1 on a torch device and the result left there.

    Same arguments, same vectors bit for bit, same tiers and counters as the host path; only where
    the hits are read and where the result lives differ.

    Args:
        store: the host store (its snapshot, tiers, counters and key frequencies).
        device: ``cpu``, ``cuda`` or ``cuda:N``.
    """

    def __init__(
        self, store: TieredStore, device: str | torch.device, copies: DeviceCopies | None = None
    ) -> None:
        self.store = store
        self.device = torch.device(device)
        #: the host-device bytes of every batch (the mirror's copies are upkeep, not counted)
        self.copies = copies or DeviceCopies(EMBEDDING_LOOKUP)
        self._mirror: DeviceMirror | None = None
        self._lock = threading.Lock()
        self.mirror_for(store.snapshot.cache)  # the preloaded L1 goes to the device before the first batch

    def mirror_for(self, cache: HotCache | None) -> DeviceMirror | None:
        """The device copy of ``cache``, made on first use (once, whichever thread asks first)."""
        if cache is None:  # no L1 rows in this snapshot: nothing to keep on the device
            self._mirror = None
            return None
        mirror = self._mirror
        if mirror is not None and mirror.source is cache:
            return mirror
        with self._lock:
            if self._mirror is None or self._mirror.source is not cache:
                self._mirror = None  # release the old copy before making the new one
                self._mirror = DeviceMirror.of(cache, self.device)
                LOGGER.info(
                    "L1 mirrored to %s: %d rows, %d bytes", self.device, len(cache.keys), self._mirror.nbytes
                )
            return self._mirror

    @property
    def mirror(self) -> DeviceMirror | None:
        """The device copy made last (None while the store has no L1 rows)."""
        return self._mirror

    def follow(self) -> None:
        """Copy the store's current L1 to the device now (the upkeep thread calls this after each round)."""
        self.mirror_for(self.store.snapshot.cache)

    def lookup(self, keys: np.ndarray, table_ids: np.ndarray, record: bool = True) -> DeviceLookup:
        """Vectors of ``keys`` (flat int64) whose tables are ``table_ids`` (same length), on the device."""
        started = time.perf_counter()
        keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        table_ids = np.ascontiguousarray(table_ids, dtype=np.int16).reshape(-1)
        served = first_whole(lambda: self._serve(keys, table_ids))
        if served is None:  # updates kept landing mid-batch: the host path reads one snapshot by itself
            served = self._host(keys, table_ids)
        if record:
            self.store.record_lookup(keys, table_ids, np.asarray(served.tiers), time.perf_counter() - started)
        return served

    def _serve(self, keys: np.ndarray, table_ids: np.ndarray) -> DeviceLookup | None:
        """One attempt on the current snapshot; None when an update landed before the misses were read."""
        snapshot = self.store.snapshot
        mirror = self.mirror_for(snapshot.cache)
        if mirror is None:  # no L1 rows: every key is a miss
            return self._host(keys, table_ids)
        device_keys = torch.from_numpy(keys).to(self.device)
        slots = slot_of(device_keys, mirror.slots)
        hit = mirror.slot_keys.index_select(0, slots) == device_keys
        vectors = mirror.vectors.index_select(0, slots)  # one gather for the batch; misses overwritten below
        miss = np.flatnonzero(~hit.cpu().numpy())
        self.copies.to_device(keys.nbytes)
        self.copies.to_host(keys.size)  # the hit mask, a byte per key
        tiers = np.full(keys.size, L1, np.int8)
        if miss.size:
            rest = self.store.lookup(keys[miss], table_ids[miss], record=False)
            if rest.snapshot is not snapshot:
                return None
            tiers[miss] = rest.tiers
            self.copies.to_device(miss.nbytes + rest.vectors.nbytes)
            vectors.index_copy_(
                0, torch.from_numpy(miss).to(self.device), torch.from_numpy(rest.vectors).to(self.device)
            )
        return DeviceLookup(vectors, tiers, snapshot)

    def _host(self, keys: np.ndarray, table_ids: np.ndarray) -> DeviceLookup:
        """The whole batch through the host path (one snapshot), copied to the device."""
        result = self.store.lookup(keys, table_ids, record=False)
        self.copies.to_device(result.vectors.nbytes)
        return DeviceLookup(torch.from_numpy(result.vectors).to(self.device), result.tiers, result.snapshot)
