"""A feature feeding several tables (1-wide first-order ones too), column reuse, and an import's defaults."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recserve.backends.dense.network import CTRNet
from recserve.backends.features.hashing import keys_for, missing_key, table_salt
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.features.vocabulary import vocabulary_keys
from recserve.backends.steps.explain import explain
from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.store.table_data import TableArrays
from recserve.backends.store.tiered import TieredStore
from recserve.core.contract import dense_net_inputs, sparse_inputs
from recserve.core.names import DENSE_NORMALIZED, SPARSE_EMBEDDINGS, SPARSE_KEYS
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import parse_spec
from recserve.core.values import hash_strings


def _doc(**dense_net) -> dict:
    """An import's spec: schema and tables only (no [dense_net], no [serving], no cardinality)."""
    doc = {
        "model": {"name": "fm", "max_batch_size": 16},
        "features": [
            {"name": "site", "kind": "categorical", "value_type": "string", "tables": ["site", "site_lin"]},
            {"name": "C15", "kind": "categorical", "value_type": "int64", "tables": ["C15", "C15_lin"]},
            {"name": "C15_number", "kind": "numeric", "column": "C15", "log1p": True, "clip": [0, 1e6]},
            {"name": "C15_again", "kind": "categorical", "column": "C15", "table": "C15_again"},
        ],
        "tables": {
            "site": {"dim": 16},
            "C15": {"dim": 8},
            "C15_again": {"dim": 8},
            "site_lin": {"dim": 1},
            "C15_lin": {"dim": 1},
        },
    }
    if dense_net:
        doc["dense_net"] = dense_net
    return doc


def _features(doc: dict, position: int, **changes) -> dict:
    doc["features"][position] = {**doc["features"][position], **changes}
    for key in [k for k, v in changes.items() if v is None]:
        del doc["features"][position][key]
    return doc


def _without_one_wide_tables(doc: dict) -> None:
    doc["dense_net"] = {"first_order": True}
    _features(doc, 0, tables=None)
    _features(doc, 1, tables=None)
    del doc["tables"]["site_lin"], doc["tables"]["C15_lin"]


def test_a_feature_feeds_each_of_its_tables_in_the_packed_input_of_its_width():
    spec = parse_spec(_doc(first_order=True))
    group = spec.categorical
    assert [(f.name, f.table) for f in group.features] == [
        ("site", "site"),
        ("site", "site_lin"),
        ("C15", "C15"),
        ("C15", "C15_lin"),
        ("C15_again", "C15_again"),
    ]
    assert spec.slot_dims == (16, 1, 8, 1, 8)
    assert [(name, width, slots) for name, width, slots in sparse_inputs(spec)] == [
        (SPARSE_EMBEDDINGS, 16, (0,)),
        ("sparse_embeddings__1", 1, (1, 3)),
        ("sparse_embeddings__8", 8, (2, 4)),
    ]
    assert dense_net_inputs(spec)[0] == DENSE_NORMALIZED


def test_an_import_spec_needs_only_schema_and_tables():
    spec = parse_spec(_doc())
    assert spec.model.embedding_dim == 16  # the widest table
    assert spec.dense_net.bottom_mlp[-1] == 16 and spec.dense_net.attention_heads == 2
    assert spec.serving.batch_buckets == (1, 8, 16) and spec.serving.sequence_buckets == (1,)
    assert spec.tables["site"].cardinality == 0  # an import's rows come from its files
    odd = _doc()
    for table in odd["tables"].values():
        table["dim"] = max(table["dim"], 1) if table["dim"] == 1 else 9
    assert parse_spec(odd).dense_net.attention_heads == 1  # 2 does not divide 9


def test_one_column_feeds_a_categorical_and_a_numeric_feature_and_travels_once():
    spec = parse_spec(_doc())
    assert spec.categorical.columns == ("site", "C15")  # C15 once; C15_again and C15_number read it
    assert [t.name for t in spec.wire_inputs()] == ["categorical"]  # no numeric column of its own
    assert spec.normalized_columns == ("C15_number",)
    (again,) = [f for f in spec.categorical.features if f.name == "C15_again"]
    assert again.column == 1
    transform = FeatureTransform(spec)
    fields = np.array([[b"a", b"320"], [b"b", b""], [b"", b"0"]], dtype=object)
    out = transform.transform({"categorical": fields})
    np.testing.assert_allclose(out[DENSE_NORMALIZED][:, 0], np.log1p([320.0, 0.0, 0.0]).astype(np.float32))
    ns = spec.hashing.namespace
    keys = out[SPARSE_KEYS]
    assert keys[0, 4] == keys_for(np.uint64(320), table_salt(ns, "C15_again"))
    assert keys[1, 4] == missing_key(ns, "C15_again")  # its own missing key, not C15's
    assert keys[1, 2] == missing_key(ns, "C15")


