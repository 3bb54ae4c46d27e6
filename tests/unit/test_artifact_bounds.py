"""Every artifact read is bounded the same way: headers are checked against the file before numpy allocates.

An update version or stream entry whose ``.npy`` header claims 2**40 rows is a refused update (the
table serves the newest valid version), never a ``MemoryError`` that stops the model from loading;
what ``recserve update`` publishes is exactly what the servers apply (byte order included); the
rebuild file is emptied by the builder and bounded while none runs; a corrupt local user-state
database is set aside and replaced, never a failed start.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest

from recserve.backends.base.bounded_files import sized_npy_header
from recserve.backends.steps.stateful_lookup import UserStateCounts
from recserve.backends.store.tiered import TieredStore
from recserve.backends.store.updates.versions import (
    DeltaError,
    StoreUpdater,
    UpdateLog,
    UpdateRefused,
    load_hot_keys,
    read_delta_file,
    save_hot_keys,
)
from recserve.backends.store.user_state.rebuilds import FileRebuilds, RebuildQueue, RebuildsFull
from recserve.backends.store.user_state.state import EXACT, UserState
from recserve.backends.store.user_state.states import ERROR, LocalUserStates
from recserve.backends.store.user_state.tokens import Tokens
from recserve.cli import main
from recserve.errors import ArtifactError
from tests.hostile_files import npy_header
from tests.store_tables import DIM, make_tables

HUGE = (1 << 40, DIM)  # 16 TiB of float32 claimed by a header in front of a few bytes


@pytest.fixture
def tables():
    return make_tables()


@pytest.fixture
def store(tables):
    return TieredStore.from_tables(tables)


def first_values(store: TieredStore, table: str, keys: np.ndarray) -> list[float]:
    got = store.lookup(keys, np.full(len(keys), store.table_id(table)), record=False)
    return got.vectors[:, 0].tolist()


def lie(path: Path, shape: tuple[int, ...]) -> bytes:
    """Rewrite the ``.npy`` at ``path`` with a header claiming ``shape``, its data kept; the new bytes."""
    data = np.load(path).tobytes()
    content = npy_header(shape, "<f4") + data
    path.write_bytes(content)
    return content


def reseal(folder: Path, name: str, content: bytes, shape: list[int] | None) -> dict:
    """Make the manifest agree with ``content`` (as anyone who can write the log can); the manifest."""
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["files"][name]
    entry.update(sha256=hashlib.sha256(content).hexdigest(), bytes=len(content))
    if shape is not None:
        entry["shape"] = shape
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


@pytest.mark.parametrize("manifest_follows", [True, False], ids=["manifest-claims-it-too", "manifest-true"])
def test_a_version_whose_npy_header_lies_about_its_size_is_a_refused_update(
    tmp_path, tables, store, manifest_follows
):
    """Before: ``np.load`` allocated what the header claimed; the MemoryError stopped the model loading."""
    log = UpdateLog(tmp_path, base_version=1, tables=store.table_names)
    keys = tables["t0"].keys[:2]
    log.publish("t0", keys, np.full((2, DIM), 5, np.float32), DIM)
    log.publish("t0", keys, np.full((2, DIM), 6, np.float32), DIM)
    folder = tmp_path / "t0" / "v00000003"
    reseal(folder, "vectors", lie(folder / "vectors.npy", HUGE), list(HUGE) if manifest_follows else None)
    updater = StoreUpdater(store, log)
    assert updater.poll()  # no exception: the model loads
    assert store.version_of("t0") == 2 and first_values(store, "t0", keys) == [5, 5]
    assert updater.rejected == 1
    assert "its header float32[1099511627776, 4] needs 17,592,186,044,544" in updater.problems["t0"]
    restarted = TieredStore.from_tables(tables)
    assert StoreUpdater(restarted, log).poll() and restarted.version_of("t0") == 2  # every start alike


def test_a_stream_entry_whose_npy_header_lies_is_refused_before_anything_is_written(tmp_path, tables):
    """Before: the entry was written into the local log, and every start replayed it."""
    here = UpdateLog(tmp_path / "here", 1)
    version = here.publish("t0", tables["t0"].keys[:2], np.ones((2, DIM), np.float32), DIM)
    folder = here.root / "t0" / f"v{version:08d}"
    content = lie(folder / "vectors.npy", HUGE)
    manifest = reseal(folder, "vectors", content, list(HUGE))
    files = {"keys": (folder / "keys.npy").read_bytes(), "vectors": content}
    there = UpdateLog(tmp_path / "there", 1, tables=("t0", "t1"))
    with pytest.raises(UpdateRefused, match="file 'vectors' has .* bytes; its header float32.* needs"):
        there.import_version("t0", manifest, files)
    assert there.versions("t0") == [] and not (there.root / "t0").exists()


def test_a_hot_keys_file_whose_header_lies_warms_nothing_and_loads(tmp_path):
    save_hot_keys(tmp_path, np.arange(4, dtype=np.int64))
    assert load_hot_keys(tmp_path).tolist() == [0, 1, 2, 3]
    (tmp_path / "hot_keys.npy").write_bytes(npy_header((1 << 40,), "<i8") + bytes(32))
    assert load_hot_keys(tmp_path).size == 0  # before: MemoryError in the step's initialize


def test_a_version_file_that_cannot_be_resolved_is_a_refused_update(tmp_path, tables, store):
    """Any failure while loading a version refuses it (before: a symlink loop's RuntimeError escaped)."""
    log = UpdateLog(tmp_path, base_version=1, tables=store.table_names)
    keys = tables["t0"].keys[:1]
    log.publish("t0", keys, np.full((1, DIM), 5, np.float32), DIM)
    log.publish("t0", keys, np.full((1, DIM), 6, np.float32), DIM)
    loop = tmp_path / "t0" / "v00000003" / "vectors.npy"
    loop.unlink()
    loop.symlink_to(loop)
    updater = StoreUpdater(store, log)
    assert updater.poll() and store.version_of("t0") == 2 and updater.rejected == 1


def test_the_readers_take_the_header_only_with_the_bytes_it_declares():
    """A seeded mutation of honest headers and sizes: every reading is exact or an ArtifactError."""
    rng = np.random.default_rng(48)
    for _ in range(300):
        rows = int(rng.integers(0, 5))
        honest = io.BytesIO()
        np.save(honest, np.zeros((rows, 3), "<f4"), allow_pickle=False)
        data = bytearray(honest.getvalue())
        size = len(data)
        kind = rng.integers(0, 3)
        if kind == 1:  # a few bytes of the header changed
            for at in rng.integers(0, min(len(data), 128), size=int(rng.integers(1, 4))):
                data[at] = int(rng.integers(0, 256))
        elif kind == 2:  # the file cut or padded
            size = max(0, size + int(rng.integers(-16, 17)))
            data = data[:size] + bytes(max(0, size - len(data)))
        try:
            stream = io.BytesIO(bytes(data))
            shape, dtype = sized_npy_header(stream, "mutated.npy", size)
        except ArtifactError:
            continue
        assert stream.tell() + int(np.prod(shape)) * dtype.itemsize == size  # never more than is there


# ---- one check before publishing and after: byte order, values --------------------------------


def test_a_big_endian_delta_is_refused_before_it_is_published(tmp_path, store):
    """Before: published, then refused by every server (the table's later updates blocked)."""
    log = UpdateLog(tmp_path, base_version=1)
    with pytest.raises(DeltaError, match="vectors are >f4, expected float32 \\(little-endian\\)"):
        log.publish("t0", np.array([1, 2], np.int64), np.ones((2, DIM), ">f4"), DIM)
    with pytest.raises(DeltaError, match="keys are >i8"):
        log.publish("t0", np.array([1, 2], ">i8"), np.ones((2, DIM), np.float32), DIM)
    assert log.versions("t0") == [] and log.head("t0") == 1


def test_a_big_endian_delta_file_is_published_little_endian_and_served(tmp_path, tables, store):
    keys = tables["t0"].keys[:2]
    np.savez(tmp_path / "d.npz", keys=keys.astype(">i8"), vectors=np.full((2, DIM), 7, ">f4"))
    got_keys, got_vectors = read_delta_file(tmp_path / "d.npz")
    assert got_keys.dtype.str == "<i8" and got_vectors.dtype.str == "<f4"
    log = UpdateLog(tmp_path / "log", base_version=1)
    updater = StoreUpdater(store, log)
    assert log.publish("t0", got_keys, got_vectors, DIM) == 2
    assert updater.poll() and updater.rejected == 0 and first_values(store, "t0", keys) == [7, 7]


def test_what_publish_accepts_the_servers_apply_and_nothing_else(tmp_path, tables):
    """A seeded set of deltas (dtypes, byte orders, shapes, values): published ⇔ applied."""
    rng = np.random.default_rng(7)
    keys = tables["t0"].keys
    for case in range(40):
        n = int(rng.integers(1, 4))
        key_type = rng.choice(["<i8", ">i8", "<i4"])
        vector_type = rng.choice(["<f4", ">f4", "<f8", "<f2"])
        width = DIM if rng.random() < 0.8 else DIM + 1
        vectors = rng.normal(size=(n, width)) * 10 ** float(rng.choice([0, 3, 7, 30]))
        store = TieredStore.from_tables(tables)
        log = UpdateLog(tmp_path / str(case), base_version=1)
        updater = StoreUpdater(store, log)
        with np.errstate(over="ignore"):  # 1e30 as float16 is Inf: refused like any Inf
            vectors = vectors.astype(vector_type)
        try:
            log.publish("t0", keys[:n].astype(key_type), vectors, DIM)
        except DeltaError:
            assert log.versions("t0") == []
            continue
        assert updater.poll() and updater.rejected == 0, (key_type, vector_type, updater.problems)
        assert store.version_of("t0") == 2


def test_a_delta_with_a_huge_finite_value_is_refused_before_publishing(tmp_path, tables):
    """Before: 1e30 was published and served: a score of Inf or NaN for every request using the row."""
    log = UpdateLog(tmp_path, base_version=1)
    vectors = np.ones((2, DIM), np.float32)
    vectors[1, 2] = 1e30
    with pytest.raises(DeltaError, match="row 1 holds NaN or Inf, or a value over 1e\\+06 in magnitude"):
        log.publish("t0", tables["t0"].keys[:2], vectors, DIM)
    vectors[1, 2] = -1e6  # the bound itself is served
    assert log.publish("t0", tables["t0"].keys[:2], vectors, DIM) == 2


# ---- the rebuild file -------------------------------------------------------------------------


def test_the_rebuild_file_is_emptied_once_the_builder_has_read_it(tmp_path):
    """Before: every request's users were appended for good (about 1 MB/s per client with new users)."""
    path = tmp_path / "events.jsonl.rebuild"
    writer, builder = FileRebuilds(path), FileRebuilds(path)
    writer.add(range(1000))
    assert path.stat().st_size > 10_000
    assert builder.take().tolist() == list(range(1000))
    assert path.stat().st_size == 0 and builder.truncated == 1
    writer.add([5, 6])
    assert builder.take().tolist() == [5, 6] and path.stat().st_size == 0


def test_the_rebuild_file_is_bounded_while_no_builder_takes_it(tmp_path):
    path = tmp_path / "r"
    queue = RebuildQueue(FileRebuilds(path, max_bytes=1000), flush_s=3600)
    for start in range(0, 400, 20):
        queue.add(np.arange(start, start + 20))
        queue.flush()
    assert path.stat().st_size <= 1000 and queue.failed > 0  # counted as lost, never over the bound
    with pytest.raises(RebuildsFull):
        FileRebuilds(path, max_bytes=1000).add(range(100))
    taken = FileRebuilds(path).take()
    assert taken.size > 0 and path.stat().st_size == 0  # a builder empties it; appends go on
    queue.add(np.array([12345]))
    assert queue.flush() == 1


def test_concurrent_writers_lose_no_user_while_the_builder_empties_the_file(tmp_path):
    path = tmp_path / "r"
    per_writer, writers = 2000, 4

    def write(w: int) -> None:
        sink = FileRebuilds(path)  # each its own open file, as separate processes have
        for start in range(0, per_writer, 50):
            sink.add(range(w * per_writer + start, w * per_writer + start + 50))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    builder, seen = FileRebuilds(path, max_bytes=1 << 30), []
    while any(t.is_alive() for t in threads):
        seen.append(builder.take(chunk_bytes=4096))
    for thread in threads:
        thread.join()
    while (part := builder.take()).size:
        seen.append(part)
    assert np.array_equal(np.unique(np.concatenate(seen)), np.arange(writers * per_writer))
    assert builder.refused == 0 and path.stat().st_size == 0


# ---- the local user-state database ----------------------------------------------------------


def _truncated(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE states (user INTEGER PRIMARY KEY, seq INTEGER, expires REAL, value BLOB)")
    db.executemany("INSERT INTO states VALUES (?, 1, 1e12, ?)", ((u, os.urandom(600)) for u in range(3000)))
    db.commit()
    db.close()
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2])


