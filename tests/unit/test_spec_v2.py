"""Spec v2: feature kinds, name expansion, value types, time parts, optional parts, refusals."""

from __future__ import annotations

import copy
import datetime
import json

import numpy as np
import pytest
import tomllib

from recserve.backends.features.hashing import keys_for, missing_key, table_salt
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.features.vocabulary import vocabulary_keys
from recserve.core.contract import dense_contract, dense_net_inputs
from recserve.core.name_ranges import expand_names
from recserve.core.names import (
    DENSE_NET_INPUTS,
    DENSE_NORMALIZED,
    PROBABILITY,
    SPARSE_EMBEDDINGS,
    SPARSE_KEYS,
)
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import load_spec, parse_spec, spec_path
from recserve.core.values import categorical_values, hash_strings
from recserve.errors import InvalidInput


def _doc(name: str = "avazu") -> dict:
    with open(spec_path(name), "rb") as fh:
        return tomllib.load(fh)


def _spec(features: list[dict], tables: dict, **sections) -> dict:
    doc = _doc()
    doc["features"], doc["tables"] = features, tables
    doc["dense_net"].pop("first_order")  # these features have no 1-wide tables
    doc.update(sections)
    return doc


def test_names_expand_over_one_range():
    assert expand_names("C{1..3}") == ("C1", "C2", "C3")
    assert expand_names("x{8..10}_id") == ("x8_id", "x9_id", "x10_id")
    assert expand_names("plain") == ("plain",)
    with pytest.raises(SpecError, match="empty"):
        expand_names("C{3..1}")


def test_ctr_in_v2_form_is_todays_schema():
    spec = load_spec("ctr")
    assert spec.dense is not None and spec.dense.columns == tuple(f"I{i}" for i in range(1, 14))
    assert all(c.log1p and c.clip_min == 0 and c.clip_max == 1e9 for c in spec.dense.numeric)
    assert [c.value_type for c in spec.categorical.raw_columns] == ["hex"] * 26
    assert [f.table for f in spec.categorical.features] == [f"C{i}" for i in range(1, 27)]
    assert spec.target is not None and spec.target.table == "item" and spec.sequence is not None
    assert spec.tables["C3"].cardinality == 100000 and spec.tables["item"].zipf_exponent == 1.1


def test_the_contract_follows_what_the_spec_has():
    ctr, avazu = load_spec("ctr"), load_spec("avazu")
    assert dense_net_inputs(ctr) == DENSE_NET_INPUTS
    # avazu's first-order weights and smallest tables; C15 read as a number too
    narrow = ("sparse_embeddings__1", "sparse_embeddings__4", "sparse_embeddings__8")
    assert dense_net_inputs(avazu) == (DENSE_NORMALIZED, SPARSE_EMBEDDINGS, *narrow)
    inputs, outputs = dense_contract(avazu)
    assert [(t.name, t.shape) for t in inputs] == [
        (DENSE_NORMALIZED, (-1, 1)),
        (SPARSE_EMBEDDINGS, (-1, 17, 16)),
        (narrow[0], (-1, 21, 1)),
        (narrow[1], (-1, 4, 4)),
        (narrow[2], (-1, 2, 8)),
    ]
    assert outputs[0].name == PROBABILITY


def test_time_parts_are_read_in_the_columns_time_zone():
    spec = load_spec("avazu")
    transform = FeatureTransform(spec)
    rows = np.array([[b"14102100"] + [b"1"] * 22, [b"14102523"] + [b""] * 22], dtype=object)
    values, empty = categorical_values(rows, spec.categorical)
    assert values[0, 0] == datetime.datetime(2014, 10, 21, tzinfo=datetime.UTC).timestamp()
    keys = transform.categorical_keys(values, empty)
    ns = spec.hashing.namespace
    # 2014-10-21 was a Tuesday (weekday 1, Monday 0); 2014-10-25 a Saturday, at 23:00
    for row, (hour, weekday) in enumerate([(0, 1), (23, 5)]):
        assert keys[row, 0] == keys_for(np.uint64(hour), table_salt(ns, "hour_hour_of_day"))
        assert keys[row, 1] == keys_for(np.uint64(weekday), table_salt(ns, "hour_weekday"))
    assert keys[1, 2] == missing_key(ns, "C1")


