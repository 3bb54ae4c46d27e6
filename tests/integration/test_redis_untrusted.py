"""Redis is untrusted storage, behind a real tritonserver and a password-protected Redis Cluster.

The target-item table lives only in L3. Garbage under some of its keys costs those keys their rows
(the table's default, counted as ``bad_value``), never the request; without the password the server
does not start, and its log says why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.store.redis_tier import RedisTier, redis_keys
from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.core.names import HISTORY_KEYS, TARGET_KEY
from recserve.perf.harness.l3_repository import l3_repository
from recserve.perf.harness.redis_cluster import RedisCluster
from recserve.server import Ports, ServerProcessError, TritonServer

from .helpers import grpc_client, infer_raw, metrics_text, recserve, wait_for

pytestmark = pytest.mark.integration

_BAD_VALUES = re.compile(r'^recserve_store_l3_errors_total\{[^}]*reason="bad_value"[^}]*\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def loaded(spec, repository, tmp_path_factory):
    """A password-protected cluster holding the item table of an L3-only copy of the repository."""
    root = tmp_path_factory.mktemp("untrusted")
    with RedisCluster(root / "redis") as cluster:
        variant = l3_repository(
            spec, repository, root / "repository", cluster.nodes, 500.0, cluster.password_env
        )
        spec_file = root / "variant.json"
        spec_file.write_text(json.dumps(variant.source))
        result = recserve("--spec", str(spec_file), "redis-load", "--repository", str(root / "repository"))
        assert result.returncode == 0, result.stderr  # the CLI reaches the cluster with the password
        yield cluster, root


def test_garbage_under_item_keys_costs_those_rows_alone_and_is_counted(spec, repository, loaded):
    cluster, root = loaded
    wire = generate(spec, 16, seed=31).to_wire(spec)
    expected = reference_pipeline(spec, repository, runtime="torch").predict(wire)
    keys = FeatureTransform(spec).transform(wire)
    targets = keys[TARGET_KEY].reshape(-1)
    spoilt = targets[:4]  # a short row, a row holding NaN, a row of odd length, a huge finite row
    garbage = [
        np.ones(spec.model.embedding_dim // 2, np.float32).tobytes(),
        np.full(spec.model.embedding_dim, np.nan, np.float32).tobytes(),
        b"\x01" * 7,
        np.full(spec.model.embedding_dim, 3e38, np.float32).tobytes(),  # before: NaN scores, uncounted
    ]
    writer = RedisTier.connect(cluster.store_section(redis_deadline_ms=10_000.0))
    try:
        writer.client.mset_nonatomic(dict(zip(redis_keys(spoilt), garbage, strict=True)))
    finally:
        writer.close()
    touched = np.isin(targets, spoilt) | np.isin(keys[HISTORY_KEYS], spoilt).any(axis=1)
    with TritonServer(root / "repository", Ports.free(), log_path=root / "server.log") as server:
        with grpc_client(server) as grpc:
            got = infer_raw(grpcclient, grpc, spec, wire)  # before: INTERNAL for the whole request
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got[~touched], expected[~touched], rtol=0, atol=1e-5)

        def bad_values() -> float:
            return sum(float(v) for v in _BAD_VALUES.findall(metrics_text(server)))

        # the metrics thread publishes once a second
        wait_for(lambda: bad_values() >= len(spoilt), 10, "the refused values on the metrics endpoint")
        assert "refused" in (root / "server.log").read_text(errors="replace")  # one warning, naming a key


def test_without_the_password_the_server_does_not_start_and_says_why(loaded, monkeypatch):
    cluster, root = loaded
    monkeypatch.delenv(cluster.password_env)
    with pytest.raises(ServerProcessError) as failed:
        TritonServer(root / "repository", Ports.free(), log_path=root / "no-password.log").start(
            timeout_s=120
        )
    log = (root / "no-password.log").read_text(errors="replace")
    assert f"redis_password_env names {cluster.password_env}, which is not set" in log, failed.value
    assert cluster.password not in log


def test_redis_load_with_a_wrong_password_is_one_error_line(loaded):
    cluster, root = loaded
    env = {**os.environ, cluster.password_env: "not-the-password"}
    result = subprocess.run(
        [sys.executable, "-m", "recserve.cli", "--spec", str(root / "variant.json"), "redis-load",
         "--repository", str(root / "repository")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and "refused the default user with the password in $RECSERVE_REDIS_PASSWORD" in errors[0]
    assert "Traceback" not in result.stderr and "not-the-password" not in result.stderr
