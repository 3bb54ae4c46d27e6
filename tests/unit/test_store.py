import json

import numpy as np
import pytest

from recserve.backends.base.artifacts import load_array, read_manifest, save_array, write_manifest
from recserve.backends.features.hashing import keys_for, table_salt
from recserve.backends.store.hot_cache import CLAIM_ROUNDS, FrequencyTracker, HotCache
from recserve.backends.store.keyindex import KeyIndex
from recserve.backends.store.shards import MANIFEST_FORMAT, write_shards
from recserve.backends.store.table_data import RowBlock, TableArrays
from recserve.backends.store.tiered import DEFAULT, DELTA, L1, L2, TieredStore
from recserve.core.sections.serving import StoreSection
from recserve.errors import ArtifactError
from tests.store_tables import DIM, make_tables


def expected(tables, name, keys):
    table = tables[name]
    where = {int(k): i for i, k in enumerate(table.keys)}
    return np.stack([table.vectors[where[int(k)]] if int(k) in where else table.default for k in keys])


def test_key_index_finds_every_key_and_only_them():
    rng = np.random.default_rng(1)
    keys = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=50_000, dtype=np.int64)
    keys = np.unique(keys)
    index = KeyIndex.build(keys, rows=np.arange(len(keys)))
    assert index.slot_keys.size >= len(keys) / 0.6 and index.overflow_keys.size < len(keys) * 0.05
    assert index.buckets.shape[1] * 8 == 96  # keys and rows of a bucket in one 96-byte row
    assert np.array_equal(index.find(keys), np.arange(len(keys)))
    absent = rng.integers(0, 1 << 62, size=1000, dtype=np.int64)
    absent = absent[~np.isin(absent, keys)]
    assert (index.find(absent) == -1).all()
    assert index.find(keys[:6].reshape(2, 3)).shape == (2, 3)


def test_key_index_refuses_duplicates():
    with pytest.raises(ValueError, match="unique"):
        KeyIndex.build(np.array([5, 5], np.int64))


def test_lookup_serves_each_table_and_its_own_default_for_unknown_keys():
    tables = make_tables()
    store = TieredStore.from_tables(tables)
    keys = np.concatenate([tables["t0"].keys[:5], [12345], tables["t1"].keys[:3], [12345]])
    ids = np.array([store.table_id("t0")] * 6 + [store.table_id("t1")] * 4)
    result = store.lookup(keys, ids)
    want = np.concatenate([expected(tables, "t0", keys[:6]), expected(tables, "t1", keys[6:])])
    assert np.array_equal(result.vectors, want)
    assert result.tiers.tolist() == [L2] * 5 + [DEFAULT] + [L2] * 3 + [DEFAULT]
    assert store.stats.by_table_tier[store.table_id("t0"), DEFAULT] == 1


def test_hot_keys_move_to_l1_with_identical_vectors():
    tables = make_tables()
    store = TieredStore.from_tables(
        tables, options=StoreSection(cache_mib=16)
    )  # no slot conflicts among 40 keys
    ids = np.zeros(40, np.int16) + store.table_id("t0")
    hot = tables["t0"].keys[:40]
    before = store.lookup(hot, ids).vectors
    for _ in range(3):
        store.lookup(hot[:10], ids[:10])
    assert store.refresh_cache() == 40
    after = store.lookup(hot, ids)
    assert (after.tiers == L1).all() and np.array_equal(after.vectors, before)
    assert set(store.hot_keys()[:10].tolist()) == set(hot[:10].tolist())  # most frequent first


def test_cache_is_bounded_in_bytes():
    tables = make_tables()
    budget = 64 * (DIM * 4 + 16)
    store = TieredStore.from_tables(tables, options=StoreSection(cache_mib=budget / (1 << 20)))
    store.lookup(tables["t0"].keys, np.zeros(500, np.int16))
    cached = store.refresh_cache()
    assert store.cache_slots == 64 and 0.5 * 64 < cached <= 64  # direct-mapped: some slots stay empty
    assert store.snapshot.cache.nbytes <= budget
    result = store.lookup(tables["t0"].keys, np.zeros(500, np.int16))
    assert (result.tiers == L1).sum() == cached and np.array_equal(result.vectors, tables["t0"].vectors)


def test_installed_delta_wins_over_l2_and_l1_is_rebuilt_for_it():
    tables = make_tables()
    store = TieredStore.from_tables(tables)
    keys = tables["t1"].keys[:4]
    ids = np.full(4, store.table_id("t1"))
    store.refresh_cache(seed=keys)
    delta = RowBlock.of(keys[:2], np.full((2, DIM), 7, np.float32))
    snapshot = store.install({"t1": 2}, delta)
    result = store.lookup(keys, ids)
    assert (result.vectors[:2] == 7).all() and np.array_equal(
        result.vectors[2:], expected(tables, "t1", keys[2:])
    )
    assert (result.tiers == L1).all()  # the rebuilt cache holds the new rows
    assert store.version_of("t1", snapshot) == 2 and store.version_of("t0") == 1
    store.refresh_cache(seed=np.empty(0, np.int64))
    assert store.lookup(keys, ids).tiers.tolist() == [DELTA, DELTA, L2, L2]