def test_value_types_parse_and_refuse_by_column():
    group = load_spec("avazu").categorical
    row = [b"14102100", b"-3", b"0"] + [b"caf\xc3\xa9"] * 9 + [b"1"] * 11
    values, _ = categorical_values(np.array([row], dtype=object), group)
    assert values[0, 1] == np.uint64(2**64 - 3)  # int64 -3, as its two's complement
    assert values[0, 3] == hash_strings(np.array([b"caf\xc3\xa9"], dtype=object))[0][0]
    for column, bad, why in [(1, b"1.0", "int64"), (2, b"1 2", "int64"), (0, b"2014-10-21", "time")]:
        broken = list(row)
        broken[column] = bad
        with pytest.raises(InvalidInput, match=f"{group.columns[column]} \\(row 0\\) is {bad!r}.*{why}"):
            categorical_values(np.array([broken], dtype=object), group)


def test_unix_times_and_identity_keys():
    doc = _spec(
        [
            {"name": "ts", "kind": "time", "unit": "ms", "parts": ["is_weekend", "month"]},
            {"name": "uid", "kind": "categorical", "value_type": "int64", "encoder": "identity"},
        ],
        {"uid": {"cardinality": 10}},
    )
    spec = parse_spec(doc)
    assert [f.name for f in spec.categorical.features] == ["ts_is_weekend", "ts_month", "uid"]
    assert spec.tables["ts_month"].cardinality == 12
    saturday_ms = int(datetime.datetime(2026, 11, 21, 12, tzinfo=datetime.UTC).timestamp() * 1000)
    rows = np.array([[str(saturday_ms).encode(), b"-42"]], dtype=object)
    keys = FeatureTransform(spec).categorical_keys(*categorical_values(rows, spec.categorical))
    ns = spec.hashing.namespace
    assert keys[0, 0] == keys_for(np.uint64(1), table_salt(ns, "ts_is_weekend"))
    assert keys[0, 1] == keys_for(np.uint64(10), table_salt(ns, "ts_month"))
    assert keys[0, 2] == -42
    after_9999 = np.array([[b"253402300800000", b"1"]], dtype=object)  # 10000-01-01, in ms
    with pytest.raises(InvalidInput, match="ts \\(row 0\\) is b'253402300800000'.*after 9999-12-31"):
        categorical_values(after_9999, spec.categorical)


def test_numeric_ops_run_in_order():
    doc = _spec(
        [
            {"name": "a", "kind": "numeric", "fill_na": 3.0, "clip": [0.0, 10.0], "log1p": True},
            {"name": "b", "kind": "numeric", "standardize": [2.0, 4.0]},
            {"name": "c", "kind": "numeric", "minmax": [-1.0, 1.0]},
            {"name": "k", "kind": "categorical", "value_type": "string"},
        ],
        {"k": {"cardinality": 5}},
    )
    spec = parse_spec(doc)
    transform = FeatureTransform(spec)
    values = np.array([[100.0, 6.0, 0.0], [0.0, 0.0, 1.0]], np.float32)
    missing = np.array([[False, False, False], [True, False, False]])
    got = transform.dense_values(values, missing)
    np.testing.assert_allclose(got, [[np.log1p(10), 1.0, 0.5], [np.log1p(3), -0.5, 1.0]], rtol=1e-6)


def test_a_shared_table_and_string_vocabularies():
    doc = _spec(
        [
            {"name": "src_city", "kind": "categorical", "value_type": "string", "table": "city"},
            {"name": "dst_city", "kind": "categorical", "value_type": "string", "table": "city"},
        ],
        {"city": {"cardinality": 50, "dtype": "fp16"}},
    )
    spec = parse_spec(doc)
    assert list(spec.tables) == ["city"] and spec.store.float16_tables == ("city",)
    rows = np.array([[b"Paris", b"Paris"]], dtype=object)
    keys = FeatureTransform(spec).categorical_keys(*categorical_values(rows, spec.categorical))
    assert keys[0, 0] == keys[0, 1] == vocabulary_keys(spec, "city", ["Paris"])[0]


