"""Imported models served by a real tritonserver: the scores of the model they were trained as.

A built model's tables written in all three import formats and its ONNX, imported into a fresh
repository, serve the scores the original computes; a dense ONNX written by hand with onnx.helper
(returning a logit) over random vocabulary tables serves its own numpy reference.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tomllib

from recserve.build.importer import import_repository
from recserve.build.repository import build_repository, reference_pipeline, version_dir
from recserve.build.synthetic import generate
from recserve.clients import CTRClient
from recserve.core.names import DENSE
from recserve.core.spec.parse import load_spec, parse_spec, spec_path
from tests.integration.private_server import private_server
from tests.model_exports import HandWrittenModel, export_tables

FORMATS = ("vocabulary", "keyed", "hugectr")


def quiet(message: str) -> None:
    """Progress lines are not asserted on."""


def served_scores(repository, scratch, spec, rows) -> np.ndarray:
    with private_server(repository, scratch, model_control="none") as server:
        with CTRClient(server.grpc_url, spec=spec) as client:
            return np.concatenate(
                [
                    client.predict_inputs(rows.take(slice(s, s + 64)).to_wire(spec))
                    for s in range(0, len(rows), 64)
                ]
            )


def test_a_model_imported_in_every_table_format_serves_the_scores_of_the_built_one(tmp_path):
    spec = load_spec("tiny")
    build_repository(spec, tmp_path / "built", quiet)
    formats = {name: FORMATS[i % 3] for i, name in enumerate(spec.table_names)}
    export_tables(spec, tmp_path / "built", tmp_path / "tables", formats)
    shutil.copy(version_dir(tmp_path / "built", DENSE, spec) / "model.onnx", tmp_path / "model.onnx")
    import_repository(spec, tmp_path / "tables", tmp_path / "model.onnx", tmp_path / "imported", quiet)
    rows = generate(spec, 300, seed=21)
    expected = reference_pipeline(spec, tmp_path / "built", "torch")
    want = np.concatenate(
        [expected.predict(rows.take(slice(s, s + 100)).to_wire(spec)) for s in (0, 100, 200)]
    )
    served = served_scores(tmp_path / "imported", tmp_path / "serve", spec, rows)
    np.testing.assert_allclose(served, want, atol=1e-5)


def test_a_hand_written_onnx_returning_logits_serves_its_numpy_reference(tmp_path):
    doc = tomllib.loads(spec_path("tiny").read_text())
    doc["model"]["output"] = "logit"
    spec = parse_spec(doc)
    model = HandWrittenModel(spec)
    model.write(tmp_path / "hand.onnx")
    tables = model.random_tables(spec, tmp_path / "tables")
    import_repository(spec, tmp_path / "tables", tmp_path / "hand.onnx", tmp_path / "imported", quiet)
    rows = generate(spec, 200, seed=22)
    served = served_scores(tmp_path / "imported", tmp_path / "serve", spec, rows)
    reference = model.reference(spec, tables, rows)
    assert reference.std() > 0.01  # the rows reach different table rows: the comparison can fail
    np.testing.assert_allclose(served, reference, atol=1e-5)


def test_a_model_reading_the_last_position_serves_the_newest_item_when_padded_on_the_left(tmp_path):
    doc = tomllib.loads(spec_path("tiny").read_text())
    doc["model"]["output"] = "logit"
    next(f for f in doc["features"] if f["kind"] == "sequence")["padding"] = "left"
    spec = parse_spec(doc)
    model = HandWrittenModel(spec, newest=True)
    model.write(tmp_path / "hand.onnx")
    tables = model.random_tables(spec, tmp_path / "tables")
    import_repository(spec, tmp_path / "tables", tmp_path / "hand.onnx", tmp_path / "imported", quiet)
    rows = generate(spec, 240, seed=23)
    rows.lengths[:8] = [1, 9, 33, 0, 2, 31, 100, 5]  # several sequence buckets in one batch
    # requests of 1 to 13 rows at once: the dynamic batcher merges histories of different widths
    chunks = [slice(s, s + 1 + s % 13) for s in range(0, len(rows), 14)]
    with private_server(tmp_path / "imported", tmp_path / "serve", model_control="none") as server:

        def score(part: slice) -> np.ndarray:
            with CTRClient(server.grpc_url, spec=spec) as client:
                return client.predict_inputs(rows.take(part).to_wire(spec))

        with ThreadPoolExecutor(4) as pool:
            served = list(pool.map(score, chunks))
    for part, got in zip(chunks, served, strict=True):
        want = model.reference(spec, tables, rows.take(part))
        np.testing.assert_allclose(got, want, atol=1e-5)
    # the newest item decides: a right-padded layout would read padding at the last position
    newest = model.reference(spec, tables, rows) - HandWrittenModel(spec).reference(spec, tables, rows)
    assert np.abs(newest).max() > 0.05
