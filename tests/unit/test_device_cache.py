"""The device L1 against the host path: same vectors bit for bit, same tiers, same counters."""

import dataclasses

import numpy as np
import pytest
import torch

from recserve.backends.features.hashing import keys_for, table_salt
from recserve.backends.steps.lookup import EmbeddingLookup
from recserve.backends.store.device.cache import DeviceL1, resolve_device, slot_of
from recserve.backends.store.hot_cache import HotCache
from recserve.backends.store.served import ServedStore
from recserve.backends.store.table_data import RowBlock, TableArrays
from recserve.backends.store.tiered import DEFAULT, DELTA, L1, L2, TIERS, TieredStore
from recserve.backends.store.updates.versions import Maintainer, StoreUpdater, UpdateLog
from recserve.core.names import EMBEDDING_VERSION
from recserve.core.sections.serving import StoreSection
from tests.store_tables import DIM, make_tables
from tests.unit.helpers import DEVICES, SLOT_BYTES, SwapsMidBatch, warm, zipf_batch


def make_store(cache_slots=150):
    """Two tables (float32 and float16 shards); L1 smaller than the hot set, so every tier serves."""
    tables = make_tables(rows=(2000, 1500))
    store = TieredStore.from_tables(
        tables,
        dtypes={"t1": "float16"},
        options=StoreSection(cache_mib=(cache_slots * SLOT_BYTES) / (1 << 20)),
    )
    return tables, store


def assert_same(device_result, host_result):
    assert device_result.vectors.dtype == torch.float32
    assert np.array_equal(device_result.vectors.cpu().numpy(), host_result.vectors)  # bit for bit
    assert np.array_equal(device_result.tiers, host_result.tiers)
    assert device_result.snapshot is host_result.snapshot


@pytest.mark.parametrize("device", DEVICES)
def test_slot_function_is_bit_exact_with_the_host_one(device):
    rng = np.random.default_rng(7)
    keys = rng.integers(
        np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=200_000, dtype=np.int64, endpoint=True
    )
    keys[:5] = [0, -1, 1, np.iinfo(np.int64).min, np.iinfo(np.int64).max]
    assert (keys < 0).mean() > 0.4
    on_device = torch.from_numpy(keys).to(device)
    for slots in (1, 2, 3, 1000, 524_287, (1 << 31) - 1):
        assert np.array_equal(slot_of(on_device, slots).cpu().numpy(), HotCache.slot_of(keys, slots)), slots
    with pytest.raises(ValueError, match="slots"):
        slot_of(on_device, 1 << 31)


@pytest.mark.parametrize("device", DEVICES)
def test_device_lookup_equals_the_host_lookup_across_every_tier(device):
    tables, store = make_store()
    rng = np.random.default_rng(11)
    warm(store, tables, rng)
    hot = store.hot_keys()
    delta_keys = np.concatenate([hot[:10], tables["t0"].keys[-40:]])  # some cached, some cold
    store.install(
        {"t0": 2}, RowBlock.of(delta_keys, rng.normal(size=(len(delta_keys), DIM)).astype(np.float32))
    )
    device_l1 = DeviceL1(store, device)
    seen = np.zeros(len(TIERS), np.int64)
    for _ in range(10):
        keys, ids = zipf_batch(tables, rng, 1664)
        keys[:8] = delta_keys[-8:]  # cold delta rows in every batch
        got = device_l1.lookup(keys, ids, record=False)
        assert got.vectors.device.type == device
        assert_same(got, store.lookup(keys, ids, record=False))
        seen += np.bincount(got.tiers, minlength=len(TIERS))
    assert seen[L1] > seen[L2] > 0 and seen[DELTA] > 0 and seen[DEFAULT] > 0
    assert device_l1.mirror_for(store.snapshot.cache).nbytes <= store.options.cache_bytes


