"""The bundled ``avazu`` spec end to end: built, served by a real tritonserver, queried, explained.

Avazu has no numeric feature and no sequence, string and integer ids, a ``YYMMDDHH`` time column
and an ``id`` column above 2^63 that is accepted and ignored.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from recserve.build.repository import build_repository, reference_pipeline
from recserve.build.synthetic import generate
from recserve.clients.writers import write_csv
from recserve.server import Ports, TritonServer
from recserve.spec import load_spec

from .helpers import grpc_client, infer_raw

CLI = [sys.executable, "-m", "recserve.cli", "--spec", "avazu"]


@pytest.fixture(scope="module")
def avazu():
    return load_spec("avazu")


@pytest.fixture(scope="module")
def avazu_repository(avazu, tmp_path_factory):
    path = tmp_path_factory.mktemp("avazu") / "repository"
    build_repository(avazu, path)
    return path


@pytest.fixture(scope="module")
def avazu_server(avazu_repository, tmp_path_factory):
    log = tmp_path_factory.mktemp("avazu_server") / "server.log"
    with TritonServer(avazu_repository, Ports.free(), log_path=log) as running:
        yield running


def test_the_spec_has_no_numeric_input_and_no_sequence(avazu):
    assert [t.name for t in avazu.wire_inputs()] == ["categorical"]
    assert avazu.categorical.columns[:3] == ("hour", "C1", "banner_pos")
    names = [f.name for f in avazu.categorical.features]
    assert names[:2] == ["hour_hour_of_day", "hour_weekday"] and len(names) == 23


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_served_equals_pytorch_reference(avazu, avazu_repository, avazu_server, batch):
    wire = generate(avazu, batch, seed=batch).to_wire(avazu)
    expected = reference_pipeline(avazu, avazu_repository, runtime="torch").predict(wire)
    with grpc_client(avazu_server) as client:
        served = infer_raw(grpcclient, client, avazu, wire)
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-5)
    assert ((served > 0) & (served < 1)).all()


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


def test_predict_scores_an_avazu_export(avazu, avazu_repository, avazu_server, tmp_path):
    raw = generate(avazu, 40, seed=11)
    exported = _as_exported(tmp_path / "train.csv", write_csv(tmp_path / "rows.csv", raw, avazu))
    done = subprocess.run(
        [*CLI, "predict", "--input", str(exported), "--url", avazu_server.grpc_url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = np.array([float(line) for line in done.stdout.split()])
    expected = reference_pipeline(avazu, avazu_repository, runtime="torch").predict(raw.to_wire(avazu))
    np.testing.assert_allclose(printed, expected, atol=1e-5)


def test_explain_names_the_time_parts(avazu, avazu_repository, tmp_path):
    rows = write_csv(tmp_path / "rows.csv", generate(avazu, 2, seed=3), avazu)
    done = subprocess.run(
        [*CLI, "explain", "--json", "--input", str(rows), "--repository", str(avazu_repository)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(records) == 2 * 23
    assert {r["feature"] for r in records} >= {"hour_hour_of_day", "hour_weekday", "device_ip", "C21"}


def test_a_bad_integer_fails_alone_naming_its_column(avazu, avazu_server):
    wire = generate(avazu, 3, seed=2).to_wire(avazu)
    column = avazu.categorical.columns.index("banner_pos")
    wire["categorical"][1, column] = b"12a"
    with grpc_client(avazu_server) as client:
        with pytest.raises(grpcclient.InferenceServerException, match=r"banner_pos \(row 1\) is b'12a'"):
            infer_raw(grpcclient, client, avazu, wire)
        good = generate(avazu, 3, seed=2).to_wire(avazu)
        assert infer_raw(grpcclient, client, avazu, good).shape == (3,)
