"""L3 against a real Redis Cluster on loopback (3 masters + 3 replicas, Debian's redis-server)."""

import dataclasses
import shutil
import signal
import threading
import time

import numpy as np
import pytest

from recserve.backends.store import redis_tier
from recserve.backends.store.redis_tier import L3ConnectError, RedisTier, redis_keys
from recserve.backends.store.table_data import TableArrays
from recserve.backends.store.tiered import DEFAULT, L2, L3, TieredStore
from recserve.core.sections.serving import StoreSection
from recserve.perf.harness.redis_cluster import RedisCluster
from tests.store_tables import DIM, make_tables


@pytest.fixture
def cluster(tmp_path):
    with RedisCluster(tmp_path / "redis") as running:
        yield running


def stores(cluster, deadline_ms=200.0, cooldown_s=0.5):
    """The same tables twice: all in L2, and with ``t1`` only in L3."""
    tables = make_tables(rows=(400, 3000))
    options = cluster.store_section(redis_deadline_ms=deadline_ms, breaker_cooldown_s=cooldown_s)
    tier = RedisTier.connect(options)
    t1 = tables["t1"]
    assert tier.upload(t1.keys, t1.vectors) == len(t1.keys)
    cluster.wait_replicated()  # a failover must keep the rows: the replicas hold them first
    local = {
        **tables,
        "t1": TableArrays("t1", np.empty(0, np.int64), np.empty((0, DIM), np.float32), t1.default),
    }
    return tables, TieredStore.from_tables(tables), TieredStore.from_tables(local, remote=tier), tier


def batch(store, tables, rng, size=256):
    keys = np.concatenate(
        [
            rng.choice(tables["t0"].keys, 32),
            rng.choice(tables["t1"].keys, size - 40),
            rng.integers(1, 1 << 60, 8),
        ]
    )
    ids = np.array([store.table_id("t0")] * 32 + [store.table_id("t1")] * (size - 32))
    return keys, ids


def test_lookups_through_l3_equal_l2(cluster):
    tables, full, remote, tier = stores(cluster)
    keys, ids = batch(full, tables, np.random.default_rng(0))
    want, got = full.lookup(keys, ids), remote.lookup(keys, ids)
    assert np.array_equal(got.vectors, want.vectors)
    assert (
        (got.tiers[:32] == L2).all() and (got.tiers[32:-8] == L3).all() and (got.tiers[-8:] == DEFAULT).all()
    )
    assert tier.errors == {"timeout": 0, "error": 0, "breaker_open": 0, "busy": 0, "bad_value": 0}


def test_an_l1_rebuild_reads_l3_rows_in_bulk_off_the_serving_calls(cluster):
    tables, full, remote, tier = stores(cluster, deadline_ms=5.0)
    hot = tables["t1"].keys[:2500]  # one read far larger than a serving call's deadline allows
    assert remote.refresh_cache(seed=hot) > 0
    cache = remote.snapshot.cache
    assert np.isin(cache.keys, hot).all() and len(cache.keys) > 1000
    ids = np.full(len(cache.keys), remote.table_id("t1"))
    assert np.array_equal(
        remote.resolve(cache.keys, None)[0], full.lookup(cache.keys, ids, record=False).vectors
    )
    assert tier.calls == 0 and tier.errors == {
        "timeout": 0,
        "error": 0,
        "breaker_open": 0,
        "busy": 0,
        "bad_value": 0,
    }
    got = remote.lookup(cache.keys, ids)  # served from L1: no L3 call at all
    assert (got.tiers == 0).all() and tier.calls == 0


