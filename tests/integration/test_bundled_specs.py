"""The bundled ``avazu`` and ``taobao`` specs end to end: built, served by a real tritonserver, queried,
explained (``ctr``, the default, is what the rest of the integration tests serve).

Avazu has no numeric feature and no sequence, string and integer ids, a ``YYMMDDHH`` time column
and an ``id`` column above 2^63 that is accepted and ignored. Taobao has a multi-hot column, a unix
timestamp, and two behaviour sequences sharing positions (items, their categories) with a target each.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from recserve.build.importer import import_repository
from recserve.build.repository import build_repository, reference_pipeline, version_dir
from recserve.build.synthetic import generate
from recserve.clients.writers import write_csv
from recserve.core.names import DENSE
from recserve.core.spec.parse import load_spec
from recserve.server import Ports, TritonServer
from tests.integration.private_server import private_server
from tests.model_exports import export_tables
from tests.user_runs import with_runs

from .helpers import grpc_client, infer_raw

CLI = [sys.executable, "-m", "recserve.cli", "--spec"]
BUNDLED = ("avazu", "taobao")


@pytest.fixture(scope="module", params=BUNDLED)
def bundled(request):
    return load_spec(request.param)


@pytest.fixture(scope="module")
def bundled_repository(bundled, tmp_path_factory):
    path = tmp_path_factory.mktemp(bundled.name) / "repository"
    build_repository(bundled, path)
    return path


@pytest.fixture(scope="module")
def bundled_server(bundled_repository, tmp_path_factory):
    log = tmp_path_factory.mktemp("bundled_server") / "server.log"
    with TritonServer(bundled_repository, Ports.free(), log_path=log) as running:
        yield running


@pytest.fixture(scope="module")
def avazu(bundled):
    if bundled.name != "avazu":
        pytest.skip("an avazu test")
    return bundled


@pytest.fixture(scope="module")
def taobao(bundled):
    if bundled.name != "taobao":
        pytest.skip("a taobao test")
    return bundled


def test_avazu_has_no_numeric_input_and_no_sequence(avazu):
    assert [t.name for t in avazu.wire_inputs()] == ["categorical"]
    assert avazu.categorical.columns[:3] == ("hour", "C1", "banner_pos")
    names = [f.name for f in avazu.categorical.features]
    # every categorical feature twice: its embedding and its first-order weight
    assert names[:2] == ["hour_hour_of_day", "hour_weekday"] and len(names) == 2 + 2 * 21
    assert avazu.dense.columns == () and avazu.normalized_columns == ("C15_number",)


def test_taobao_sends_both_behaviours_and_their_targets_once(taobao):
    names = [t.name for t in taobao.wire_inputs()]
    assert names[3:] == [
        "tags", "item_id", "cate_id", "hist_item_ids", "hist_cate_ids", "cart_item_ids", "cart_cate_ids",
        "hist_item_ids__length", "cart_item_ids__length",
    ]  # fmt: skip
    assert taobao.categorical.slot_names[-1] == "tags" and taobao.num_sparse == 14


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_served_equals_pytorch_reference(bundled, bundled_repository, bundled_server, batch):
    wire_inputs = generate(bundled, batch, seed=batch).to_wire(bundled)
    expected = reference_pipeline(bundled, bundled_repository, runtime="torch").predict(wire_inputs)
    with grpc_client(bundled_server) as client:
        served = infer_raw(grpcclient, client, bundled, wire_inputs)
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-5)
    assert ((served > 0) & (served < 1)).all() and len(np.unique(served)) > batch // 2


def _as_exported(path, rows_path):
    """The rows as Avazu's own file: ``id`` first (above 2^63), ``click``, integers as pandas writes them."""
    with open(rows_path, newline="") as fh:
        table = list(csv.reader(fh))
    with open(path, "w", newline="") as out:
        writer = csv.writer(out, lineterminator="\r\n", quoting=csv.QUOTE_NONNUMERIC)
        writer.writerow(["id", *table[0]])
        for i, row in enumerate(table[1:]):
            c1 = table[0].index("C1")
            row[c1] = f"{row[c1]}.0" if row[c1] else row[c1]
            writer.writerow([str(10000174058809263569 + i), *row])
    return path


