"""An imported model served by a real tritonserver: predict reads the spec the server serves (no
--spec), and the server reads a value the SDK sends with surrounding spaces as the value."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import numpy as np
import tomllib

from recserve.build.importer import import_repository
from recserve.build.synthetic import generate
from recserve.cli import main
from recserve.clients import CTRClient
from recserve.clients.served_spec import served_spec
from recserve.clients.writers import write_csv
from recserve.core.spec.parse import parse_spec, spec_path
from tests.integration.private_server import private_server
from tests.model_exports import HandWrittenModel


def test_predict_reads_the_served_spec_and_the_server_reads_values_in_their_canonical_form(tmp_path):
    doc = tomllib.loads(spec_path("tiny").read_text())
    del doc["tables"]["C{1..4}"]["cardinality"]  # an import needs none: the rows give it
    spec = parse_spec(doc)
    model = HandWrittenModel(spec)
    model.write(tmp_path / "hand.onnx", output="probability")
    tables = model.random_tables(spec, tmp_path / "tables")
    report = import_repository(
        spec, tmp_path / "tables", tmp_path / "hand.onnx", tmp_path / "repo", lambda line: None
    )
    rows = generate(parse_spec(tomllib.loads(spec_path("tiny").read_text())), 120, seed=31)
    write_csv(tmp_path / "rows.csv", rows, spec)
    reference = model.reference(spec, tables, rows)
    assert reference.std() > 0.01
    spaced = rows.take(slice(0, len(rows)))
    spaced.categorical = np.array([[b" " + v + b"\t" for v in row] for row in rows.categorical], dtype=object)
    with private_server(tmp_path / "repo", tmp_path / "serve", model_control="none") as server:
        served = served_spec(server.grpc_url)
        assert served.name == spec.name
        assert served.tables["C2"].cardinality == report.rows["C2"]
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["predict", "--url", server.grpc_url, "--input", str(tmp_path / "rows.csv")]) == 0
        predicted = np.array([float(line) for line in out.getvalue().split()])
        with CTRClient(server.grpc_url, spec=served) as client:
            plain = client.predict(rows, batch_size=64)
            with_spaces = client.predict(spaced, batch_size=64)
    np.testing.assert_allclose(predicted, reference, atol=2e-6)  # predict prints 6 decimals
    np.testing.assert_allclose(plain, reference, atol=1e-5)
    np.testing.assert_array_equal(with_spaces, plain)