@pytest.mark.parametrize(
    ("features", "tables", "message"),
    [
        ([{"name": "x", "kind": "image"}], {}, "unknown feature kind 'image'"),
        (
            [{"name": "x", "kind": "categorical", "value_type": "float"}],
            {"x": {"cardinality": 2}},
            "value_type",
        ),
        (
            [{"name": "x", "kind": "categorical", "value_type": "string", "encoder": "identity"}],
            {"x": {"cardinality": 2}},
            "identity encoder needs value_type int64",
        ),
        ([{"name": "x", "kind": "categorical", "value_type": "hex"}], {}, "undefined table 'x'"),
        (
            [{"name": "x", "kind": "categorical"}, {"name": "x", "kind": "categorical"}],
            {"x": {"cardinality": 2}},
            "used twice",
        ),
        ([{"name": "n", "kind": "numeric", "log1p": True}], {}, "log1p needs clip"),
        (
            [{"name": "n", "kind": "numeric", "value_type": "float"}],
            {},
            "value_type must be one of integer, real",
        ),
        (
            [
                {"name": "n", "kind": "numeric", "missing_flag": True},
                {"name": "n_missing", "kind": "numeric"},
            ],
            {},
            "the name 'n_missing' is used twice",
        ),
        ([{"name": "t", "kind": "time"}], {}, "either format"),
        ([{"name": "t", "kind": "time", "unit": "s", "timezone": "Mars/Base"}], {}, "unknown timezone"),
        ([{"name": "t", "kind": "time", "unit": "s", "parts": ["minute"]}], {}, "parts must be some of"),
        (
            [{"name": "C{1..3}", "kind": "categorical"}],
            {"C{1..3}": {"cardinality": [1, 2]}},
            "cardinality must list 3",
        ),
        (
            [{"name": "k", "kind": "categorical"}],
            {"k": {"cardinality": 2}, "spare": {"cardinality": 2}},
            r"tables \['spare'\] are used by no feature",
        ),
        (
            [{"name": "k", "kind": "categorical", "value_type": "hex", "pooling": "sum"}],
            {"k": {"cardinality": 2}},
            r"features\[0\] \(k\) has an unknown key 'pooling'",
        ),
        (
            [{"name": "k", "kind": "multi_hot", "max_length": 3, "wire": "list"}],
            {"k": {"cardinality": 2}},
            "multi-hot lists alone are not enough",
        ),
    ],
)
def test_bad_feature_declarations_are_refused(features, tables, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(_spec(features, tables))


def test_a_sequence_needs_its_target_and_one_bucket_without_it():
    doc = _doc("ctr")
    doc["features"] = [f for f in doc["features"] if f["name"] != "target_item"]
    with pytest.raises(SpecError, match="attends = 'history_items'"):
        parse_spec(doc)
    avazu = _doc()
    avazu["serving"] = {**avazu["serving"], "sequence_buckets": [8, 32]}
    with pytest.raises(SpecError, match=r"sequence_buckets = \[1\]"):
        parse_spec(avazu)


def test_inputs_may_not_name_a_feature():
    doc = copy.deepcopy(_doc())
    doc["inputs"]["ignore"] = ["id", "C1"]
    with pytest.raises(SpecError, match=r"\['C1'\] as label or ignored"):
        parse_spec(doc)


@pytest.mark.parametrize(
    ("spec", "old", "new", "where"),
    [
        ("avazu", 'value_type = "string"', 'value_typ = "string"', r"line \d+: features\[3\] \(site_id\)"),
        ("ctr", "zipf_exponent = 1.05", "zipf_exp = 1.05", r"line \d+: \[tables\.C\{1\.\.26\}\]"),
    ],
)
def test_an_unknown_key_is_named_with_its_line(tmp_path, spec, old, new, where):
    text = spec_path(spec).read_text()
    path = tmp_path / "typo.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(SpecError, match=where):
        load_spec(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: f["hist_cate_ids"].pop("positions"), "'hist_cate_ids' needs max_length >= 1"),
        (lambda f: f["hist_cate_ids"].__setitem__("positions", "cate_id"), "not a sequence with positions"),
        (lambda f: f["hist_cate_ids"].__setitem__("max_length", 32), "no max_length of its own"),
        (lambda f: f["cate_id"].__setitem__("attends", "hist_item_ids"), "two targets"),
        (lambda f: f["cate_id"].pop("attends"), "needs a categorical feature with attends = 'hist_cate_ids'"),
        (lambda f: f["tags"].__setitem__("pooling", "max"), "pooling must be one of sum, mean, sqrtn"),
        (lambda f: f["tags"].__setitem__("separator", ""), "needs a separator"),
        (lambda f: f["tags"].__setitem__("wire", "ragged"), "wire must be one of string, list, got 'ragged'"),
    ],
)
def test_sequences_sharing_positions_and_multi_hot_are_checked(edit, message):
    doc = _doc("taobao")
    edit({f["name"]: f for f in doc["features"]})
    with pytest.raises(SpecError, match=message):
        parse_spec(doc)


