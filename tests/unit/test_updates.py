import json
import os
import threading
import time
import zipfile

import numpy as np
import pytest
from safetensors.numpy import save_file

from recserve.backends.store.tiered import DELTA, L1, TieredStore
from recserve.backends.store.updates.versions import (
    DeltaError,
    Maintainer,
    StoreUpdater,
    UpdateLog,
    UpdateRefused,
    load_hot_keys,
    read_delta_file,
    save_hot_keys,
)
from tests.hostile_files import write_zero_member
from tests.store_tables import DIM, make_tables


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


def test_a_command_counts_its_version_served_when_a_newer_one_builds_on_it(tmp_path, tables, store, capsys):
    from types import SimpleNamespace

    from recserve.commands.store import _applied_here

    log = UpdateLog(tmp_path, base_version=1)
    served = SimpleNamespace(updater=StoreUpdater(store, log))
    keys = tables["t0"].keys[:2]
    assert log.publish("t0", keys, np.full((2, DIM), 5, np.float32), DIM) == 2
    assert log.publish("t0", keys, np.full((2, DIM), 6, np.float32), DIM) == 3  # a concurrent update
    assert _applied_here(served, "t0", 2) == 0  # version 3's parent is 2: 2 is served
    assert _applied_here(served, "t0", 3) == 0
    assert log.rollback("t0", 1) == 4  # rolled back past 2 and 3
    assert _applied_here(served, "t0", 2) == 1
    assert "version 2 of table 't0' was published" in capsys.readouterr().err


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
    with pytest.raises(DeltaError, match="Python objects"):
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
            time.sleep(0)  # yield the GIL: the publishes and rollbacks go on between reads

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    rng = np.random.default_rng(0)
    for step in range(20):  # five rollbacks and four L1 rebuilds among the publishes
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


# ---- the update log trusts nothing it reads ---------------------------------------------------


def _manifest_path(root, table, version):
    return root / table / f"v{version:08d}" / "manifest.json"


def _edit_manifest(root, table, version, change):
    path = _manifest_path(root, table, version)
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "change",
    [
        lambda doc: doc.pop("parent"),
        lambda doc: doc.update(parent="x"),
        lambda doc: doc.update(parent=[1]),
        lambda doc: doc.update(parent=2.0),
        lambda doc: doc.update(created="yesterday"),
        lambda doc: doc.update(version=3.0),
        lambda doc: doc.update(kind="patch"),
        lambda doc: doc.update(files=["keys"]),
        lambda doc: doc["files"]["keys"].update(path="../../keys.npy"),
        lambda doc: doc["files"]["keys"].update(path="/etc/passwd"),
        lambda doc: doc["files"]["vectors"].pop("sha256"),
        lambda doc: doc["files"]["vectors"].update(shape="[2, 4]"),
    ],
    ids=[
        "no-parent",
        "parent-string",
        "parent-list",
        "parent-float",
        "created-string",
        "version-float",
        "unknown-kind",
        "files-list",
        "file-traversal",
        "file-absolute",
        "no-checksum",
        "shape-string",
    ],
)
def test_a_malformed_manifest_is_refused_and_the_newest_valid_version_serves(tmp_path, tables, store, change):
    log = UpdateLog(tmp_path, base_version=1, tables=store.table_names)
    keys = tables["t0"].keys[:2]
    log.publish("t0", keys, np.full((2, DIM), 5, np.float32), DIM)
    log.publish("t0", keys, np.full((2, DIM), 6, np.float32), DIM)
    _edit_manifest(tmp_path, "t0", 3, change)
    with pytest.raises(UpdateRefused, match="version 3 of table 't0'"):
        log.record("t0", 3)
    updater = StoreUpdater(store, log)
    assert updater.poll()  # no exception escapes: the model still loads
    assert store.version_of("t0") == 2 and rows(store, "t0", keys).vectors[:, 0].tolist() == [5, 5]
    assert updater.rejected == 1 and "version 3" in updater.problems["t0"]
    assert not updater.poll() and updater.rejected == 1  # counted once, not at every poll
    with pytest.raises(DeltaError, match="roll back"):
        updater.check_publishable("t0", keys)
    with pytest.raises(UpdateRefused):
        log.publish("t0", keys, np.ones((2, DIM), np.float32), DIM)  # not on top of a broken head
    assert log.rollback("t0", 2) == 4 and updater.poll() and store.version_of("t0") == 4


