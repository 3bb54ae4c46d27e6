"""The update path trusts nothing it reads: hostile logs and stream entries never stop a server.

A real tritonserver starts over an update log holding a manifest without a parent, a ``HEAD.json``
naming version 8.7 and a cross-table key clash written behind the CLI's back: it goes READY, each
table serves the newest valid version of its chain, and a restart serves the same. ``recserve
update``/``rollback`` run as subprocesses of the real CLI; the stream test writes hostile entries
into a real Redis Cluster.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from recserve.backends.store.served import ServedStore, updates_dir
from recserve.backends.store.tiered import DELTA
from recserve.backends.store.updates.versions import UpdateLog
from recserve.build.repository import install_adapters
from recserve.build.synthetic import generate
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.perf.harness.redis_cluster import RedisCluster
from recserve.server import Ports, TritonServer

from .helpers import copy_repository, grpc_client, infer_raw, metrics_text, recserve, wait_for

NEW_KEY = 10**15  # keys far from the built tables': deltas may add rows


def metric_values(server: TritonServer, name: str) -> dict[str, float]:
    """``name``'s values by label text, read from the metrics port (no inference request is sent)."""
    found: dict[str, float] = {}
    for labels, value in re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", metrics_text(server), re.MULTILINE):
        found[labels] = max(found.get(labels, float("-inf")), float(value))
    return found


def served_versions(server: TritonServer, tables: list[str]) -> dict[str, int]:
    values = metric_values(server, "recserve_table_version")
    return {t: int(values[f'{{table="{t}"}}']) for t in tables if f'{{table="{t}"}}' in values}


def delta_file(path: Path, keys: np.ndarray, value: float, dim: int) -> Path:
    np.savez(path, keys=np.asarray(keys, np.int64), vectors=np.full((len(keys), dim), value, np.float32))
    return path


def publish(log: UpdateLog, table: str, keys: np.ndarray, value: float, dim: int) -> int:
    keys = np.asarray(keys, np.int64)
    return log.publish(table, keys, np.full((len(keys), dim), value, np.float32), dim)


def edit_manifest(log: UpdateLog, table: str, version: int, change) -> None:
    path = log.root / table / f"v{version:08d}" / "manifest.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def lying_entry(log: UpdateLog, table: str, dim: int) -> dict:
    """A stream entry for ``table``'s next version whose vectors' header claims 2**40 rows."""
    version = publish(log, table, [NEW_KEY + 50], 0.5, dim)
    folder = log.root / table / f"v{version:08d}"
    data = np.load(folder / "vectors.npy").tobytes()
    claimed = [1 << 40, dim]
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": tuple(claimed)}
    )
    content = header.getvalue() + data
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["vectors"].update(
        sha256=hashlib.sha256(content).hexdigest(), bytes=len(content), shape=claimed
    )
    return {
        "table": table,
        "version": str(version),
        "manifest": json.dumps(manifest),
        "file:keys": (folder / "keys.npy").read_bytes(),
        "file:vectors": content,
    }


@pytest.fixture(scope="module")
def hostile(repository, spec, tmp_path_factory):
    """A repository whose update log holds a broken manifest, a float head and a cross-table clash."""
    root = copy_repository(repository, tmp_path_factory.mktemp("update-safety") / "repository")
    install_adapters(spec, root)  # this tree's model.py adapters, whatever the built repository holds
    log = UpdateLog(updates_dir(root / EMBEDDING_LOOKUP / str(spec.version)), spec.version)
    a, b, c = "C1", "C2", "C3"
    dim = spec.model.embedding_dim
    publish(log, a, [NEW_KEY, NEW_KEY + 1], 0.5, dim)  # a v2: valid
    publish(log, a, [NEW_KEY + 2], 0.75, dim)  # a v3: its manifest loses its parent below
    edit_manifest(log, a, 3, lambda doc: doc.pop("parent"))
    publish(log, b, [NEW_KEY + 10], 0.5, dim)  # b v2, then HEAD {"version": 8.7}
    (log.root / b / "HEAD.json").write_text('{"version": 8.7}')
    publish(log, c, [NEW_KEY + 1], 0.25, dim)  # c v2 claims a key of a's v2 (published later)
    return root, log


