"""Tables resident on the device against the host store and a plain dictionary: the same bits."""

import numpy as np
import pytest
import torch

from recserve.backends.steps.explain import explain
from recserve.backends.store.device.cache import DeviceL1
from recserve.backends.store.device.tier import DeviceTier, device_lookup, resident_tables
from recserve.backends.store.table_data import RowBlock, TableArrays
from recserve.backends.store.tiered import DEFAULT, DEVICE, L1, L2, L3, TIERS, TieredStore
from recserve.build.repository import version_dir
from recserve.build.synthetic import generate
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.sections.base import SpecError
from recserve.core.sections.serving import StoreSection
from tests.store_tables import DIM, make_tables
from tests.unit.helpers import DEVICES, SLOT_BYTES, SwapsMidBatch, warm, zipf_batch

ROW_BYTES = 8 + DIM * 4  # one resident row: its key and its float32 vector


def make_store(remote=None, cache_slots=150):
    """Tables t0 (float32), t1 (float16) and t2 (2 wide, a shard of its own); L1 smaller than the hot set."""
    tables = make_tables(rows=(2000, 1500, 700))
    narrow = tables["t2"]
    tables["t2"] = TableArrays("t2", narrow.keys, narrow.vectors[:, :2].copy(), narrow.default[:2].copy())
    store = TieredStore.from_tables(
        tables,
        dtypes={"t1": "float16"},
        options=StoreSection(cache_mib=(cache_slots * SLOT_BYTES) / (1 << 20)),
        remote=remote,
    )
    return tables, store


def plain_lookup(tables, delta, keys, table_ids):
    """Each key's delta row, else its table's row (zero-padded; t1 via float16), else the default."""
    rows = {}
    for number, name in enumerate(sorted(tables)):
        table = tables[name]
        stored = table.vectors.astype(np.float16 if name == "t1" else np.float32).astype(np.float32)
        for key, vector in zip(table.keys.tolist(), stored, strict=True):
            rows[(number, key)] = vector
    delta_rows = {} if delta is None else dict(zip(delta[0].tolist(), delta[1], strict=True))
    out = np.zeros((len(keys), DIM), np.float32)
    for i, (key, number) in enumerate(zip(keys.tolist(), table_ids.tolist(), strict=True)):
        name = sorted(tables)[number]
        vector = delta_rows.get(key, rows.get((number, key), tables[name].default))
        out[i, : len(vector)] = vector
    return out


def assert_same_vectors(got, want):
    assert got.vectors.dtype == torch.float32
    assert np.array_equal(got.vectors.cpu().numpy(), want.vectors)  # bit for bit
    assert got.snapshot is want.snapshot


def on_device_tiers(host_tiers):
    """The host tiers as the device tier gives them with every table resident: stored rows are ``device``."""
    return np.where(host_tiers == DEFAULT, DEFAULT, DEVICE).astype(np.int8)