@pytest.mark.parametrize(
    "head",
    ['{"version": 8.7}', '{"version": "2"}', '{"version": true}', '{"version": 0}', "[2]", "{", '"2"'],
)
def test_a_malformed_head_is_refused_not_rounded(tmp_path, tables, store, head):
    log = UpdateLog(tmp_path, base_version=1, tables=store.table_names)
    log.publish("t0", tables["t0"].keys[:1], np.ones((1, DIM), np.float32), DIM)
    updater = StoreUpdater(store, log)
    assert updater.poll() and store.version_of("t0") == 2
    (tmp_path / "t0" / "HEAD.json").write_text(head)
    with pytest.raises(UpdateRefused, match="t0/HEAD.json"):
        log.head("t0")
    assert not updater.poll() and store.version_of("t0") == 2 and updater.rejected == 1
    log._write_head("t0", 2)
    assert not updater.poll() and store.version_of("t0") == 2  # readable again, same version


def _entry(log, table, version):
    record = log.record(table, version)
    manifest = json.loads((record.folder / "manifest.json").read_text())
    files = {name: (record.folder / entry["path"]).read_bytes() for name, entry in record.files.items()}
    return manifest, files


@pytest.mark.parametrize("table", ["../../x", "/tmp/x", "t0/../../x", "..", "", "t9", 7, None])
def test_an_imported_version_with_a_path_for_a_table_writes_nothing(tmp_path, tables, table):
    source = UpdateLog(tmp_path / "source", base_version=1)
    source.publish("t0", tables["t0"].keys[:1], np.ones((1, DIM), np.float32), DIM)
    manifest, files = _entry(source, "t0", 2)
    manifest["table"] = table
    target = UpdateLog(tmp_path / "deep" / "log", base_version=1, tables=("t0", "t1"))
    with pytest.raises(UpdateRefused, match="table"):
        target.import_version(table, manifest, files)
    assert not (tmp_path / "deep").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m, f: f.update(keys=f["keys"] + b"x"), "bytes its manifest lists"),
        (lambda m, f: f.update(keys=f["vectors"]), "bytes its manifest lists|checksum"),
        (lambda m, f: f.pop("vectors"), "carries files"),
        (lambda m, f: f.update(extra=b""), "carries files"),
        (lambda m, f: m.update(parent=0), "parent 0"),
        (lambda m, f: m.update(version=9, parent=2), "does not follow a version here"),
        (lambda m, f: m.update(parent=1), "parent 1 is not the version before it"),
        (lambda m, f: m.update(kind="revert", parent=5, files={}), "parent 5"),
        (lambda m, f: m["files"]["keys"].update(path="../keys.npy"), "plain .npy name"),
        (lambda m, f: m.update(version=True), "not an integer"),
    ],
)
def test_an_imported_version_that_does_not_fit_the_schema_is_refused(tmp_path, tables, edit, message):
    source = UpdateLog(tmp_path / "source", base_version=1)
    source.publish("t0", tables["t0"].keys[:1], np.ones((1, DIM), np.float32), DIM)
    source.publish("t0", tables["t0"].keys[:1], np.ones((1, DIM), np.float32), DIM)
    target = UpdateLog(tmp_path / "target", base_version=1, tables=("t0",))
    assert target.import_version("t0", *_entry(source, "t0", 2))
    manifest, files = _entry(source, "t0", 3)
    edit(manifest, files)
    with pytest.raises(UpdateRefused, match=message):
        target.import_version("t0", manifest, files)
    assert target.versions("t0") == [2] and target.head("t0") == 2
    assert target.import_version("t0", *_entry(source, "t0", 3)) and target.head("t0") == 3