def test_a_hostile_log_never_stops_the_server_and_a_restart_serves_the_same(hostile, spec, tmp_path):
    root, log = hostile
    tables = ["C1", "C2", "C3"]
    wire = generate(spec, 4, seed=7).to_wire(spec)
    with TritonServer(root, Ports.free(), log_path=tmp_path / "first.log") as server:
        # READY, and serving: C1 on v2 (v3 has no parent), C2 on its newest valid version, C3 on
        # its base (its delta claims C1's key)
        versions = served_versions(server, tables)
        assert versions == {"C1": 2, "C2": 2, "C3": 1}, versions
        assert metric_values(server, "recserve_store_updates_rejected_total")[""] >= 3
        with grpc_client(server) as client:
            assert np.isfinite(infer_raw(grpcclient, client, spec, wire)).all()

        delta = delta_file(tmp_path / "a.npz", [NEW_KEY + 3], 1.0, spec.model.embedding_dim)
        refused = recserve("update", "--table", "C1", "--delta", str(delta), "--repository", str(root))
        assert refused.returncode == 1 and "roll back" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr

        rolled = recserve("rollback", "--table", "C1", "--to", "2", "--repository", str(root))
        assert rolled.returncode == 0, rolled.stderr
        # the served version moves on the metrics endpoint without any inference request
        wait_for(lambda: served_versions(server, ["C1"]) == {"C1": 4}, timeout_s=10, what="C1 at v4")
        before = served_versions(server, tables)

    with TritonServer(root, Ports.free(), log_path=tmp_path / "restart.log") as server:
        assert served_versions(server, tables) == before  # never older than before the restart
        with grpc_client(server) as client:
            assert np.isfinite(infer_raw(grpcclient, client, spec, wire)).all()


def test_a_key_in_another_tables_published_delta_is_refused_at_the_cli(hostile, spec, tmp_path):
    root, log = hostile
    own = delta_file(tmp_path / "own.npz", [NEW_KEY + 20, NEW_KEY + 21], 0.5, spec.model.embedding_dim)
    first = recserve("update", "--table", "C4", "--delta", str(own), "--repository", str(root))
    assert first.returncode == 0, first.stderr
    clash = delta_file(tmp_path / "clash.npz", [NEW_KEY + 21, NEW_KEY + 22], 0.5, spec.model.embedding_dim)
    result = recserve("update", "--table", "C5", "--delta", str(clash), "--repository", str(root))
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: ") and f"key {NEW_KEY + 21} is in the published delta of table 'C4'" in last
    )
    assert "Traceback" not in result.stderr
    assert log.versions("C5") == [] and log.head("C5") == spec.version