@pytest.mark.parametrize("device", DEVICES)
def test_resident_tables_equal_the_host_store_and_a_plain_lookup(device):
    tables, store = make_store()
    rng = np.random.default_rng(11)
    warm(store, tables, rng)
    delta_keys = np.unique(
        np.concatenate([store.hot_keys()[:10], tables["t0"].keys[-40:], tables["t2"].keys[:5]])
    )
    delta_vectors = rng.normal(size=(len(delta_keys), DIM)).astype(np.float32)
    delta_vectors[np.isin(delta_keys, tables["t2"].keys), 2:] = (
        0.0  # t2's rows zero-padded, as the updater keeps them
    )
    store.install({"t0": 2, "t2": 2}, RowBlock.of(delta_keys, delta_vectors))
    tier = device_lookup(store, device, 10 * len(delta_keys) * ROW_BYTES + 4200 * ROW_BYTES)
    assert isinstance(tier, DeviceTier) and tier.tables == ("t0", "t1", "t2") and tier.fallback is None
    seen = np.zeros(len(TIERS), np.int64)
    for _ in range(6):
        keys, ids = zipf_batch(tables, rng, 1664)
        keys[:8] = np.concatenate([tables["t0"].keys[-3:], tables["t2"].keys[:5]])  # cold delta rows
        ids[:8] = [0, 0, 0, 2, 2, 2, 2, 2]
        got = tier.lookup(keys, ids, record=False)
        host = store.lookup(keys, ids, record=False)
        assert got.vectors.device.type == device
        assert_same_vectors(got, host)
        assert np.array_equal(got.tiers, on_device_tiers(host.tiers))
        assert np.array_equal(
            got.vectors.cpu().numpy(), plain_lookup(tables, (delta_keys, delta_vectors), keys, ids)
        )
        seen += np.bincount(got.tiers, minlength=len(TIERS))
    assert seen[DEVICE] > 0 and seen[DEFAULT] > 0 and seen[[L1, L2, L3]].sum() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_tables_over_the_budget_are_served_by_the_device_l1(device):
    tables, store = make_store()
    rng = np.random.default_rng(4)
    warm(store, tables, rng)
    assert resident_tables(store, 2000 * ROW_BYTES) == ("t0",)
    assert resident_tables(store, 2700 * ROW_BYTES) == ("t0", "t2")  # t1 does not fit after t0; t2 does
    tier = device_lookup(store, device, 2000 * ROW_BYTES)
    assert isinstance(tier, DeviceTier) and isinstance(tier.fallback, DeviceL1)
    keys, ids = zipf_batch(tables, rng, 4000)
    got = tier.lookup(keys, ids, record=False)
    host = store.lookup(keys, ids, record=False)
    assert_same_vectors(got, host)
    resident = ids == 0
    assert np.array_equal(got.tiers[resident], on_device_tiers(host.tiers[resident]))
    assert np.array_equal(got.tiers[~resident], host.tiers[~resident])  # the same L1, L2 and defaults
    assert (got.tiers == L1).any() and (got.tiers == DEVICE).any()
    assert isinstance(device_lookup(store, device, 0), DeviceL1)  # nothing fits: the device L1 alone


class CountingRemote:
    """An L3 tier holding some keys; counts its calls."""

    def __init__(self, keys, vectors):
        self.rows = dict(zip(keys.tolist(), vectors, strict=True))
        self.calls = 0

    def fetch(self, keys, dim, widths):
        self.calls += 1
        found = np.array([k in self.rows for k in keys.tolist()], bool)
        vectors = np.zeros((len(keys), dim), np.float32)
        for i in np.flatnonzero(found):
            vectors[i] = self.rows[int(keys[i])]
        return vectors, found

    fetch_bulk = fetch

    def healthy(self):
        return True

    def samples(self):
        return []


@pytest.mark.parametrize("device", DEVICES)
def test_misses_go_to_the_host_tiers_in_one_call_when_there_is_l3(device):
    remote_keys = np.array([11, 12, 13], np.int64)
    remote = CountingRemote(remote_keys, np.full((3, DIM), 7.0, np.float32))
    tables, store = make_store(remote=remote)
    tier = device_lookup(store, device, 10**9)
    assert tier.fallback is not None  # every table resident, but an unknown key may live in L3
    keys = np.concatenate([tables["t0"].keys[:50], remote_keys, [99, 98]])
    ids = np.zeros(len(keys), np.int16)
    remote.calls = 0
    got = tier.lookup(keys, ids, record=False)
    assert remote.calls == 1  # the five misses in one batched call
    host = store.lookup(keys, ids, record=False)
    assert_same_vectors(got, host)
    assert got.tiers.tolist() == [DEVICE] * 50 + [L3] * 3 + [DEFAULT] * 2


@pytest.mark.parametrize("device", DEVICES)
def test_updates_and_rollback_swap_whole_versions_on_the_device(device):
    tables, store = make_store()
    tier = device_lookup(store, device, 10**9)
    keys = tables["t0"].keys[:20]
    ids = np.zeros(20, np.int16)
    base = tier.lookup(keys, ids, record=False).vectors.cpu().numpy()
    assert np.array_equal(base, tables["t0"].vectors[:20])
    store.install({"t0": 2}, RowBlock.of(keys[:5], np.full((5, DIM), 2.0, np.float32)))
    tier.follow()  # the upkeep thread's copy, before any lookup
    assert tier.delta_for(store.snapshot.delta).source is store.snapshot.delta
    got = tier.lookup(keys, ids, record=False)
    assert (got.vectors[:5] == 2.0).all() and np.array_equal(got.vectors[5:].cpu().numpy(), base[5:])
    assert tier.store.version_of("t0", got.snapshot) == 2
    store.install({"t0": 3}, None)  # rollback to the base rows: no delta any more
    got = tier.lookup(keys, ids, record=False)  # no follow(): the lookup copies the new version itself
    assert np.array_equal(got.vectors.cpu().numpy(), base) and store.version_of("t0", got.snapshot) == 3


