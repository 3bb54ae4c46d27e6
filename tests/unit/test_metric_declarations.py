"""Every producer declares all its known label combinations, at 0 before any traffic.

The Triton publisher creates a series for each declared sample on its first publication (from the
models' ``initialize``), so these sets are what the metrics endpoint shows before the first request.
"""

import itertools

from recserve.backends.dense.buckets import BUCKET_EVENTS, PADDING_COUNTS, BucketCounters
from recserve.backends.store.redis_tier import L3_ERROR_REASONS, CircuitBreaker, RedisTier
from recserve.backends.store.served import ServedStore
from recserve.backends.store.tiered import TIERS, TieredStore
from recserve.backends.store.updates.versions import Maintainer, StoreUpdater, UpdateLog
from tests.store_tables import make_tables


def series(samples) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {(s.name, s.labels): s.value for s in samples}
    assert len(found) == len(samples), "a series is declared twice"
    return found


def test_bucket_counters_declare_every_event_and_padding_kind_at_zero():
    found = series(BucketCounters().samples())
    events = {labels[0][1] for name, labels in found if name == "recserve_dense_bucket_requests_total"}
    kinds = {labels[0][1] for name, labels in found if name == "recserve_dense_padding_total"}
    assert events == set(BUCKET_EVENTS) == {"hit", "miss", "fallback", "compile", "compile_failure"}
    assert kinds == set(PADDING_COUNTS)
    assert kinds == {"real_rows", "padding_rows", "real_positions", "padding_positions"}
    assert set(found.values()) == {0.0}


def test_counted_events_keep_the_others_declared():
    counters = BucketCounters()
    counters.add(hits=3)
    found = series(counters.samples())
    assert found[("recserve_dense_bucket_requests_total", (("event", "hit"),))] == 3
    assert found[("recserve_dense_bucket_requests_total", (("event", "fallback"),))] == 0


def test_l3_tier_declares_every_error_reason_at_zero():
    tier = RedisTier(client=None, deadline_s=0.01, breaker=CircuitBreaker(3, 1.0))  # samples() never calls it
    try:
        found = series(tier.samples())
    finally:
        tier._pool.shutdown(wait=False)
    reasons = {labels[0][1] for name, labels in found if name == "recserve_store_l3_errors_total"}
    assert reasons == set(L3_ERROR_REASONS) == {"timeout", "error", "breaker_open", "busy", "bad_value"}
    assert found[("recserve_store_l3_calls_total", ())] == 0
    assert found[("recserve_store_l3_breaker_open", ())] == 0
    assert all(value == 0 for (name, _), value in found.items() if name == "recserve_store_l3_errors_total")


def test_served_store_declares_every_table_tier_and_its_counters_at_zero(tmp_path):
    tables = make_tables()
    tier = RedisTier(client=None, deadline_s=0.01, breaker=CircuitBreaker(3, 1.0))
    store = TieredStore.from_tables(tables, remote=tier)
    log = UpdateLog(tmp_path / "updates", store.base_version)
    updater = StoreUpdater(store, log)
    served = ServedStore(store, updater, Maintainer(store, updater, tmp_path / "updates", 1.0))  # not started
    try:
        found = series(served.samples())
    finally:
        tier._pool.shutdown(wait=False)
    keys = {labels for name, labels in found if name == "recserve_embedding_keys_total"}
    assert keys == {(("table", t), ("tier", tier_name)) for t, tier_name in itertools.product(tables, TIERS)}
    assert set(TIERS) == {"l1", "delta", "l2", "l3", "default", "device"}
    for name in ("recserve_table_version", "recserve_table_update_lag_seconds"):
        assert {labels for n, labels in found if n == name} == {(("table", t),) for t in tables}
    for counter in (
        "recserve_store_lookups_total",
        "recserve_store_lookup_seconds_total",
        "recserve_store_updates_rejected_total",
        "recserve_store_l3_calls_total",
    ):
        assert found[(counter, ())] == 0
    reasons = {labels[0][1] for name, labels in found if name == "recserve_store_l3_errors_total"}
    assert reasons == set(L3_ERROR_REASONS)
    counters = [value for (name, _), value in found.items() if name.endswith("_total")]
    assert counters and set(counters) == {0.0}


def test_the_lookup_p99_gauge_keeps_its_value_through_idle_publications(tmp_path):
    store = TieredStore.from_tables(make_tables())
    log = UpdateLog(tmp_path / "updates", store.base_version)
    updater = StoreUpdater(store, log)
    served = ServedStore(store, updater, Maintainer(store, updater, tmp_path / "updates", 1.0))  # not started
    p99 = ("recserve_store_lookup_p99_seconds", ())
    assert series(served.samples())[p99] == 0.0
    store.stats.latencies.extend([0.002] * 50 + [0.009] * 2)
    busy = series(served.samples())[p99]
    assert 0.002 < busy <= 0.009
    assert series(served.samples())[p99] == busy  # no lookup since: the metrics thread publishes the same
