"""The store as one served model instance runs it: tiers, update log, upkeep thread, metrics.

``<model folder>/updates/`` (next to the numbered version folders) holds the update log of
:mod:`recserve.backends.store.updates.versions` and the recorded hot keys; every instance of the
model reads it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recserve.backends.base.metrics import MetricSample
from recserve.backends.store.tiered import TIERS, TieredStore
from recserve.backends.store.updates.versions import Maintainer, StoreUpdater, UpdateLog
from recserve.core.spec.model import ModelSpec

LOGGER = logging.getLogger(__name__)

UPDATES_FOLDER = "updates"


def updates_dir(version_dir: Path) -> Path:
    """The update log of a model, from one of its version folders."""
    return version_dir.parent / UPDATES_FOLDER


@dataclass
class ServedStore:
    """A loaded store with its updater and upkeep thread."""

    store: TieredStore
    updater: StoreUpdater
    maintainer: Maintainer
    lookup_p99_s: float = 0.0  # of the batches since the last samples() that had any (idle: kept)

    @classmethod
    def open(cls, spec: ModelSpec, version_dir: Path, start: bool = True) -> ServedStore:
        """Map the shards, connect L3 if configured, apply published updates, warm L1 up."""
        options = spec.store
        remote = None
        if options.redis_nodes:
            from recserve.backends.store.redis_tier import RedisTier

            remote = RedisTier.connect(options)
        store = TieredStore.load(version_dir, spec, remote=remote)
        log_dir = updates_dir(version_dir)
        log = UpdateLog(log_dir, store.base_version, store.table_names)
        stream = None
        if remote is not None:
            from recserve.backends.store.updates.stream import UpdateStream

            stream = UpdateStream(remote.client, log)
        updater = StoreUpdater(store, log)
        maintainer = Maintainer(store, updater, log_dir, options.update_poll_s, stream)
        cached = maintainer.warm_up()
        LOGGER.info(
            "store ready: versions %s, %d hot rows preloaded, %s",
            updater.applied,
            cached,
            "compiled probe loops"
            if store.compiled
            else "numpy path (the compiled probe loops are not built)",
        )
        served = cls(store, updater, maintainer)
        if start:
            maintainer.start()
        return served

    def close(self) -> None:
        """Stop the upkeep thread."""
        self.maintainer.stop()

    def rejected_updates(self) -> int:
        """Versions, heads and stream entries refused so far (each counted once)."""
        stream = self.maintainer.stream
        return self.updater.rejected + (stream.refused if stream is not None else 0)

    def version_samples(self) -> list[MetricSample]:
        """The served version and lag of each table, and the refused updates.

        Also published after every upkeep round, so a new version shows without a request.
        """
        store, out = self.store, []
        snapshot, lags = store.snapshot, self.updater.lag_seconds()
        for name in store.table_names:
            labels = (("table", name),)
            out.append(
                MetricSample(
                    "recserve_table_version",
                    "gauge",
                    "Version of each table being served",
                    labels,
                    float(store.version_of(name, snapshot)),
                )
            )
            out.append(
                MetricSample(
                    "recserve_table_update_lag_seconds",
                    "gauge",
                    "Seconds since the served version of each table was published",
                    labels,
                    lags[name],
                )
            )
        out.append(
            MetricSample(
                "recserve_store_updates_rejected_total",
                "counter",
                "Published versions, heads and stream entries refused (the newest valid version serves)",
                (),
                float(self.rejected_updates()),
            )
        )
        return out

    def samples(self) -> list[MetricSample]:
        """Current values of every store metric."""
        store, out = self.store, []
        store.stats.flush()  # the device tier's counts, read here (off the request path)
        for table_id, name in enumerate(store.table_names):
            for tier_id, tier in enumerate(TIERS):
                out.append(
                    MetricSample(
                        "recserve_embedding_keys_total",
                        "counter",
                        "Keys looked up, by table and by the tier that served them (default: unknown key)",
                        (("table", name), ("tier", tier)),
                        float(store.stats.by_table_tier[table_id, tier_id]),
                    )
                )
        latencies = store.stats.drain_latencies()
        if latencies:
            self.lookup_p99_s = float(np.quantile(latencies, 0.99))
        out += [
            MetricSample(
                "recserve_store_lookups_total", "counter", "Batches looked up", (), float(store.stats.calls)
            ),
            MetricSample(
                "recserve_store_lookup_seconds_total",
                "counter",
                "Seconds spent in batch lookups",
                (),
                store.stats.seconds,
            ),
            MetricSample(
                "recserve_store_lookup_p99_seconds",
                "gauge",
                "p99 batch lookup latency since the last publication that followed lookups",
                (),
                self.lookup_p99_s,
            ),
            MetricSample(
                "recserve_store_l1_rows",
                "gauge",
                "Rows in the L1 hot cache",
                (),
                float(len(store.hot_keys())),
            ),
            MetricSample(
                "recserve_store_compiled",
                "gauge",
                "1 when lookups run the compiled probe loops, 0 on the numpy path",
                (),
                float(store.compiled),
            ),
            MetricSample(
                "recserve_store_healthy",
                "gauge",
                "1 when every configured tier is healthy (0 while L3 fails: keys it holds get defaults)",
                (),
                float(store.healthy() and (store.remote is None or store.remote.healthy())),
            ),
        ]
        out += self.version_samples()
        if store.remote is not None:
            out += store.remote.samples()
        return out
