"""Request ids reach every step, and a server started with a log folder logs what it served.

One real tritonserver with ``RECSERVE_LOG_DIR`` set (what ``recserve serve --log-dir`` sets), requests
through the SDK (rows over gRPC and HTTP, a candidate list sent as two requests) and one raw request
carrying the access layer's variant headers; the server is stopped (its steps write what they hold)
and the Parquet segments read back with pyarrow.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import tritonclient.grpc as grpcclient

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.request_log.read import read_kind, read_log, segment_paths
from recserve.build.synthetic import generate
from recserve.clients import CTRClient, read_rows
from recserve.clients.writers import write_tsv
from recserve.core.names import (
    DENSE_NORMALIZED,
    SPARSE_KEYS,
    TARGET_KEY,
    TRAFFIC_HEADER,
    VARIANT_HEADER,
)
from recserve.core.sections.logging import LOG_DIR_ENV
from recserve.server import Ports, TritonServer
from tests.integration.helpers import infer_inputs, recserve


@pytest.fixture(scope="module")
def served(spec, repository, tmp_path_factory):
    """What the clients got from a logging server, and the log folder (read after the server stopped)."""
    folder = tmp_path_factory.mktemp("request_log")
    raw = generate(spec, 300, seed=46)
    rows = read_rows(write_tsv(folder / "rows.tsv", raw, spec), spec)
    log_dir = folder / "log"
    patch = pytest.MonkeyPatch()
    patch.setenv(LOG_DIR_ENV, str(log_dir))
    got = {}
    try:
        with TritonServer(repository, Ports.free(), log_path=folder / "server.log") as server:
            with CTRClient(server.grpc_url, timeout_s=30, spec=spec) as client:
                got["grpc"] = client.score_inputs(rows.take(slice(0, 20)).to_inputs(spec), "rows-grpc")
                user = {"history_items": rows.history[3, : rows.lengths[3]].tolist()}
                got["list"] = client.score_candidates(user, rows)  # 300 candidates: two requests
                got["list_ids"] = client.last_request_ids
                got["user"] = user
            with CTRClient(server.http_url, protocol="http", timeout_s=30, spec=spec) as client:
                got["http"] = client.score_inputs(rows.take(slice(20, 27)).to_inputs(spec))  # a new id
            with grpcclient.InferenceServerClient(server.grpc_url) as raw_client:
                result = raw_client.infer(
                    spec.name,
                    infer_inputs(grpcclient, rows.take(slice(27, 30)).to_inputs(spec)),
                    request_id="raw-canary",
                    headers={VARIANT_HEADER: "canary", TRAFFIC_HEADER: "shadow", "recserve-admin-key": "x"},
                )
                got["raw"] = result.as_numpy("probability").reshape(-1)
    finally:
        patch.undo()
    return rows, got, log_dir


def test_every_step_logs_the_client_request_id_with_the_scores_it_got(served):
    rows, got, log_dir = served
    assert got["http"].request_id and got["http"].request_id != "rows-grpc"  # made by the client
    assert len(got["list_ids"]) == 2 and got["list_ids"][0].endswith(".0")
    log = read_log(log_dir).to_pydict()
    by_request: dict[str, dict[int, float]] = {}
    for request_id, row, score in zip(log["request_id"], log["row"], log["score"], strict=True):
        by_request.setdefault(request_id, {})[row] = score
    expected = {
        "rows-grpc": got["grpc"].probabilities,
        got["http"].request_id: got["http"].probabilities,
        got["list_ids"][0]: got["list"][:256],
        got["list_ids"][1]: got["list"][256:],
        "raw-canary": got["raw"],
    }
    assert set(by_request) == set(expected)
    for request_id, scores in expected.items():
        logged = np.array([by_request[request_id][r] for r in range(len(scores))], np.float32)
        assert len(by_request[request_id]) == len(scores)
        np.testing.assert_array_equal(logged, scores)  # bit for bit: the score the client got
    # both steps saw the same id (a features row met its score row) and the dense version
    assert set(log["dense_version"]) == {got["grpc"].dense_version}
    assert log["embedding_version"][0] == list(got["grpc"].embedding_version)


def test_the_logged_keys_and_dense_values_are_those_the_transform_gives(served, spec):
    rows, got, log_dir = served
    table = read_kind(log_dir, "features")
    mine = table.filter(pq.filters_to_expression([("request_id", "=", "rows-grpc")])).sort_by("row")
    features = FeatureTransform(spec).transform(rows.take(slice(0, 20)).to_inputs(spec))
    keys = np.concatenate([features[SPARSE_KEYS], features[TARGET_KEY]], axis=1)
    np.testing.assert_array_equal(np.array(mine["keys"].to_pylist()), keys)
    np.testing.assert_array_equal(np.array(mine["dense"].to_pylist(), np.float32), features[DENSE_NORMALIZED])
    # each row-layout row carries its own history: once per distinct history, the others point to it
    for row, (history_row, history) in enumerate(
        zip(mine["history_row"].to_pylist(), mine["history"].to_pylist(), strict=True)
    ):
        items = rows.history[row, : rows.lengths[row]]
        assert (history is not None) == (history_row == row)
        if history is not None:
            assert len(history) == len(items)


def test_a_candidate_list_logs_its_user_history_once(served, spec):
    rows, got, log_dir = served
    table = read_kind(log_dir, "features").to_pydict()
    first = [i for i, rid in enumerate(table["request_id"]) if rid == got["list_ids"][0]]
    assert len(first) == 256
    histories = [table["history"][i] for i in first if table["history"][i] is not None]
    assert len(histories) == 1 and len(histories[0]) == len(got["user"]["history_items"])
    assert {table["history_row"][i] for i in first} == {0}


def test_the_access_layer_headers_reach_the_steps_and_nothing_else_does(served):
    rows, got, log_dir = served
    for kind in ("features", "scores"):
        table = read_kind(log_dir, kind).to_pydict()
        pairs = list(zip(table["request_id"], table["variant"], table["traffic"], strict=True))
        marks = {(v, t) for rid, v, t in pairs if rid == "raw-canary"}
        others = {(v, t) for rid, v, t in pairs if rid != "raw-canary"}
        assert marks == {("canary", "shadow")}
        assert others == {("", "live")}
    assert segment_paths(log_dir, "scores") and not list(log_dir.rglob(".*.tmp"))


def test_the_logged_rows_scored_again_offline_give_the_logged_scores(served, repository):
    """No training/serving skew: ``recserve verify --log`` rescores every logged row from its logged keys,
    dense values and history through the repository's store and network, and gets the logged score."""
    _, _, log_dir = served
    done = recserve("verify", "--log", str(log_dir), "--repository", str(repository))
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)
    counts = re.search(r"(\d+) logged rows; (\d+) scored again .* max \|delta\| (\S+)", done.stdout)
    assert counts is not None, done.stdout
    logged, rescored, delta = int(counts[1]), int(counts[2]), float(counts[3])
    assert logged == rescored == 20 + 300 + 7 + 3 and delta <= 1e-6, done.stdout