def test_concurrent_publishers_lose_no_version(tmp_path, tables, store):
    """Eight writers per table at once: every version is in its table's head chain."""
    log = UpdateLog(tmp_path, base_version=1)
    published: dict[str, list[int]] = {"t0": [], "t1": []}
    barrier = threading.Barrier(16)

    def writer(table: str, number: int) -> None:
        keys = tables[table].keys[number * 2 : number * 2 + 2]
        barrier.wait()
        published[table].append(log.publish(table, keys, np.full((2, DIM), number, np.float32), DIM))

    threads = [threading.Thread(target=writer, args=(t, n)) for t in ("t0", "t1") for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for table in ("t0", "t1"):
        assert sorted(published[table]) == list(range(2, 10))
        assert [r.version for r in log.chain(table, log.head(table))] == list(range(2, 10))
    updater = StoreUpdater(store, log)
    assert updater.poll()
    for table in ("t0", "t1"):
        got = rows(store, table, tables[table].keys[:16])
        assert (got.tiers == DELTA).all() and got.vectors[:, 0].tolist() == [
            n for n in range(8) for _ in "ab"
        ]


def test_a_key_in_another_tables_delta_is_refused_before_publishing(tmp_path, store):
    log = UpdateLog(tmp_path, base_version=1)
    updater = StoreUpdater(store, log)
    new_keys = np.array([10**15, 10**15 + 1], np.int64)  # in no table: a delta may add rows
    log.publish(
        "t0",
        new_keys,
        np.ones((2, DIM), np.float32),
        DIM,
        check=lambda: updater.check_publishable("t0", new_keys),
    )
    with pytest.raises(DeltaError, match="is in the published delta of table 't0'"):
        log.publish(
            "t1",
            new_keys[1:],
            np.ones((1, DIM), np.float32),
            DIM,
            check=lambda: updater.check_publishable("t1", new_keys[1:]),
        )
    assert log.versions("t1") == [] and updater.applied == {"t0": 2, "t1": 1}


def test_a_cross_table_clash_moves_only_the_later_table_back_and_a_restart_serves_the_same(tmp_path, tables):
    """A clash written behind the CLI's back: the table published first keeps the key."""
    log = UpdateLog(tmp_path, base_version=1)
    first = TieredStore.from_tables(tables)
    updater = StoreUpdater(first, log)
    shared = np.array([10**15], np.int64)
    log.publish("t1", np.concatenate([shared, tables["t1"].keys[:1]]), np.ones((2, DIM), np.float32), DIM)
    assert updater.poll()
    log.publish("t0", tables["t0"].keys[:1], np.full((1, DIM), 3, np.float32), DIM)
    log.publish("t0", shared, np.full((1, DIM), 4, np.float32), DIM)  # t0 v3 claims t1's key
    assert updater.poll()
    assert first.snapshot.versions == (2, 2) and updater.rejected == 1  # t0 on v2, the valid part
    restarted = TieredStore.from_tables(tables)
    again = StoreUpdater(restarted, log)
    assert again.poll() and restarted.snapshot.versions == first.snapshot.versions
    assert rows(restarted, "t0", tables["t0"].keys[:1]).vectors[0, 0] == 3


def test_a_delta_that_claims_more_than_it_holds_is_refused_before_inflating(tmp_path):
    bomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        write_zero_member(archive, "keys.npy", (1 << 24,), "<i8")  # 128 MiB of zeros, ~0.1 MiB on disk
        write_zero_member(archive, "vectors.npy", (1 << 20, DIM), "<f4")
    with pytest.raises(DeltaError, match="bomb.npz inflates to .* refused before inflating"):
        read_delta_file(bomb)
    for name, content in (
        ("empty.npz", b""),
        ("random.npz", os.urandom(4096)),
        ("cut.npz", bomb.read_bytes()[:999]),
    ):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DeltaError, match=f"delta {name}"):
            read_delta_file(tmp_path / name)