@pytest.mark.parametrize("device", DEVICES)
def test_mirror_follows_every_new_snapshot(device):
    tables, store = make_store()
    device_l1 = DeviceL1(store, device)
    keys = tables["t0"].keys[:30]
    ids = np.zeros(30, np.int16)
    assert device_l1.mirror_for(store.snapshot.cache) is None
    assert (device_l1.lookup(keys, ids).tiers == L2).all()  # no L1 yet: the host path serves all

    store.refresh_cache(seed=keys)
    got = device_l1.lookup(keys, ids, record=False)
    assert device_l1.mirror_for(store.snapshot.cache).source is store.snapshot.cache
    assert_same(got, store.lookup(keys, ids, record=False))
    assert (got.tiers == L1).mean() > 0.8

    new_rows = np.full((5, DIM), 3.5, np.float32)
    store.install({"t0": 2}, RowBlock.of(keys[:5], new_rows))  # L1 rebuilt with the delta rows
    got = device_l1.lookup(keys, ids, record=False)
    assert_same(got, store.lookup(keys, ids, record=False))
    assert np.array_equal(got.vectors[:5].cpu().numpy(), new_rows)

    store.refresh_cache(seed=np.empty(0, np.int64))  # an empty L1 releases the device copy
    got = device_l1.lookup(keys, ids, record=False)
    assert device_l1.mirror_for(store.snapshot.cache) is None
    assert_same(got, store.lookup(keys, ids, record=False))
    assert set(got.tiers.tolist()) == {DELTA, L2}


@pytest.mark.parametrize("device", DEVICES)
def test_counts_and_key_frequencies_match_the_host_path(device):
    tables, host = make_store()
    _, on_device = make_store()
    warm(host, tables, np.random.default_rng(3))
    warm(on_device, tables, np.random.default_rng(3))
    device_l1 = DeviceL1(on_device, device)
    rng = np.random.default_rng(5)
    for _ in range(8):
        keys, ids = zipf_batch(tables, rng, 1000)
        host.lookup(keys, ids)
        device_l1.lookup(keys, ids)
    assert np.array_equal(on_device.stats.by_table_tier, host.stats.by_table_tier)
    assert on_device.stats.by_table_tier[:, L1].sum() > 0
    assert on_device.stats.calls == host.stats.calls and len(on_device.stats.latencies) == len(
        host.stats.latencies
    )
    host.refresh_cache()
    on_device.refresh_cache()
    assert np.array_equal(on_device.hot_keys(), host.hot_keys())  # the device path fed the same frequencies


@pytest.mark.parametrize("swaps", [1, 4])  # 4: every attempt loses, the host path serves it
def test_a_batch_sees_one_snapshot_when_an_update_lands_mid_batch(swaps):
    tables = make_tables(rows=(2000, 1500))
    store = SwapsMidBatch.from_tables(tables, options=StoreSection(cache_mib=(100 * SLOT_BYTES) / (1 << 20)))
    keys = tables["t0"].keys[:400]  # hot ones cached, the rest missed
    ids = np.zeros(len(keys), np.int16)
    store.rows = keys
    store.refresh_cache(seed=keys[:100])
    device_l1 = DeviceL1(store, "cpu")
    store.swaps = swaps
    got = device_l1.lookup(keys, ids)
    assert store.swaps == 0
    values = np.unique(got.vectors.numpy())
    assert values.tolist() == [store.version_of("t0", got.snapshot)]  # every row of one version
    assert_same(got, store.lookup(keys, ids, record=False))
    assert store.stats.calls == 1 and store.stats.by_table_tier.sum() == len(keys)  # counted once