def test_killing_a_master_mid_traffic_fails_no_lookup_and_recovers(cluster):
    tables, full, remote, tier = stores(cluster)
    rng = np.random.default_rng(1)
    outcomes, failures, stop = [], [], threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            keys, ids = batch(full, tables, rng)
            try:
                got = remote.lookup(keys, ids)
            except Exception as exc:  # a lookup must never fail for L3
                failures.append(repr(exc))
                continue
            served = got.tiers == L3
            # every key is either the right row from L3 or its table's default: never a wrong row
            right = np.all(got.vectors == full.lookup(keys, ids, record=False).vectors, axis=1)
            outcomes.append(
                (time.monotonic(), bool(np.all(right | ~served)), int((got.tiers[32:-8] == DEFAULT).sum()))
            )
            time.sleep(0.005)

    worker = threading.Thread(target=traffic)
    worker.start()
    time.sleep(0.5)
    killed_at = time.monotonic()
    victim = cluster.masters()[0]
    cluster.kill(victim)
    deadline = time.monotonic() + 30
    while victim in cluster.masters() and time.monotonic() < deadline:  # until a replica is promoted
        time.sleep(0.1)
    cluster.wait_ok(timeout_s=30)
    recovered_at = time.monotonic()
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline and (
        not outcomes or outcomes[-1][0] < recovered_at or outcomes[-1][2] > 0
    ):
        time.sleep(0.2)
    stop.set()
    worker.join()
    timeline = [(round(at - killed_at, 2), missed) for at, _, missed in outcomes]
    assert failures == [], timeline
    assert all(ok for _, ok, _ in outcomes)
    during = [missed for at, _, missed in outcomes if killed_at <= at <= recovered_at]
    assert sum(during) > 0 and sum(tier.errors.values()) > 0  # the outage was seen and counted
    assert outcomes[-1][2] == 0, (
        f"L3 did not recover after the replica took over: errors {tier.errors}, "
        f"breaker {tier.breaker.state}, "
        f"masters {cluster.masters()} of {cluster.ports} (killed {victim}), last misses {timeline[-20:]}"
    )


def test_all_redis_down_opens_the_breaker_and_stops_paying_the_deadline(cluster):
    tables, full, remote, tier = stores(cluster, deadline_ms=50.0, cooldown_s=60.0)
    keys, ids = batch(full, tables, np.random.default_rng(2))
    remote.lookup(keys, ids)
    for port in list(cluster.processes):
        cluster.kill(port)
    for _ in range(tier.breaker.failures):
        got = remote.lookup(keys, ids)  # each pays at most the deadline, then serves defaults
        assert (got.tiers[32:-8] == DEFAULT).all()
    assert not tier.healthy() and tier.breaker.state == "open", tier.errors
    calls = tier.calls
    started = time.perf_counter()
    for _ in range(20):
        got = remote.lookup(keys, ids)
    assert tier.calls == calls  # the open breaker sends nothing to Redis
    assert tier.errors["breaker_open"] == 20
    assert np.array_equal(got.vectors[:32], full.lookup(keys[:32], ids[:32]).vectors)  # L2 keys unaffected
    assert (time.perf_counter() - started) / 20 < tier.deadline_s  # not paying the deadline any more


def test_l3_serves_again_after_the_whole_cluster_restarts_even_with_a_tight_deadline(cluster):
    tables, full, remote, tier = stores(cluster, deadline_ms=5.0, cooldown_s=0.2)
    keys, ids = batch(full, tables, np.random.default_rng(3), size=72)
    cluster.kill_all()
    for _ in range(tier.breaker.failures + 2):
        remote.lookup(keys, ids)
    assert tier.breaker.state != "closed", tier.errors
    cluster.restart()
    loader = RedisTier.connect(cluster.store_section(redis_deadline_ms=10_000.0))
    loader.upload(tables["t1"].keys, tables["t1"].vectors)  # the nodes came back empty
    loader.close()
    # a machine whose cores slept is slow at its first call after an idle spell: the trial after
    # each cooldown comes cold, and must still close the breaker
    mget, last = tier.client.mget_nonatomic, [time.monotonic()]

    def cold_mget(names):
        if time.monotonic() - last[0] > 0.1:
            time.sleep(0.02)
        try:
            return mget(names)
        finally:
            last[0] = time.monotonic()

    tier.client.mget_nonatomic = cold_mget
    deadline = time.monotonic() + 30
    while not (remote.lookup(keys, ids).tiers[32:-8] == L3).all():
        assert time.monotonic() < deadline, f"L3 never served again: {tier.errors}"
        time.sleep(0.01)
    assert tier.healthy()


