import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from recserve.backends.store.tiered import DELTA, L1, TieredStore
from recserve.backends.store.updates.versions import (
    DeltaError,
    Maintainer,
    StoreUpdater,
    UpdateLog,
    load_hot_keys,
    read_delta_file,
    save_hot_keys,
)
from tests.unit.test_store import DIM, make_tables


@pytest.fixture
def tables():
    return make_tables()


@pytest.fixture
def store(tables):
    return TieredStore.from_tables(tables)


def rows(store, name, keys):
    return store.lookup(keys, np.full(len(keys), store.table_id(name)), record=False)


def test_publish_and_rollback_only_move_versions_forward(tmp_path, tables, store):
    log = UpdateLog(tmp_path, base_version=1)
    updater = StoreUpdater(store, log)
    keys = tables["t0"].keys[:3]
    original = rows(store, "t0", keys).vectors
    assert log.publish("t0", keys[:2], np.full((2, DIM), 5, np.float32), DIM) == 2
    assert log.publish("t0", keys[1:], np.full((2, DIM), 6, np.float32), DIM) == 3
    assert updater.poll() and store.version_of("t0") == 3
    got = rows(store, "t0", keys)
    assert got.vectors[:, 0].tolist() == [5, 6, 6] and (got.tiers == DELTA).all()
    assert log.rollback("t0", 2) == 4  # a new version with version 2's content
    assert updater.poll() and store.version_of("t0") == 4
    assert rows(store, "t0", keys).vectors[:, 0].tolist() == [5, 5, original[2, 0]]
    assert log.rollback("t0", 1) == 5
    updater.poll()
    assert np.array_equal(rows(store, "t0", keys).vectors, original)  # base restored exactly
    assert (
        log.publish("t0", keys[:1], np.full((1, DIM), 9, np.float32), DIM) == 6
    )  # on top of the head (base)
    updater.poll()
    assert rows(store, "t0", keys).vectors[:, 0].tolist() == [9, original[1, 0], original[2, 0]]
    assert not updater.poll()  # nothing new


@pytest.mark.parametrize(
    ("keys", "vectors", "message"),
    [
        (np.array([1, 2], np.int64), np.zeros((2, DIM + 1), np.float32), "expected \\[2, 4\\]"),
        (np.array([1, 2], np.int64), np.zeros((2, DIM), np.float64), "float64, expected float32"),
        (np.array([1, 2], np.int32), np.zeros((2, DIM), np.float32), "int32"),
        (np.array([1, 1], np.int64), np.zeros((2, DIM), np.float32), "repeats keys"),
        (np.array([1, 2], np.int64), np.full((2, DIM), np.nan, np.float32), "NaN"),
        (np.array([], np.int64), np.zeros((0, DIM), np.float32), "no rows"),
    ],
)
def test_malformed_deltas_are_refused_before_anything_is_published(tmp_path, keys, vectors, message):
    log = UpdateLog(tmp_path, base_version=1)
    with pytest.raises(DeltaError, match=message):
        log.publish("t0", keys, vectors, DIM)
    assert log.versions("t0") == [] and log.head("t0") == 1


def test_a_delta_with_another_tables_key_is_refused_at_apply(tmp_path, tables, store):
    log = UpdateLog(tmp_path, base_version=1)
    updater = StoreUpdater(store, log)
    log.publish("t0", tables["t1"].keys[:1], np.ones((1, DIM), np.float32), DIM)
    assert not updater.poll() and updater.rejected == 1
    assert store.version_of("t0") == 1  # still serving the old version


def test_a_tampered_version_is_refused_and_the_old_one_keeps_serving(tmp_path, tables, store):
    log = UpdateLog(tmp_path, base_version=1)
    updater = StoreUpdater(store, log)
    version = log.publish("t0", tables["t0"].keys[:1], np.ones((1, DIM), np.float32), DIM)
    np.save(tmp_path / "t0" / f"v{version:08d}" / "vectors.npy", np.full((1, DIM), 666, np.float32))
    assert not updater.poll() and store.version_of("t0") == 1


def test_rollback_to_an_unknown_version_is_refused(tmp_path):
    with pytest.raises(DeltaError, match="no version 7"):
        UpdateLog(tmp_path, base_version=1).rollback("t0", 7)


def test_delta_files_npz_and_safetensors(tmp_path):
    keys, vectors = np.array([3, 4], np.int64), np.ones((2, DIM), np.float32)
    np.savez(tmp_path / "d.npz", keys=keys, vectors=vectors)
    save_file({"keys": keys, "vectors": vectors}, str(tmp_path / "d.safetensors"))
    for name in ("d.npz", "d.safetensors"):
        got_keys, got_vectors = read_delta_file(tmp_path / name)
        assert np.array_equal(got_keys, keys) and np.array_equal(got_vectors, vectors)
    np.savez(tmp_path / "objects.npz", keys=np.array([{"a": 1}], dtype=object), vectors=vectors)
    with pytest.raises(DeltaError, match="pickled"):
        read_delta_file(tmp_path / "objects.npz")
    np.savez(tmp_path / "partial.npz", keys=keys)
    with pytest.raises(DeltaError, match="vectors"):
        read_delta_file(tmp_path / "partial.npz")
    (tmp_path / "d.pt").write_bytes(b"x")
    with pytest.raises(DeltaError, match=".npz or .safetensors"):
        read_delta_file(tmp_path / "d.pt")


def test_concurrent_readers_see_whole_versions_moving_forward(tmp_path, tables, store):
    """Updates and rollbacks race with readers: every batch is one complete version of the rows."""
    log = UpdateLog(tmp_path, base_version=1)
    updater = StoreUpdater(store, log)
    keys = tables["t1"].keys[:64]
    ids = np.full(len(keys), store.table_id("t1"))
    content = {1: rows(store, "t1", keys).vectors}
    stop = threading.Event()
    failures: list[str] = []

    def reader() -> None:
        last = 0
        while not stop.is_set():
            result = store.lookup(keys, ids)
            version = store.version_of("t1", result.snapshot)
            if version < last:
                failures.append(f"version went back from {last} to {version}")
            if version in content and not np.array_equal(result.vectors, content[version]):
                failures.append(f"rows of version {version} are mixed")
            last = version

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    rng = np.random.default_rng(0)
    for step in range(30):
        if step % 4 == 3:
            target = int(rng.choice(list(content)))
            version = log.rollback("t1", target)
            content[version] = content[target]
        else:
            value = np.float32(step + 10)
            version = log.publish("t1", keys, np.full((len(keys), DIM), value, np.float32), DIM)
            content[version] = np.full((len(keys), DIM), value, np.float32)
        updater.poll()
        if step % 5 == 0:
            store.refresh_cache()
    stop.set()
    for thread in threads:
        thread.join()
    assert failures == []
    assert store.version_of("t1") == max(content)


def test_warm_up_preloads_l1_from_recorded_hot_keys(tmp_path, tables):
    store = TieredStore.from_tables(tables)
    hot = tables["t0"].keys[:20]
    save_hot_keys(tmp_path / "state", hot)
    assert np.array_equal(load_hot_keys(tmp_path / "state"), hot)
    maintainer = Maintainer(
        store, StoreUpdater(store, UpdateLog(tmp_path / "log", 1)), tmp_path / "state", 0.05
    )
    assert maintainer.warm_up() == 20
    assert (rows(store, "t0", hot).tiers == L1).all()