def test_device_setting_is_checked():
    assert resolve_device("cpu", "cuda:1") == "cpu"
    assert resolve_device("cuda", "cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match="KIND_GPU"):
        resolve_device("cuda", "cpu")
    with pytest.raises(ValueError, match="not one of"):
        resolve_device("tpu", "cpu")


def test_upkeep_copies_each_new_l1_to_the_device_before_any_lookup(tmp_path):
    tables, _ = make_store()
    store = TieredStore.from_tables(
        tables, options=StoreSection(cache_mib=(150 * SLOT_BYTES) / (1 << 20), cache_refresh_s=0.0)
    )
    served = served_store(store, tmp_path)
    device_l1 = DeviceL1(store, "cpu")
    served.maintainer.after_step.append(device_l1.follow)
    assert device_l1.mirror is None
    store.lookup(*zipf_batch(tables, np.random.default_rng(1), 2000))
    served.maintainer.step()  # rebuilds L1 from the recorded keys, then the hook copies it
    assert store.snapshot.cache is not None and device_l1.mirror.source is store.snapshot.cache
    before = device_l1.mirror
    served.maintainer.step()
    assert device_l1.mirror is not before and device_l1.mirror.source is store.snapshot.cache


def served_store(store, tmp_path):
    updater = StoreUpdater(store, UpdateLog(tmp_path / "log", 1))
    return ServedStore(store, updater, Maintainer(store, updater, tmp_path / "state", 60.0))


def spec_store(spec, rng):
    tables = {}
    for name in spec.tables:
        keys = np.unique(keys_for(rng.integers(0, 10**6, size=300), table_salt(spec.hashing.namespace, name)))
        vectors = rng.normal(size=(len(keys), spec.model.embedding_dim)).astype(np.float32)
        tables[name] = TableArrays(name, keys, vectors, np.zeros(spec.model.embedding_dim, np.float32))
    options = StoreSection(cache_mib=(2000 * (spec.model.embedding_dim * 4 + 16)) / (1 << 20))
    return tables, TieredStore.from_tables(tables, options=options)


@pytest.mark.parametrize("device", DEVICES)
def test_served_step_lays_out_device_tensors_as_the_host_step_does(spec, device, tmp_path):
    rng = np.random.default_rng(2)
    tables, store = spec_store(spec, rng)
    served = served_store(store, tmp_path)
    rows, width = 5, 7
    sparse = np.stack(
        [tables[f.table].keys[rng.integers(0, 40, rows)] for f in spec.categorical.features], axis=1
    )
    inputs = {
        "sparse_keys": sparse,
        "target_key": tables[spec.target.table].keys[rng.integers(0, 40, (rows, 1))],
        "history_keys": tables[spec.sequence.table].keys[rng.integers(0, 40, (rows, width))],
    }
    host_step = EmbeddingLookup.for_instance(spec, served)
    assert host_step.device_l1 is None and served.maintainer.after_step == []
    store.refresh_cache(seed=np.concatenate([t.keys[:20] for t in tables.values()]))
    device_step = EmbeddingLookup.for_instance(spec, served, "cpu" if device == "cpu" else "cuda", device)
    assert served.maintainer.after_step == [device_step.device_l1.follow]  # the copy follows the upkeep
    want = host_step.lookup(inputs)
    got = device_step.lookup(inputs)
    assert got.keys() == want.keys()
    assert np.array_equal(
        got.pop(EMBEDDING_VERSION), want[EMBEDDING_VERSION]
    )  # a few integers per row: on the host
    for name, tensor in got.items():
        assert isinstance(tensor, torch.Tensor) and tensor.device.type == device
        assert np.array_equal(tensor.cpu().numpy(), want[name]), name
    assert store.stats.by_table_tier[:, L1].sum() > 0


def test_upkeep_stops_rebuilding_the_host_l1_when_every_table_is_resident(spec, tmp_path):
    _, store = spec_store(spec, np.random.default_rng(3))
    store.options = dataclasses.replace(store.options, cache_refresh_s=0.0)  # a rebuild due every round
    partly = dataclasses.replace(spec, store=dataclasses.replace(spec.store, device_memory_mib=0.0))
    for served_spec, resident in ((partly, False), (spec, True)):  # no table fits / every table fits
        served = served_store(store, tmp_path)
        EmbeddingLookup.for_instance(served_spec, served, "cpu", "cpu")
        assert served.maintainer.rebuild_l1 is not resident
        before = store.refreshed_at
        served.maintainer.step()
        assert (store.refreshed_at == before) is resident  # all resident: nothing reads the host L1