def test_updates_travel_through_the_redis_stream_to_another_machines_log(cluster, tmp_path):
    from recserve.backends.store.updates.stream import UpdateStream
    from recserve.backends.store.updates.versions import StoreUpdater, UpdateLog

    tables = make_tables()
    tier = RedisTier.connect(cluster.store_section(redis_deadline_ms=500.0))
    here, there = UpdateLog(tmp_path / "here", 1), UpdateLog(tmp_path / "there", 1)
    sender, receiver = UpdateStream(tier.client, here), UpdateStream(tier.client, there)
    remote_store = TieredStore.from_tables(tables)
    updater = StoreUpdater(remote_store, there)
    keys = tables["t0"].keys[:5]
    ids = np.full(5, remote_store.table_id("t0"))
    original = remote_store.lookup(keys, ids).vectors
    sender.publish("t0", here.publish("t0", keys, np.full((5, DIM), 3, np.float32), DIM))
    assert receiver.mirror() == 1 and updater.poll()
    assert (remote_store.lookup(keys, ids).vectors == 3).all() and remote_store.version_of("t0") == 2
    sender.publish("t0", here.rollback("t0", 1))
    assert receiver.mirror() == 1 and updater.poll()
    assert (
        np.array_equal(remote_store.lookup(keys, ids).vectors, original)
        and remote_store.version_of("t0") == 3
    )
    assert receiver.mirror() == 0  # nothing new; versions already here are not written twice
    assert UpdateStream(tier.client, there).mirror() == 0


def test_garbage_written_into_redis_costs_its_own_keys_alone(cluster):
    tables, full, remote, tier = stores(cluster)
    keys, ids = batch(full, tables, np.random.default_rng(4))
    t1 = keys[32:-8]
    garbage = {  # what a careless or hostile writer leaves under six of t1's keys
        "short": np.ones(DIM - 1, np.float32).tobytes(),
        "long": np.ones(DIM + 1, np.float32).tobytes(),
        "empty": b"",
        "odd length": b"\x00" * (4 * DIM - 1),
        "nan": np.array([1, np.nan] + [0] * (DIM - 2), np.float32).tobytes(),
        "inf": np.array([np.inf] * DIM, np.float32).tobytes(),
    }
    names = redis_keys(t1[: len(garbage) + 1])
    tier.client.mset_nonatomic(dict(zip(names, garbage.values(), strict=False)))
    tier.client.delete(names[-1])
    tier.client.hset(names[-1], "vector", b"\x00" * 4 * DIM)  # another type: MGET reads it as absent
    spoilt = np.isin(keys, t1[: len(garbage) + 1])

    got = remote.lookup(keys, ids)  # never raises: every key is served, the spoilt ones by their default

    want = full.lookup(keys, ids, record=False).vectors
    assert (got.tiers[spoilt] == DEFAULT).all()
    assert (got.vectors[spoilt] == tables["t1"].default).all()
    assert np.array_equal(got.vectors[~spoilt], want[~spoilt])  # every other key: its own row
    assert (got.tiers[32:-8][~spoilt[32:-8]] == L3).all() and (got.tiers[:32] == L2).all()
    assert tier.errors == {"timeout": 0, "error": 0, "breaker_open": 0, "busy": 0, "bad_value": len(garbage)}
    assert tier.healthy()  # bad values are the writer's fault, not an L3 outage: the breaker stays closed


def test_the_cluster_requires_its_password_and_a_refusal_is_a_clear_error(cluster, monkeypatch):
    assert cluster.password and cluster.password_env
    with pytest.raises(L3ConnectError, match=r"refused the default user with no password") as missing:
        RedisTier.connect(StoreSection(redis_nodes=tuple(cluster.nodes)))
    monkeypatch.setenv("WRONG_REDIS_PASSWORD", "not-" + cluster.password)
    with pytest.raises(L3ConnectError, match=r"with the password in \$WRONG_REDIS_PASSWORD") as wrong:
        RedisTier.connect(cluster.store_section(redis_password_env="WRONG_REDIS_PASSWORD"))
    monkeypatch.delenv(cluster.password_env)
    with pytest.raises(L3ConnectError, match=f"names {cluster.password_env}, which is not set"):
        RedisTier.connect(cluster.store_section())
    for refused in (missing, wrong):
        assert cluster.password not in str(refused.value) and "\n" not in str(refused.value)


def _pause(cluster, sig):
    for process in cluster.processes.values():
        process.send_signal(sig)


