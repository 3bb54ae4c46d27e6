"""The tiered store behind a real tritonserver: online updates, rollback, explain, L3 on Redis Cluster."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.steps.explain import FIELDS
from recserve.backends.store import kernels
from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.clients import CTRClient
from recserve.clients.writers import write_csv
from recserve.core.names import SPARSE_KEYS, TARGET_KEY
from recserve.perf.harness.l3_repository import l3_repository
from recserve.perf.harness.redis_cluster import RedisCluster
from recserve.server import Ports, TritonServer

from .helpers import copy_repository, grpc_client, infer_raw, metrics_text, recserve, wait_for


def predict(server, spec, wire) -> np.ndarray:
    with grpc_client(server) as client:
        return infer_raw(grpcclient, client, spec, wire)


@pytest.fixture(scope="module")
def private(repository, tmp_path_factory):
    """A server on a private copy of the repository, so its update log is this module's own."""
    root = copy_repository(repository, tmp_path_factory.mktemp("store") / "repository")
    with TritonServer(root, Ports.free(), log_path=root.parent / "server.log") as running:
        yield root, running


class Traffic:
    """Requests in a loop on another connection while a test changes the store; collects failures."""

    def __init__(self, server, spec) -> None:
        self.wire = generate(spec, 8, seed=99).to_wire(spec)
        self.server, self.spec = server, spec
        self.failures: list[str] = []
        self.served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with grpc_client(self.server) as client:
            while not self._stop.is_set():
                try:
                    infer_raw(grpcclient, client, self.spec, self.wire)
                    self.served += 1
                except Exception as exc:  # collected: no request may fail
                    self.failures.append(repr(exc))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_delta_changes_the_rows_using_its_keys_and_rollback_restores_them_exactly(private, spec, tmp_path):
    root, server = private
    with Traffic(server, spec) as traffic:
        check_update_and_rollback(root, server, spec, tmp_path)
    assert traffic.failures == [] and traffic.served > 10  # updates under load lose no request


def check_update_and_rollback(root, server, spec, tmp_path):
    wire = generate(spec, 24, seed=11).to_wire(spec)
    wire[spec.target.name][:4] = -1  # rows without items (no target, empty history) keep their score
    wire[spec.sequence_length_input][:4] = 0
    before = predict(server, spec, wire)
    target_keys = FeatureTransform(spec).transform(wire)[TARGET_KEY][4:, 0]
    keys = np.unique(target_keys)
    np.savez(
        tmp_path / "delta.npz",
        keys=keys,
        vectors=np.full((len(keys), spec.model.embedding_dim), 0.5, np.float32),
    )
    published = recserve(
        "update",
        "--table",
        spec.target.table,
        "--delta",
        str(tmp_path / "delta.npz"),
        "--repository",
        str(root),
    )
    assert published.returncode == 0, published.stderr
    assert "version 2" in published.stderr
    lag = wait_for(lambda: not np.array_equal(predict(server, spec, wire)[4:], before[4:]), timeout_s=10)
    after = predict(server, spec, wire)
    assert np.array_equal(after[:4], before[:4]) and (after[4:] != before[4:]).all()

    rolled = recserve("rollback", "--table", spec.target.table, "--to", "1", "--repository", str(root))
    assert rolled.returncode == 0, rolled.stderr
    wait_for(lambda: np.array_equal(predict(server, spec, wire), before), timeout_s=10)
    print(f"delta served {lag:.2f} s after publication")

    def version_metric() -> bool:
        predict(server, spec, wire)
        text = metrics_text(server)
        return f'recserve_table_version{{table="{spec.target.table}"}} 3' in text and 'tier="l2"' in text

    wait_for(version_metric, timeout_s=10)


def test_responses_name_the_embedding_versions_that_served_them(private, spec, tmp_path):
    """Every response says which table versions served it, once for the request (not once per row).

    A batch is one snapshot; a delta moves only its table.
    """
    root, server = private
    wire = generate(spec, 8, seed=31).to_wire(spec)
    item = spec.table_names.index(spec.target.table)
    seen, stop = [], threading.Event()

    def traffic() -> None:
        with CTRClient(server.grpc_url, spec=spec, timeout_s=30) as client:
            while not stop.is_set():
                seen.append(client.score_inputs(wire))

    with CTRClient(server.http_url, protocol="http", spec=spec, timeout_s=30) as client:
        before = client.score_inputs(wire)
        assert before.embedding_version.shape == (len(spec.table_names),) and before.dense_version == 1
        old = int(before.embedding_version[item])
        keys = np.unique(FeatureTransform(spec).transform(wire)[TARGET_KEY])
        np.savez(
            tmp_path / "delta.npz",
            keys=keys,
            vectors=np.full((len(keys), spec.model.embedding_dim), 0.25, np.float32),
        )
        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            published = recserve(
                "update",
                "--table",
                spec.target.table,
                "--delta",
                str(tmp_path / "delta.npz"),
                "--repository",
                str(root),
            )
            assert published.returncode == 0, published.stderr
            wait_for(lambda: client.score_inputs(wire).embedding_version[item] == old + 1, timeout_s=10)
            after = client.score_inputs(wire)
            time.sleep(0.5)
        finally:
            stop.set()
            thread.join()
    assert after.table_versions()[spec.target.table] == old + 1
    assert np.array_equal(np.delete(after.embedding_version, item), np.delete(before.embedding_version, item))
    assert not np.allclose(after.probabilities, before.probabilities, rtol=0, atol=1e-4)
    assert len(seen) > 5
    for scores in seen:  # one snapshot per response; its probabilities are that version's
        reference = before if scores.embedding_version[item] == old else after
        assert scores.embedding_version[item] in (old, old + 1)
        np.testing.assert_allclose(scores.probabilities, reference.probabilities, rtol=0, atol=1e-5)
    assert seen[-1].embedding_version[item] == old + 1