def test_a_feature_in_two_tables_gets_each_tables_key_for_the_same_value():
    spec = parse_spec(_doc(first_order=True))
    ns = spec.hashing.namespace
    fields = np.array([[b"x", b"7"], [b"", b"7"]], dtype=object)
    keys = FeatureTransform(spec).transform({"categorical": fields})[SPARSE_KEYS]
    hashed = hash_strings(np.array([[b"x"]], dtype=object))[0][0, 0]
    assert keys[0, 0] == keys_for(hashed, table_salt(ns, "site"))
    assert keys[0, 1] == keys_for(hashed, table_salt(ns, "site_lin"))
    assert keys[0, 0] != keys[0, 1]  # independent rows per table
    assert keys[0, 3] == keys_for(np.uint64(7), table_salt(ns, "C15_lin"))
    assert keys[1, 0] == keys[1, 1] == missing_key(ns, "site")  # the feature's empty value, in each table
    # an imported vocabulary of either table is keyed as serving keys it
    assert vocabulary_keys(spec, "site_lin", ["x"]).tolist() == [keys[0, 1]]
    assert vocabulary_keys(spec, "C15_lin", ["7"]).tolist() == [keys[0, 3]]


def test_the_lookup_and_explain_serve_each_table_its_own_row():
    spec = parse_spec(_doc(first_order=True))
    fields = np.array([[b"x", b"7"]], dtype=object)
    keys = FeatureTransform(spec).transform({"categorical": fields})[SPARSE_KEYS][0]
    tables = {}
    for i, (name, table) in enumerate(spec.tables.items()):
        column = [f.table for f in spec.categorical.features].index(name)
        vector = np.full((1, table.dim), 10.0 * (i + 1), np.float32)
        tables[name] = TableArrays(name, keys[column : column + 1], vector, np.zeros(table.dim, np.float32))
    store = TieredStore.from_tables(tables)
    out = FeaturesToEmbeddings(spec, EmbeddingLookup(spec, store))({"categorical": fields})
    assert out["sparse_embeddings__1"].tolist() == [[[40.0], [50.0]]]  # site_lin, C15_lin
    assert out[SPARSE_EMBEDDINGS][0, 0, 0] == 10.0
    records = [
        (r["feature"], r["table"], r["dim"])
        for r in explain(spec, store, {"categorical": fields})
        if r["tier"] != "dense"  # the keys' records
    ]
    assert records[:2] == [("site", "site", 16), ("site", "site_lin", 1)]


def test_first_order_adds_the_one_wide_values_to_the_logit():
    spec = parse_spec(_doc(first_order=True))
    torch.manual_seed(0)
    net = CTRNet(spec).eval()
    inputs = {
        DENSE_NORMALIZED: torch.rand(3, 1),
        SPARSE_EMBEDDINGS: torch.randn(3, 1, 16),
        "sparse_embeddings__1": torch.randn(3, 2, 1),
        "sparse_embeddings__8": torch.randn(3, 2, 8),
    }
    shifted = dict(
        inputs, sparse_embeddings__1=inputs["sparse_embeddings__1"] + torch.tensor([0.5, -0.2])[:, None]
    )
    with torch.no_grad():
        before, after = (
            torch.logit(net(*(i[n] for n in net.input_names)).double()) for i in (inputs, shifted)
        )
    np.testing.assert_allclose((after - before).numpy(), 0.3, atol=1e-4)
    plain = CTRNet(parse_spec(_doc()))
    assert plain.first_order == () and len(plain.widths) == 2  # the 1-wide ones projected instead


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: _features(d, 0, tables=["site", "nope"]), "feature 'site' uses undefined table 'nope'"),
        (
            lambda d: _features(d, 0, tables=["site", "site"]),
            r"features\[0\] \(site\): tables lists 'site' twice",
        ),
        (lambda d: _features(d, 0, table="site"), r"features\[0\] \(site\): give table or tables, not both"),
        (lambda d: _features(d, 3, column="C99"), r"features\[3\] \(C15_again\): column 'C99' is no column"),
        (lambda d: _features(d, 2, column="C99"), r"features\[2\] \(C15_number\): column 'C99' is no column"),
        (lambda d: _features(d, 3, column="C15_again"), "column 'C15_again' is the feature's own"),
        (lambda d: _features(d, 2, column="site"), "column 'site' holds string values; a numeric feature"),
        (lambda d: _features(d, 3, column="C15_number"), "column 'C15_number' is numeric"),
        (lambda d: _features(d, 3, value_type="string"), "column 'C15' holds int64 values, the feature says"),
        (lambda d: _features(d, 3, name="C15"), r"features\[3\] \(C15\): the name 'C15' is used twice"),
        (
            lambda d: d.update(model={**d["model"], "embedding_dim": 1}, dense_net={"first_order": True}),
            "first_order takes the 1-wide tables out of the interaction: embedding_dim must be > 1",
        ),
        (_without_one_wide_tables, "first_order sums the values of 1-wide tables into the logit"),
    ],
)
def test_mistakes_are_refused_naming_the_feature(edit, message):
    doc = _doc()
    edit(doc)
    with pytest.raises(SpecError, match=message):
        parse_spec(doc)