def test_a_cluster_answering_late_at_load_is_connected_to_again(cluster, monkeypatch):
    """Every node stopped (a busy machine) when the tier connects: the slot map times out under the
    5 ms deadline; the nodes go on when the tier pauses to connect again, and it then connects."""
    options = cluster.store_section(redis_deadline_ms=5.0)
    pauses = []

    def pause(seconds):
        pauses.append(seconds)
        _pause(cluster, signal.SIGCONT)

    _pause(cluster, signal.SIGSTOP)
    try:
        with monkeypatch.context() as patched:  # time.sleep of the connect only
            patched.setattr(redis_tier.time, "sleep", pause)
            tier = RedisTier.connect(options)
    finally:
        _pause(cluster, signal.SIGCONT)
    assert pauses == [redis_tier.STARTUP_BACKOFF_S]
    tier.deadline_s = 1.0
    assert tier.upload(np.array([7], np.int64), np.ones((1, DIM), np.float32)) == 1
    vectors, found = tier.fetch(np.array([7], np.int64), DIM)
    assert found.all() and vectors.min() == 1.0
    monkeypatch.setattr(redis_tier, "STARTUP_ATTEMPTS", 1)  # without connecting again: the load fails
    _pause(cluster, signal.SIGSTOP)
    try:
        with pytest.raises(L3ConnectError, match="no node of the Redis Cluster .* answered"):
            RedisTier.connect(options)
    finally:
        _pause(cluster, signal.SIGCONT)
    assert pauses == [redis_tier.STARTUP_BACKOFF_S]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test cluster's certificates")
def test_l3_over_tls_serves_and_a_plain_connection_is_refused(tmp_path):
    with RedisCluster(tmp_path / "tls", tls=True) as secure:
        options = secure.store_section(redis_deadline_ms=1000.0)
        assert options.redis_ssl and options.redis_ssl_ca_certs and options.redis_password_env
        tier = RedisTier.connect(options)
        try:
            tables = make_tables()
            t1 = tables["t1"]
            tier.upload(t1.keys, t1.vectors)
            vectors, found = tier.fetch(t1.keys, DIM)
            assert found.all() and np.array_equal(vectors, t1.vectors)
        finally:
            tier.close()
        with pytest.raises(L3ConnectError, match="no node of the Redis Cluster .* answered"):  # TLS only
            RedisTier.connect(dataclasses.replace(options, redis_ssl=False, redis_ssl_ca_certs=""))


def test_each_l3_row_is_checked_against_its_own_tables_width(cluster):
    rng = np.random.default_rng(5)
    wide = TableArrays(
        "wide",
        np.arange(1, 41, dtype=np.int64),
        rng.normal(size=(40, DIM)).astype(np.float32),
        np.full(DIM, 3, np.float32),
    )
    narrow = TableArrays(
        "narrow",
        np.arange(100, 130, dtype=np.int64),
        rng.normal(size=(30, 2)).astype(np.float32),
        np.full(2, 5, np.float32),
    )
    tier = RedisTier.connect(cluster.store_section(redis_deadline_ms=500.0))
    tier.upload(narrow.keys, narrow.vectors)  # the narrow table lives only in L3, at its own width
    stray = np.array([999], np.int64)  # a key of the wide table that L2 does not hold
    tier.upload(stray, np.full((1, 2), 7, np.float32))  # ...under which a writer left a narrow row
    local = {
        "wide": wide,
        "narrow": TableArrays("narrow", np.empty(0, np.int64), np.empty((0, 2), np.float32), narrow.default),
    }
    store = TieredStore.from_tables(local, remote=tier)
    keys = np.array([1, 100, 101, 999], np.int64)
    ids = np.array([store.table_id(n) for n in ("wide", "narrow", "narrow", "wide")])
    got = store.lookup(keys, ids)
    assert got.tiers.tolist() == [L2, L3, L3, DEFAULT]
    assert np.array_equal(got.vectors[1:3, :2], narrow.vectors[:2]) and not got.vectors[1:3, 2:].any()
    assert (got.vectors[3] == 3).all() and tier.errors["bad_value"] == 1
    assert store.refresh_cache(seed=keys[1:3]) == 2  # the L1 rebuild (no table known) takes narrow rows
    assert np.array_equal(store.lookup(keys[1:3], ids[1:3]).vectors, got.vectors[1:3])