def _predicts_the_reference(spec, repository, server, path, raw) -> None:
    """``recserve predict`` on the file prints the in-process PyTorch scores of ``raw``."""
    done = subprocess.run(
        [*CLI, spec.name, "predict", "--input", str(path), "--url", server.grpc_url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = np.array([float(line) for line in done.stdout.split()])
    expected = reference_pipeline(spec, repository, runtime="torch").predict(raw.to_wire(spec))
    np.testing.assert_allclose(printed, expected, atol=1e-5)


def test_predict_scores_an_avazu_export(avazu, bundled_repository, bundled_server, tmp_path):
    raw = generate(avazu, 40, seed=11)
    exported = _as_exported(tmp_path / "train.csv", write_csv(tmp_path / "rows.csv", raw, avazu))
    _predicts_the_reference(avazu, bundled_repository, bundled_server, exported, raw)


def test_predict_scores_a_csv_with_both_sequences(taobao, bundled_repository, bundled_server, tmp_path):
    raw = generate(taobao, 40, seed=12)
    rows = write_csv(tmp_path / "rows.csv", raw, taobao)
    assert "hist_cate_ids" in rows.read_text().splitlines()[0]
    _predicts_the_reference(taobao, bundled_repository, bundled_server, rows, raw)


def test_predict_sends_a_users_consecutive_rows_as_one_candidate_list(
    taobao, bundled_repository, bundled_server, tmp_path
):
    runs = [slice(0, 5), slice(5, 6), slice(6, 14), slice(14, 20)]
    raw = with_runs(taobao, generate(taobao, 20, seed=13), runs)
    rows = write_csv(tmp_path / "rows.csv", raw, taobao)
    with grpcclient.InferenceServerClient(bundled_server.grpc_url) as client:

        def lists():
            (stats,) = client.get_inference_statistics(taobao.candidates_model).model_stats
            return stats.inference_count

        before = lists()
        _predicts_the_reference(taobao, bundled_repository, bundled_server, rows, raw)
        assert lists() - before == 3  # the runs of 5, 8 and 6 rows; the single row went as a row


def test_explain_names_every_feature(bundled, bundled_repository, tmp_path):
    raw = generate(bundled, 2, seed=3)
    rows = write_csv(tmp_path / "rows.csv", raw, bundled)
    explain = [*CLI, bundled.name, "explain", "--json", "--input", str(rows)]
    done = subprocess.run(
        [*explain, "--repository", str(bundled_repository)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    features = {r["feature"] for r in map(json.loads, done.stdout.splitlines())}
    expected = {
        "avazu": {"hour_hour_of_day", "hour_weekday", "device_ip", "C21"},
        "taobao": {
            "time_stamp_weekday",
            "user",
            "item_id",
            "cate_id",
            "hist_item_ids[0]",
            "hist_cate_ids[0]",
        },
    }[bundled.name]
    assert features >= expected
    if bundled.name == "taobao":
        assert any(f.startswith("tags[") for f in features) == bool(raw.categorical[:, -1].any())
        carts = raw.lengths_of("cart_item_ids__length")
        assert ({"cart_item_ids[0]", "cart_cate_ids[0]"} <= features) == bool(carts.any())


def test_a_bad_value_fails_alone_naming_its_column(bundled, bundled_server):
    column = {"avazu": "banner_pos", "taobao": "tags"}[bundled.name]
    wire_inputs = generate(bundled, 3, seed=2).to_wire(bundled)
    tensor = column if column in wire_inputs else "categorical"  # taobao's tags: a list tensor of their own
    if tensor == column:
        wire_inputs[column][1, 0] = b"12a"
    else:
        field = bundled.categorical.wire_columns.index(bundled.categorical.columns.index(column))
        wire_inputs["categorical"][1, field] = b"12a"
    with grpc_client(bundled_server) as client:
        message = rf"input '{tensor}': {column} \(row 1\) is b'12a"
        with pytest.raises(grpcclient.InferenceServerException, match=message):
            infer_raw(grpcclient, client, bundled, wire_inputs)
        good = generate(bundled, 3, seed=2).to_wire(bundled)
        assert infer_raw(grpcclient, client, bundled, good).shape == (3,)


def test_the_model_imported_from_its_tables_and_onnx_serves_the_same_scores(
    bundled, bundled_repository, tmp_path
):
    formats = {name: ("keyed", "hugectr")[i % 2] for i, name in enumerate(bundled.table_names)}
    export_tables(bundled, bundled_repository, tmp_path / "tables", formats)
    onnx = version_dir(bundled_repository, DENSE, bundled) / "model.onnx"
    import_repository(bundled, tmp_path / "tables", onnx, tmp_path / "imported", lambda message: None)
    rows = generate(bundled, 50, seed=31)
    expected = reference_pipeline(bundled, bundled_repository, runtime="torch").predict(rows.to_wire(bundled))
    with private_server(tmp_path / "imported", tmp_path / "serve", model_control="none") as server:
        with grpc_client(server) as client:
            served = infer_raw(grpcclient, client, bundled, rows.to_wire(bundled))
    np.testing.assert_allclose(served, expected, atol=1e-5)