def test_float16_tables_are_served_as_float32_within_half_precision():
    tables = make_tables()
    store = TieredStore.from_tables(tables, dtypes={"t1": "float16"})
    keys = np.concatenate([tables["t0"].keys[:50], tables["t1"].keys[:50]])
    ids = np.repeat([store.table_id("t0"), store.table_id("t1")], 50)
    got = store.lookup(keys, ids).vectors
    assert got.dtype == np.float32
    assert np.array_equal(got[:50], tables["t0"].vectors[:50])
    assert np.allclose(got[50:], tables["t1"].vectors[:50], atol=2e-3)
    assert {s.dtype for s in store.shards} == {"float32", "float16"}


def test_keys_shared_between_tables_are_refused():
    tables = make_tables()
    clash = TableArrays(
        "t2", tables["t0"].keys[:1], np.zeros((1, DIM), np.float32), np.zeros(DIM, np.float32)
    )
    with pytest.raises(ArtifactError, match="share a key"):
        TieredStore.from_tables({**tables, "t2": clash})


def test_frequency_tracker_ranks_by_decayed_counts():
    tracker = FrequencyTracker(budget=1000, decay=0.5)
    tracker.record(np.array([1, 1, 1, 2, 2, 3]))
    assert tracker.hottest(2).tolist() == [1, 2]
    tracker.record(np.array([3, 3, 3, 3]))  # 3: 0.5 + 4 beats 1: 1.5
    assert tracker.hottest(1).tolist() == [3]
    assert tracker.hottest(0).size == 0  # a store without L1


def test_frequency_tracker_takes_empty_batches():
    """A device tier whose keys were made on the device records only those it sent to the host."""
    tracker = FrequencyTracker(budget=1000, decay=0.5)
    tracker.record(np.array([5, 5, 7], np.int64))
    assert tracker.hottest(2).tolist() == [5, 7]
    tracker.record(np.empty(0, np.int64))
    tracker.record(np.empty(0, np.int64))
    assert tracker.hottest(2).tolist() == [5, 7]  # the decayed counts, unchanged in order
    tracker.record(np.empty(0, np.int64))
    tracker.record(np.array([7, 7, 7], np.int64))
    assert tracker.hottest(2).tolist() == [7, 5]


def test_frequency_tracker_keeps_what_a_full_recount_keeps():
    rng = np.random.default_rng(3)
    tracker, limit = FrequencyTracker(budget=1 << 20, decay=0.5), 40
    counts: dict[int, float] = {}
    for _ in range(6):
        batch = rng.zipf(1.2, 3000).astype(np.int64)
        tracker.record(batch[:1000])
        tracker.record(batch[1000:])
        counts = {k: c * 0.5 for k, c in counts.items()}
        for key, times in zip(*np.unique(batch, return_counts=True), strict=True):
            counts[int(key)] = counts.get(int(key), 0.0) + float(times)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))  # ties at a cut: the lower keys
        counts = dict(ranked[: 2 * limit])
        hot = tracker.hottest(limit).tolist()
        assert set(hot) == {k for k, _ in ranked[:limit]}
        assert [counts[k] for k in hot] == [c for _, c in ranked[:limit]]  # hottest first


def test_an_l1_rebuild_copies_the_rows_it_holds_and_resolves_only_new_claimants():
    tables = make_tables()
    store = TieredStore.from_tables(tables, options=StoreSection(cache_mib=(64 * (DIM * 4 + 16)) / (1 << 20)))
    keys = tables["t0"].keys
    before = store.build_cache(keys[:100], None)
    asked: list[int] = []
    resolve = store.resolve
    store.resolve = lambda k, delta: (asked.append(k.size), resolve(k, delta))[1]  # type: ignore[method-assign]
    hot = np.concatenate([keys[50:60], keys[:100]])  # a new order: some slots change hands
    scratch = store.build_cache(hot, None)
    fresh = sum(asked)
    asked.clear()
    again = store.build_cache(hot, None, known=before)
    assert np.array_equal(again.slot_keys, scratch.slot_keys) and np.array_equal(
        again.vectors, scratch.vectors
    )
    assert np.array_equal(again.keys, scratch.keys)
    assert (
        fresh == len(scratch.keys) > sum(asked) == np.isin(scratch.keys, before.keys, invert=True).sum() > 0
    )


