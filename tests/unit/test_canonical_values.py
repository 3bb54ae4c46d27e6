"""One canonical form of a categorical value, read the same by every path: the file reader behind
predict and verify, the rows the SDK sends (read by the server's transform), import's vocabularies,
and explain. Surrounding ASCII whitespace is no part of a value; inner whitespace is."""

from __future__ import annotations

import csv
import io

import numpy as np
import pytest

from recserve.backends.features.hashing import keys_for, table_salt
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.features.vocabulary import vocabulary_keys
from recserve.backends.steps.explain import explain
from recserve.backends.store.table_data import TableArrays
from recserve.backends.store.tiered import TieredStore
from recserve.build.repository import write_tables
from recserve.build.synthetic import generate
from recserve.clients.rows import read_rows
from recserve.clients.writers import write_csv
from recserve.core.names import SPARSE_KEYS
from recserve.core.spec.parse import load_spec
from recserve.core.values import canonical_fields, canonical_value

#: A row's values for the avazu spec's site_id (string), C1 (int64) and hour (a time), with and
#: without surrounding whitespace.
PLAIN = {"site_id": "1fbe01fe", "C1": "1005", "hour": "14102100"}
SPACED = {"site_id": " 1fbe01fe\t", "C1": " 1005 ", "hour": "14102100 "}


@pytest.fixture(scope="module")
def avazu():
    return load_spec("avazu")


def test_the_canonical_form_drops_surrounding_ascii_whitespace_only():
    assert canonical_value(" a b\t\r\n") == b"a b"
    assert canonical_value(b"\x0b\x0cx\x0c") == b"x"
    assert canonical_value("\u00a0a") == "\u00a0a".encode()  # not ASCII whitespace: part of the value
    assert canonical_value(7) == b"7" and canonical_value("   ") == b""
    fields = canonical_fields(np.array([[b" a", "b "], [b"", "c"]], dtype=object))
    assert fields.shape == (2, 2) and fields.tolist() == [[b"a", b"b"], [b"", b"c"]]


def _csv(spec, values: dict[str, str]) -> str:
    """Two rows of synthetic avazu data as CSV, the first with ``values`` in place of its own."""
    buffer = io.StringIO()
    rows = generate(spec, 2, seed=3)
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["click", *spec.categorical.columns])
    for r in range(2):
        row = {c: rows.categorical[r, i].decode() for i, c in enumerate(spec.categorical.columns)}
        if r == 0:
            row.update(values)
        writer.writerow(["0", *(row[c] for c in spec.categorical.columns)])
    return buffer.getvalue()


def _keys(spec, inputs) -> np.ndarray:
    return FeatureTransform(spec).transform(inputs)[SPARSE_KEYS]


def test_the_file_reader_sends_the_canonical_form(avazu):
    plain = read_rows(io.StringIO(_csv(avazu, PLAIN)), avazu)
    spaced = read_rows(io.StringIO(_csv(avazu, SPACED)), avazu)
    np.testing.assert_array_equal(spaced.categorical, plain.categorical)
    column = avazu.categorical.columns.index("site_id")
    assert plain.categorical[0, column] == b"1fbe01fe"


def test_the_server_reads_what_the_sdk_sends_in_the_canonical_form(avazu):
    """The SDK sends rows as the user holds them: the server's transform reads them canonically."""
    rows = read_rows(io.StringIO(_csv(avazu, PLAIN)), avazu)
    spaced = rows.take(slice(0, 2))
    spaced.categorical = rows.categorical.copy()
    for name, value in SPACED.items():
        spaced.categorical[0, avazu.categorical.columns.index(name)] = value.encode()
    np.testing.assert_array_equal(_keys(avazu, spaced.to_inputs(avazu)), _keys(avazu, rows.to_inputs(avazu)))


@pytest.mark.parametrize("table, value", [("site_id", "1fbe01fe"), ("C1", "1005")])
def test_import_keys_a_spaced_token_as_the_server_keys_the_value(avazu, table, value):
    spaced = vocabulary_keys(avazu, table, [f"  {value} "])
    plain = vocabulary_keys(avazu, table, [value])
    assert spaced.tolist() == plain.tolist()
    rows = read_rows(io.StringIO(_csv(avazu, PLAIN)), avazu)
    slot = [f.table for f in avazu.categorical.features].index(table)
    assert int(_keys(avazu, rows.to_inputs(avazu))[0, slot]) == int(plain[0])


@pytest.fixture(scope="module")
def avazu_store(avazu, tmp_path_factory):
    """Random avazu tables, with a row for each value of the reader's first row."""
    root = tmp_path_factory.mktemp("avazu_store")
    rng = np.random.default_rng(1)
    tables = {}
    for name, table in avazu.tables.items():
        keys = keys_for(np.arange(1, 50, dtype=np.uint64), table_salt(avazu.hashing.namespace, name))
        vectors = rng.normal(size=(len(keys), table.dim)).astype(np.float32)
        tables[name] = TableArrays(name, keys.view(np.int64), vectors, np.zeros(table.dim, np.float32))
    write_tables(avazu, tables, root)
    return TieredStore.load(root, avazu)


def test_explain_shows_the_canonical_value_and_a_time_features_part(avazu, avazu_store):
    rows = read_rows(io.StringIO(_csv(avazu, PLAIN)), avazu).take(slice(0, 1))
    rows.categorical = rows.categorical.copy()
    for name, value in SPACED.items():
        rows.categorical[0, avazu.categorical.columns.index(name)] = value.encode()
    records = {r["feature"]: r for r in explain(avazu, avazu_store, rows.to_inputs(avazu))}
    assert records["site_id"]["value"] == "1fbe01fe" and records["C1"]["value"] == "1005"
    # 14102100 is 2014-10-21 00:00 UTC, a Tuesday: the parts the tables are keyed by
    assert records["hour_hour_of_day"]["value"] == "14102100 (hour_of_day 0)"
    assert records["hour_weekday"]["value"] == "14102100 (weekday 1)"
    assert records["hour_hour_of_day"]["key"] == int(vocabulary_keys(avazu, "hour_hour_of_day", ["0"])[0])


def test_a_written_csv_with_spaces_reads_as_the_plain_one(avazu, tmp_path):
    rows = generate(avazu, 5, seed=2)
    path = write_csv(tmp_path / "rows.csv", rows, avazu)
    spaced = path.read_text().replace(",", " , ")
    (tmp_path / "spaced.csv").write_text(spaced)
    np.testing.assert_array_equal(
        read_rows(tmp_path / "spaced.csv", avazu).categorical, read_rows(path, avazu).categorical
    )
