"""What ``recserve import`` checks and derives from values: time-part tokens against their domain,
spaced tokens in their canonical form, float16 rounding, cardinalities the spec omits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tomllib

from recserve.backends.features.vocabulary import vocabulary_keys
from recserve.build.import_values import time_part_problem, with_imported_cardinalities
from recserve.build.importer import TableImportError, TableSource, import_repository, read_vocabulary_table
from recserve.build.repository import reference_pipeline
from recserve.build.repository_spec import repository_spec
from recserve.build.synthetic import generate
from recserve.core.spec.parse import load_spec, parse_spec, spec_path
from recserve.errors import InvalidInput
from tests.model_exports import HandWrittenModel

HOURS = "hour_hour_of_day"


@pytest.fixture(scope="module")
def avazu():
    return load_spec("avazu")


def vocabulary(folder: Path, table: str, tokens: list, dim: int, oov: int | None = 0) -> TableSource:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / f"{table}.npy", np.ones((len(tokens), dim), np.float32))
    doc = {"tokens": tokens} if oov is None else {"tokens": tokens, "oov": oov}
    (folder / f"{table}.vocab.json").write_text(json.dumps(doc))
    return TableSource(table, "vocabulary", folder / f"{table}.npy", folder / f"{table}.vocab.json")


def test_a_time_parts_tokens_are_its_numbers(avazu, tmp_path):
    dim = avazu.tables[HOURS].dim
    table = read_vocabulary_table(avazu, vocabulary(tmp_path, HOURS, [None, *map(str, range(24))], dim))
    assert len(table.keys) == 24
    assert not time_part_problem(avazu, HOURS, [None, 0, "23", 5], skip=[0])
    assert not time_part_problem(avazu, "site_id", ["14102100"], skip=[])  # no time part


@pytest.mark.parametrize(
    "token, message",
    [
        (
            "24",
            "token 2 is '24'; this table's tokens are the hour_of_day of column 'hour', a number in 0..23",
        ),
        (
            "14102117",
            "token 2 is '14102117', a raw time of column 'hour'; this table's tokens are the hour_of_day "
            "of column 'hour', a number in 0..23: write 17 for it",
        ),
        ("-1", "token 2 is '-1'; this table's tokens are"),
        ("seven", "token 2 is 'seven'; this table's tokens are"),
    ],
)
def test_a_time_part_token_outside_its_domain_is_refused_saying_what_to_write(
    avazu, tmp_path, token, message
):
    """Rows are the table's own: the out-of-vocabulary row 0 is counted."""
    source = vocabulary(tmp_path, HOURS, ["<unk>", "3", token], avazu.tables[HOURS].dim)
    with pytest.raises(TableImportError) as err:
        read_vocabulary_table(avazu, source)
    assert message in str(err.value) and f"table '{HOURS}'" in str(err.value)


def test_spaced_tokens_are_read_in_their_canonical_form(avazu, tmp_path):
    dim = avazu.tables["site_id"].dim
    spaced = read_vocabulary_table(avazu, vocabulary(tmp_path / "a", "site_id", [None, " ab ", "cd\t"], dim))
    plain = read_vocabulary_table(avazu, vocabulary(tmp_path / "b", "site_id", [None, "ab", "cd"], dim))
    np.testing.assert_array_equal(spaced.keys, plain.keys)
    with pytest.raises(
        TableImportError, match=r"tokens 'ab' \(row 1\) and 'ab' \(row 2\) are the same value"
    ):
        read_vocabulary_table(avazu, vocabulary(tmp_path / "c", "site_id", [None, "ab", " ab"], dim))


def test_a_value_error_names_the_kind_once(avazu):
    with pytest.raises(InvalidInput) as err:
        vocabulary_keys(avazu, "site_id", ["a", {"b": 1}])
    assert "this table's values are strings" in str(err.value) and "string strings" not in str(err.value)


def _tiny_doc() -> dict:
    return tomllib.loads(spec_path("tiny").read_text())


def _import(spec, tmp_path: Path, progress=lambda line: None):
    model = HandWrittenModel(spec)
    model.write(tmp_path / "hand.onnx", output="probability")
    tables = model.random_tables(load_spec("tiny"), tmp_path / "tables")
    report = import_repository(spec, tmp_path / "tables", tmp_path / "hand.onnx", tmp_path / "repo", progress)
    return report, tables


def test_fp16_tables_report_the_rounding_of_their_weights(tmp_path):
    doc = _tiny_doc()
    doc["tables"]["C{1..4}"]["dtype"] = "fp16"
    spec = parse_spec(doc)
    lines: list[str] = []
    report, tables = _import(spec, tmp_path, lines.append)
    assert sorted(report.rounded) == ["C1", "C2", "C3", "C4"]
    vectors = tables["C2"]["vectors"]
    expected = float(np.max(np.abs(vectors.astype(np.float16).astype(np.float32) - vectors)))
    assert report.rounded["C2"] == pytest.approx(expected) and expected > 0
    said = next(line for line in lines if "'C2'" in line)
    assert "stored as float16" in said and f"{expected:.3g}" in said and "max |Δ|" in said


def test_a_table_without_cardinality_takes_it_from_the_imported_rows(tmp_path):
    doc = _tiny_doc()
    del doc["tables"]["C{1..4}"]["cardinality"]
    spec = parse_spec(doc)
    assert spec.tables["C3"].cardinality == 0
    report, _ = _import(spec, tmp_path)
    carried = repository_spec(tmp_path / "repo")
    assert {n: carried.tables[n].cardinality for n in ("C1", "C2", "C3", "C4")} == {
        n: report.rows[n] for n in ("C1", "C2", "C3", "C4")
    }
    assert carried.tables["item"].cardinality == spec.tables["item"].cardinality  # given: kept
    rows = generate(carried, 50, seed=1)  # the carried spec makes rows, as perf and sample do
    assert reference_pipeline(carried, tmp_path / "repo", "onnx").predict(rows.to_wire(carried)).shape == (
        50,
    )
    assert with_imported_cardinalities(carried, report.rows) is carried  # nothing left to fill


def test_a_repository_carries_the_spec_it_was_imported_with(tmp_path):
    spec = load_spec("tiny")
    _import(spec, tmp_path)
    assert repository_spec(tmp_path / "repo").to_json() == spec.to_json()
