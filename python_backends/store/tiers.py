"""What the tiered store's lookups pass around: the tiers, a snapshot, a lookup's result, the counters.

The tiers in the order a host lookup tries them (:data:`TIERS`, their indexes :data:`L1` ...
:data:`DEFAULT`; :data:`DEVICE` for a device step's resident tables), the :class:`Snapshot` a
batch reads, the :class:`Lookup` it returns, the :class:`StoreStats` it counts into, and what the
store needs of an L3 tier (:class:`RemoteTier`). The store itself is
:class:`~recserve.backends.store.tiered.TieredStore`, which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from recserve.backends.base.metrics import MetricSample
from recserve.backends.store.hot_cache import HotCache
from recserve.backends.store.table_data import RowBlock

TIERS = ("l1", "delta", "l2", "l3", "default", "device")
#: ``device``: a table resident on the step's device (:mod:`.device.tier`), searched before the host
#: tiers there; listed last so the host tiers keep their indexes.
L1, DELTA, L2, L3, DEFAULT, DEVICE = range(len(TIERS))


@dataclass(frozen=True)
class Snapshot:
    """One consistent state of every table: versions, delta rows, and the L1 cache built for them."""

    versions: tuple[int, ...]  # by table id
    delta: RowBlock | None = None
    cache: HotCache | None = None


class RemoteTier(Protocol):
    """What the store needs of an L3 tier (see :mod:`recserve.backends.store.redis_tier`)."""

    def fetch(self, keys: np.ndarray, dim: int, widths: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Vectors ``[n, dim]``, found mask ``[n]``; never raises; rows not ``widths`` wide are not found."""

    def fetch_bulk(
        self, keys: np.ndarray, dim: int, widths: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
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
    #: counts kept elsewhere (a device tier's, on its device): each call returns ``[tables, tiers]``
    #: counted since its last call; :meth:`flush` adds them here, off the request path
    pending: list[Callable[[], np.ndarray]] = field(default_factory=list)

    MAX_LATENCIES = 100_000

    def flush(self) -> None:
        """Add the counts kept elsewhere (:attr:`pending`) to :attr:`by_table_tier`."""
        for take in self.pending:
            self.by_table_tier += take()

    def drain_latencies(self) -> list[float]:
        """Latencies recorded since the last call."""
        taken, self.latencies = self.latencies, []
        return taken