@pytest.mark.parametrize("swaps", [1, 4])  # 4: every attempt loses, the host path serves it
def test_a_batch_sees_one_version_when_an_update_lands_before_the_fallback_answers(swaps):
    tables = make_tables(rows=(2000, 1500))
    store = SwapsMidBatch.from_tables(tables, options=StoreSection(cache_mib=(100 * SLOT_BYTES) / (1 << 20)))
    store.rows = tables["t0"].keys[:400]
    tier = device_lookup(store, "cpu", 2000 * ROW_BYTES)  # t0 resident; t1 behind the fallback
    keys = np.concatenate([tables["t0"].keys[:400], tables["t1"].keys[:100]])
    ids = np.repeat(np.array([0, 1], np.int16), [400, 100])
    store.swaps = swaps
    got = tier.lookup(keys, ids)
    assert store.swaps == 0
    version = store.version_of("t0", got.snapshot)
    assert np.unique(got.vectors[:400].numpy()).tolist() == [version]  # every t0 row of one version
    assert_same_vectors(got, store.lookup(keys, ids, record=False))
    assert store.stats.calls == 1 and store.stats.by_table_tier.sum() == len(keys)  # counted once


def test_counts_name_the_device_tier():
    tables, store = make_store()
    tier = device_lookup(store, "cpu", 10**9)
    keys, ids = zipf_batch(tables, np.random.default_rng(2), 500)
    got = tier.lookup(keys, ids)
    assert store.stats.by_table_tier[:, DEVICE].sum() == (got.tiers == DEVICE).sum() > 0
    assert store.stats.calls == 1


def test_budget_is_checked():
    assert StoreSection(device_memory_mib=2).device_memory_bytes == 2 << 20
    with pytest.raises(SpecError, match="device_memory_mib"):
        StoreSection(device_memory_mib=-1).check(())


def test_explain_reports_the_device_tier(tiny_spec, tiny_repository):
    store = TieredStore.load(version_dir(tiny_repository, EMBEDDING_LOOKUP, tiny_spec), tiny_spec)
    wire = generate(tiny_spec, 20, seed=1).to_wire(tiny_spec)
    host = [r for r in explain(tiny_spec, store, wire) if r["key"] is not None]  # the keys' records
    on_device = [r for r in explain(tiny_spec, store, wire, device="cpu") if r["key"] is not None]
    assert [(r["key"], r["version"]) for r in on_device] == [(r["key"], r["version"]) for r in host]
    assert [r["tier"] for r in on_device] == [
        "default" if r["tier"] == "default" else "device" for r in host
    ]  # every table of the tiny spec fits the default budget
    assert "device" in {r["tier"] for r in on_device}


def test_keys_made_on_the_device_are_answered_and_counted_there():
    tables, store = make_store()
    tier = device_lookup(store, "cpu", 10**9)
    assert isinstance(tier, DeviceTier) and tier.whole
    row_tables = np.array([0, 1, 2], np.int16)  # one key of each table per row
    keys = np.stack([tables[name].keys[:200] for name in ("t0", "t1", "t2")], axis=1)
    keys[:5] = 12345  # unknown keys: each table's default
    ids = np.broadcast_to(row_tables, keys.shape)
    layout = tier.layout(row_tables, keys.shape[0], np.empty(0, np.int16), 0)
    assert tier.layout(row_tables, keys.shape[0], np.empty(0, np.int16), 0) is layout  # once per shape
    got = tier.lookup(torch.from_numpy(keys.ravel()), layout)
    host = store.lookup(keys.ravel(), ids.ravel(), record=False)
    assert_same_vectors(got, host)
    assert np.array_equal(got.tiers, on_device_tiers(host.tiers))
    assert store.stats.calls == 1 and store.stats.by_table_tier.sum() == 0  # counted on the device
    store.stats.flush()  # as the metrics thread does
    assert store.stats.by_table_tier[:, DEVICE].sum() == (host.tiers != DEFAULT).sum() > 0
    assert store.stats.by_table_tier.sum() == keys.size
    store.stats.flush()
    assert store.stats.by_table_tier.sum() == keys.size  # taken once