DAMAGE = {
    "garbage": lambda path: path.write_bytes(os.urandom(8192)),
    "text": lambda path: path.write_text("not a database\n"),
    "cut short": _truncated,
    "other table": lambda path: sqlite3.connect(path).execute("CREATE TABLE states (a TEXT, b TEXT)").close(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_corrupt_user_state_database_is_set_aside_and_replaced(tmp_path, damage, caplog):
    """Before: ``sqlite3.DatabaseError`` in the step's initialize: the server did not start."""
    path = tmp_path / "user_states.sqlite"
    DAMAGE[damage](path)
    before = path.read_bytes()
    states = LocalUserStates(path, ttl_s=60, max_tokens=8)
    assert states.set_aside == 1 and "set aside as user_states.sqlite.corrupt-" in caplog.text
    (aside,) = tmp_path.glob("user_states.sqlite.corrupt-*[0-9]")
    assert aside.read_bytes() == before  # kept for whoever looks into it
    assert states.fetch(np.array([3])).outcomes == ["absent"]
    assert states.put(3, UserState(4, EXACT, Tokens.empty())) and states.fetch(np.array([3])).outcomes == [
        "found"
    ]
    again = LocalUserStates(path, ttl_s=60, max_tokens=8)  # another process opening the new file
    assert again.set_aside == 0 and again.fetch(np.array([3])).outcomes == ["found"]
    samples = {s.name: s.value for s in UserStateCounts().samples(set_aside=states.set_aside)}
    assert samples["recserve_user_state_set_aside_total"] == 1


def test_a_database_damaged_while_served_fails_the_fetch_not_the_request(tmp_path):
    path = tmp_path / "s.sqlite"
    states = LocalUserStates(path, ttl_s=60, max_tokens=8)
    states._connection().execute("DROP TABLE states")  # what a damaged page reads like: the query fails
    fetched = states.fetch(np.array([1, 2]))
    assert fetched.outcomes == [ERROR, ERROR] and states.errors == 1


def test_deleting_a_user_id_beyond_int64_is_one_error_line(tmp_path, capsys):
    """Before: an OverflowError traceback from SQLite."""
    code = main(["--spec", "tiny", "user-state", "delete", "--user", str(10**23), "--folder", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: --user: user id 100000000000000000000000 is beyond int64"), (
        err
    )
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
