"""``explain``: numeric features with what the dense network receives, and the table row each key hit."""

import numpy as np

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.steps.explain import FIELDS, explain
from recserve.backends.store.tiered import TieredStore
from recserve.build.repository import version_dir
from recserve.build.synthetic import generate
from recserve.core.names import EMBEDDING_LOOKUP


def test_explain_shows_numeric_features_and_the_table_row_of_each_key(tiny_spec, tiny_repository):
    store = TieredStore.load(version_dir(tiny_repository, EMBEDDING_LOOKUP, tiny_spec), tiny_spec)
    rows = generate(tiny_spec, 12, seed=5)
    wire = rows.to_wire(tiny_spec)
    records = list(explain(tiny_spec, store, wire))
    assert all(tuple(r) == FIELDS for r in records)  # every record has every field, in order
    numeric = [r for r in records if r["tier"] == "dense"]
    names = tiny_spec.normalized_columns
    assert [r["feature"] for r in numeric] == list(names) * len(rows)
    want = FeatureTransform(tiny_spec).dense_values(wire["dense"], wire[tiny_spec.dense_missing_input])
    got = np.array([r["normalized"] for r in numeric], np.float32).reshape(len(rows), len(names))
    np.testing.assert_array_equal(got, want)
    raw = [r["value"] for r in numeric[: len(names)]]
    assert raw == [None if m else float(v) for v, m in zip(rows.dense[0], rows.dense_missing[0], strict=True)]
    hits = [r for r in records if r["tier"] not in ("dense", "default") and r["key"] is not None]
    assert hits
    for record in hits:  # the row the key hit holds that key
        keys = store.table_arrays(record["table"]).keys
        assert record["table_row"] >= 0 and keys[record["table_row"]] == record["key"]
    assert all(r["table_row"] == -1 for r in records if r["tier"] == "default")