def test_a_hot_key_no_tier_holds_gives_its_l1_slot_to_the_next_claimant():
    tables = make_tables()
    store = TieredStore.from_tables(tables, options=StoreSection(cache_mib=(64 * (DIM * 4 + 16)) / (1 << 20)))
    keys = tables["t0"].keys
    slot = HotCache.slot_of(keys, 64)
    absent = np.arange(1, 1 << 20, dtype=np.int64)
    absent = absent[~np.isin(absent, np.concatenate([t.keys for t in tables.values()]))]
    home = HotCache.slot_of(absent, 64)
    target = int(slot[0])
    unknown = absent[home == target][: CLAIM_ROUNDS + 1]
    cache = store.build_cache(
        np.concatenate([unknown[:2], keys[slot == target][:1], keys[slot != target]]), None
    )
    assert cache.slot_keys[target] == keys[slot == target][0]  # two missing keys passed the slot on
    assert not np.isin(unknown, cache.keys).any()
    cache = store.build_cache(np.concatenate([unknown, keys[slot == target][:1]]), None)
    assert (
        cache.keys.size == 0
        and (store.lookup(unknown, np.zeros(unknown.size, np.int16)).tiers == DEFAULT).all()
    )


def test_shards_load_memory_mapped_and_serve_the_same_rows(spec, tmp_path):
    rng = np.random.default_rng(3)
    tables = {}
    for name in spec.tables:
        keys = np.unique(keys_for(rng.integers(0, 10**9, size=20), table_salt(spec.hashing.namespace, name)))
        tables[name] = TableArrays(
            name,
            keys,
            rng.normal(size=(len(keys), spec.model.embedding_dim)).astype(np.float32),
            np.zeros(spec.model.embedding_dim, np.float32),
        )
    write_manifest(tmp_path, {"format": MANIFEST_FORMAT, "version": 3, **write_shards(tmp_path, tables, {})})
    store = TieredStore.load(tmp_path, spec)
    assert isinstance(store.shards[0].vectors, np.memmap) and store.base_version == 3
    probe = tables["C7"].keys
    got = store.lookup(probe, np.full(len(probe), store.table_id("C7"))).vectors
    assert np.array_equal(got, tables["C7"].vectors)


def test_checksum_mismatch_is_refused(tmp_path):
    entry = save_array(tmp_path, "a.npy", np.arange(10, dtype=np.int64))
    assert load_array(tmp_path, entry).tolist() == list(range(10))
    np.save(tmp_path / "a.npy", np.arange(10, dtype=np.int64) + 1)
    with pytest.raises(ArtifactError, match="checksum"):
        load_array(tmp_path, entry)


def test_manifest_shape_lie_is_refused(tmp_path):
    entry = save_array(tmp_path, "a.npy", np.zeros((4, 2), np.float32))
    with pytest.raises(ArtifactError, match="manifest says"):
        load_array(tmp_path, {**entry, "shape": [2, 4]})


def test_paths_outside_the_model_folder_are_refused(tmp_path):
    (tmp_path / "inner").mkdir()
    save_array(tmp_path, "x.npy", np.zeros(2))
    entry = json.loads(json.dumps(save_array(tmp_path, "x.npy", np.zeros(2))))
    entry["path"] = "../x.npy"
    with pytest.raises(ArtifactError, match="outside"):
        load_array(tmp_path / "inner", entry)


def test_missing_manifest_says_how_to_build(tmp_path):
    with pytest.raises(ArtifactError, match="recserve build"):
        read_manifest(tmp_path)


def test_store_refuses_an_old_format_and_a_manifest_without_a_spec_table(spec, tmp_path):
    write_manifest(tmp_path, {"format": "recserve-embeddings/1", "version": 1, "tables": {}})
    with pytest.raises(ArtifactError, match="rebuild"):
        TieredStore.load(tmp_path, spec)
    write_manifest(tmp_path, {"format": MANIFEST_FORMAT, "version": 1, "shards": [], "tables": {}})
    with pytest.raises(ArtifactError, match="not in the manifest"):
        TieredStore.load(tmp_path, spec)


def test_empty_l1_slots_never_match():
    tables = make_tables()
    store = TieredStore.from_tables(tables, options=StoreSection(cache_mib=(64 * (DIM * 4 + 16)) / (1 << 20)))
    store.refresh_cache(seed=tables["t0"].keys[:3])
    probe = np.arange(0, 64, dtype=np.int64)  # 0 is what empty slots would hold without care
    assert (store.lookup(probe, np.zeros(64, np.int16)).tiers == DEFAULT).all()


def test_cluster_ports_and_their_bus_ports_lie_below_the_ephemeral_range():
    from recserve.perf.harness.redis_cluster import BUS_OFFSET, ephemeral_start, free_cluster_ports

    ports = free_cluster_ports(6)
    assert len(set(ports)) == 6
    assert all(1024 < p and p + BUS_OFFSET < ephemeral_start() for p in ports)