def test_sixteen_concurrent_updates_over_two_tables_lose_no_version(repository, spec, tmp_path):
    root = copy_repository(repository, tmp_path / "repository")
    dim, per_table = spec.model.embedding_dim, 8
    jobs = []
    for t, table in enumerate(("C6", "C7")):
        for n in range(per_table):
            keys = NEW_KEY + 1000 * t + 2 * n + np.arange(2)
            jobs.append((table, delta_file(tmp_path / f"{table}-{n}.npz", keys, n + 1, dim)))

    def run(job):
        table, path = job
        return subprocess.run(
            [sys.executable, "-m", "recserve.cli", "update", "--table", table, "--delta", str(path),
             "--repository", str(root)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    assert [r.returncode for r in results] == [0] * len(jobs), [r.stderr for r in results if r.returncode]
    served = ServedStore.open(spec, root / EMBEDDING_LOOKUP / str(spec.version), start=False)
    log = served.updater.log
    for t, table in enumerate(("C6", "C7")):
        chain = [r.version for r in log.chain(table, log.head(table))]
        assert chain == list(range(spec.version + 1, spec.version + 1 + per_table)), chain
        keys = NEW_KEY + 1000 * t + np.arange(2 * per_table)
        got = served.store.lookup(keys, np.full(len(keys), served.store.table_id(table)), record=False)
        assert (got.tiers == DELTA).all(), f"{table}: {int((got.tiers != DELTA).sum())} keys not served"
        assert got.vectors[:, 0].tolist() == [n + 1 for n in range(per_table) for _ in range(2)]


def test_hostile_stream_entries_are_refused_and_write_nothing_outside(tmp_path):
    from recserve.backends.store.redis_tier import RedisTier
    from recserve.backends.store.tiered import TieredStore
    from recserve.backends.store.updates.stream import UpdateStream
    from recserve.backends.store.updates.versions import StoreUpdater
    from tests.store_tables import DIM, make_tables

    tables = make_tables()
    with RedisCluster(tmp_path / "redis") as cluster:
        tier = RedisTier.connect(cluster.store_section(redis_deadline_ms=500.0))
        here = UpdateLog(tmp_path / "here", 1)
        sender = UpdateStream(tier.client, here)
        version = publish(here, "t0", tables["t0"].keys[:2], 3.0, DIM)
        folder = here.root / "t0" / f"v{version:08d}"
        manifest = json.loads((folder / "manifest.json").read_text())
        files = {f"file:{n}": (folder / e["path"]).read_bytes() for n, e in manifest["files"].items()}
        outside = tmp_path / "outside"

        def entry(table, doc, version_field="2", extra=None):
            fields = {"table": table, "version": version_field, "manifest": json.dumps(doc), **files}
            tier.client.xadd("rs:updates", {**fields, **(extra or {})})

        entry("../../outside", {**manifest, "table": "../../outside"})
        entry(str(outside), {**manifest, "table": str(outside)})
        entry("t0", {k: v for k, v in manifest.items() if k != "parent"})
        entry("t0", {**manifest, "created": "yesterday"})
        entry("t0", {**manifest, "version": 8.7}, version_field="8.7")
        entry("t0", manifest, extra={"file:keys": b"not the keys"})
        bad_path = json.loads(json.dumps(manifest))
        bad_path["files"]["keys"]["path"] = "../../../outside.npy"
        entry("t0", bad_path)
        sender.publish("t0", version)  # the one valid entry, last

        there = UpdateLog(tmp_path / "deep" / "there", 1, tables=("t0", "t1"))
        receiver = UpdateStream(tier.client, there)
        assert receiver.mirror() == 1 and receiver.refused == 7
        assert sorted(p.name for p in tmp_path.iterdir()) == ["deep", "here", "redis"]
        assert not outside.exists() and not (tmp_path / "outside.npy").exists()
        assert there.versions("t0") == [2] and there.head("t0") == 2
        store = TieredStore.from_tables(tables)
        assert StoreUpdater(store, there).poll() and store.version_of("t0") == 2
        again = UpdateStream(tier.client, UpdateLog(tmp_path / "deep" / "again", 1, tables=("t0", "t1")))
        assert again.mirror() == 1 and again.refused == 7  # replayed from 0: the same entries refused
        tier.close()


def test_a_server_replaying_hostile_stream_entries_starts_and_serves_the_newest_valid_version(
    spec, repository, tmp_path
):
    """Entries in ``rs:updates`` are replayed from 0 at every start: the hostile ones are skipped.

    One of them is a well-formed version of C2 whose ``vectors.npy`` header claims 2**40 rows (its
    manifest agreeing, checksums right): before, every start allocated what it claimed and the
    MemoryError kept the model from loading; now it is refused when mirrored, like the others.
    """
    from recserve.backends.store.redis_tier import RedisTier
    from recserve.backends.store.updates.stream import UpdateStream
    from recserve.perf.harness.l3_repository import l3_repository

    wire = generate(spec, 4, seed=9).to_wire(spec)
    with RedisCluster(tmp_path / "redis") as cluster:
        root = tmp_path / "repository"
        variant = l3_repository(
            spec, repository, root, cluster.nodes, deadline_ms=200.0, password_env=cluster.password_env
        )
        install_adapters(variant, root)
        (tmp_path / "variant.json").write_text(json.dumps(variant.source))
        loaded = recserve("--spec", str(tmp_path / "variant.json"), "redis-load", "--repository", str(root))
        assert loaded.returncode == 0, loaded.stderr

        tier = RedisTier.connect(cluster.store_section(redis_deadline_ms=500.0))
        publisher = UpdateLog(tmp_path / "publisher", variant.version)
        sender = UpdateStream(tier.client, publisher)
        sender.publish("C1", publish(publisher, "C1", [NEW_KEY], 0.5, spec.model.embedding_dim))  # valid v2
        version = publish(publisher, "C1", [NEW_KEY + 1], 0.5, spec.model.embedding_dim)
        folder = publisher.root / "C1" / f"v{version:08d}"
        manifest = json.loads((folder / "manifest.json").read_text())
        files = {f"file:{n}": (folder / e["path"]).read_bytes() for n, e in manifest["files"].items()}
        orphan = {k: v for k, v in manifest.items() if k != "parent"}
        tier.client.xadd(
            "rs:updates", {"table": "C1", "version": "3", "manifest": json.dumps(orphan), **files}
        )
        traversal = {**manifest, "table": "../../outside", "version": 2}
        tier.client.xadd(
            "rs:updates",
            {"table": "../../outside", "version": "2", "manifest": json.dumps(traversal), **files},
        )
        tier.client.xadd("rs:updates", lying_entry(publisher, "C2", spec.model.embedding_dim))
        tier.close()

        for start in ("first", "restart"):
            with TritonServer(root, Ports.free(), log_path=tmp_path / f"{start}.log") as server:
                assert served_versions(server, ["C1", "C2"]) == {"C1": 2, "C2": variant.version}, start
                assert metric_values(server, "recserve_store_updates_rejected_total")[""] >= 3
                with grpc_client(server) as client:
                    assert np.isfinite(infer_raw(grpcclient, client, spec, wire)).all()
            assert not (root / "outside").exists() and not (root.parent / "outside").exists()