def test_malformed_delta_is_refused_with_a_clear_message_and_nothing_is_published(private, spec, tmp_path):
    root, _ = private
    np.savez(
        tmp_path / "bad.npz",
        keys=np.array([1, 2], np.int64),
        vectors=np.zeros((2, spec.model.embedding_dim + 1), np.float32),
    )
    result = recserve(
        "update", "--table", "C1", "--delta", str(tmp_path / "bad.npz"), "--repository", str(root)
    )
    assert result.returncode == 1
    assert f"expected [2, {spec.model.embedding_dim}]" in result.stderr
    assert not (root / "embedding_lookup" / "updates" / "C1").exists() or not any(
        p.name.startswith("v") for p in (root / "embedding_lookup" / "updates" / "C1").iterdir()
    )


def test_explain_shows_value_key_table_tier_and_version_per_feature(private, spec, tmp_path):
    root, _ = private
    rows = generate(spec, 3, seed=4)
    write_csv(tmp_path / "rows.csv", rows, spec, with_label=False)
    result = recserve("explain", "--input", str(tmp_path / "rows.csv"), "--json", "--repository", str(root))
    assert result.returncode == 0, result.stderr
    everything = [json.loads(line) for line in result.stdout.splitlines()]
    numeric = [r for r in everything if r["tier"] == "dense"]  # what the dense network gets of each number
    assert len(numeric) == 3 * len(spec.normalized_columns)
    records = [r for r in everything if r["tier"] != "dense"]
    history = int(rows.lengths.sum())
    assert len(records) == 3 * (spec.num_sparse + 1) + history
    keys = FeatureTransform(spec).transform(rows.to_wire(spec))[SPARSE_KEYS]
    c1 = [r for r in records if r["feature"] == "C1"]
    assert [r["key"] for r in c1] == keys[:, 0].tolist()
    for record in records:
        assert set(record) == set(FIELDS)
        assert (
            record["tier"] in {"l1", "delta", "l2", "default"} and record["dim"] == spec.model.embedding_dim
        )


def test_served_through_l3_equals_l2_and_a_killed_master_fails_no_inference(spec, repository, tmp_path):
    reference = reference_pipeline(spec, repository, runtime="torch")
    wire = generate(spec, 16, seed=21).to_wire(spec)
    expected = reference.predict(wire)
    with RedisCluster(tmp_path / "redis") as cluster:
        variant = l3_repository(
            spec, repository, tmp_path / "repository", cluster.nodes, 200.0, cluster.password_env
        )
        spec_file = tmp_path / "variant.json"
        spec_file.write_text(json.dumps(variant.source))
        loaded = recserve(
            "--spec", str(spec_file), "redis-load", "--repository", str(tmp_path / "repository")
        )
        assert loaded.returncode == 0, loaded.stderr
        cluster.wait_replicated()  # the master killed below must not take rows its replica lacks
        with TritonServer(tmp_path / "repository", Ports.free(), log_path=tmp_path / "server.log") as server:
            wait_for(
                lambda: np.allclose(predict(server, spec, wire), expected, rtol=0, atol=1e-5), timeout_s=20
            )
            with Traffic(server, spec) as traffic:
                time.sleep(1.0)
                victim = cluster.masters()[0]
                cluster.kill(victim)
                wait_for(lambda: victim not in cluster.masters(), timeout_s=30)
                cluster.wait_ok(timeout_s=30)
                wait_for(
                    lambda: np.allclose(predict(server, spec, wire), expected, rtol=0, atol=1e-5),
                    timeout_s=20,
                )
    assert traffic.failures == [] and traffic.served > 10


def test_the_served_store_runs_the_compiled_loops(private, spec):
    if kernels.load() is None:
        pytest.skip("the compiled store kernels are not built here (no C compiler at install)")
    _, server = private
    wire = generate(spec, 4, seed=5).to_wire(spec)

    def compiled_metric() -> bool:
        with grpc_client(server) as client:
            infer_raw(grpcclient, client, spec, wire)
        text = metrics_text(server)
        return "\nrecserve_store_compiled 1" in text

    wait_for(compiled_metric, timeout_s=10)