@pytest.mark.parametrize("name", ["ctr", "avazu", "taobao", "tiny"])
def test_served_models_see_the_tables_in_the_clients_order(name):
    spec = load_spec(name)
    served = parse_spec(json.loads(spec.to_json()))
    assert served.table_names == spec.table_names  # the columns of embedding_version
    assert served == spec


def test_a_bucketized_numeric_feature_is_a_categorical_one():
    doc = _spec(
        [
            {"name": "price", "kind": "numeric", "clip": [0.0, 1e6], "log1p": True},
            {"name": "clicks", "kind": "numeric", "bucketize": [1, 3, 10]},
            {"name": "k", "kind": "categorical", "value_type": "string"},
        ],
        {"k": {"cardinality": 5}},
    )
    spec = parse_spec(doc)
    assert spec.numeric_columns == ("price", "clicks") and spec.normalized_columns == ("price",)
    assert spec.categorical.slot_names == ("clicks", "k") and spec.tables["clicks"].cardinality == 4
    inputs, _ = dense_contract(spec)
    assert [(t.name, t.shape) for t in inputs[:2]] == [
        (DENSE_NORMALIZED, (-1, 1)),
        (SPARSE_EMBEDDINGS, (-1, 2, 16)),
    ]
    values = np.array([[5.0, 0.0], [5.0, 3.0], [5.0, 250.0], [5.0, 7.0]], np.float32)
    missing = np.array([[False, False], [False, False], [False, False], [False, True]])
    out = FeatureTransform(spec).transform(
        {"dense": values, "dense__missing": missing, "categorical": np.full((4, 1), b"a", dtype=object)}
    )
    np.testing.assert_allclose(out[DENSE_NORMALIZED][:, 0], np.log1p(5.0), rtol=1e-6)
    ns = spec.hashing.namespace
    expected = [keys_for(np.uint64(b), table_salt(ns, "clicks")) for b in (0, 2, 3)]
    assert list(out[SPARSE_KEYS][:3, 0]) == expected and out[SPARSE_KEYS][3, 0] == missing_key(ns, "clicks")
    assert vocabulary_keys(spec, "clicks", [2])[0] == expected[1]
    with pytest.raises(SpecError, match="increasing boundaries"):
        parse_spec(
            _spec([{"name": "c", "kind": "numeric", "bucketize": [3, 1]}, doc["features"][2]], doc["tables"])
        )


def test_a_user_state_over_two_behaviours_is_refused_when_the_spec_is_read():
    """``contract`` and ``import`` read the spec first: the refusal comes there, not at model load.

    Sequences aligned to the first (its events' attributes) are kept; a second behaviour is not."""
    doc = _doc("taobao")
    doc["user_state"] = {"enabled": True, "tokens": 32, "exact_tokens": 16, "tail": 16}
    with pytest.raises(
        SpecError,
        match=r"\[user_state\] keeps one behaviour.*not aligned to it: cart_item_ids, cart_cate_ids\.",
    ):
        parse_spec(doc)
