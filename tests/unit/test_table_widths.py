"""Tables of another width than ``embedding_dim``: one shard per (dtype, width), served padded."""

from __future__ import annotations

import numpy as np
import pytest
import tomllib

from recserve.backends.base.artifacts import write_manifest
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.store.redis_values import decode_rows
from recserve.backends.store.shards import MANIFEST_FORMAT, write_shards
from recserve.backends.store.table_data import RowBlock, TableArrays
from recserve.backends.store.tiered import DEFAULT, L1, L2, TieredStore
from recserve.backends.store.updates.versions import DeltaError, StoreUpdater, UpdateLog
from recserve.build.synthetic import generate
from recserve.core.contract import dense_contract, sparse_inputs
from recserve.core.names import SPARSE_EMBEDDINGS, SPARSE_KEYS
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import load_spec, parse_spec, spec_path


def _tables() -> dict[str, TableArrays]:
    rng = np.random.default_rng(4)
    wide_vectors = rng.normal(size=(50, 8)).astype(np.float32)
    narrow_vectors = rng.normal(size=(30, 2)).astype(np.float32)
    return {
        "wide": TableArrays(
            "wide", np.arange(1, 51, dtype=np.int64), wide_vectors, np.full(8, 3.0, np.float32)
        ),
        "narrow": TableArrays(
            "narrow", np.arange(100, 130, dtype=np.int64), narrow_vectors, np.full(2, 5.0, np.float32)
        ),
    }


@pytest.mark.parametrize("dtypes", [{}, {"narrow": "float16"}])
def test_each_width_has_its_shard_and_narrow_rows_come_zero_padded(dtypes, tmp_path):
    tables = _tables()
    write_manifest(
        tmp_path, {"format": MANIFEST_FORMAT, "version": 1, **write_shards(tmp_path, tables, dtypes)}
    )
    store = TieredStore.map(tmp_path, {"wide": 8, "narrow": 2})
    assert store.dim == 8 and sorted(s.vectors.shape[1] for s in store.shards) == [2, 8]
    assert store.table_dim("narrow") == 2 and store.table_arrays("narrow").vectors.shape == (30, 2)
    keys = np.array([1, 2, 100, 101, 999, 998], np.int64)
    ids = np.array([store.table_id(n) for n in ("wide", "wide", "narrow", "narrow", "wide", "narrow")])
    for tier in (L2, L1):
        if tier == L1:
            store.refresh_cache(seed=keys[:4])
        got = store.lookup(keys, ids)
        assert got.tiers.tolist() == [tier] * 4 + [DEFAULT] * 2
        np.testing.assert_array_equal(got.vectors[:2], tables["wide"].vectors[:2])
        np.testing.assert_allclose(got.vectors[2:4, :2], tables["narrow"].vectors[:2], atol=2e-3)
        assert not got.vectors[2:4, 2:].any() and (got.vectors[4] == 3).all()
        assert got.vectors[5].tolist() == [5, 5, 0, 0, 0, 0, 0, 0]
    delta = RowBlock.of(np.array([100], np.int64), np.array([[7, 7, 0, 0, 0, 0, 0, 0]], np.float32))
    store.install({"narrow": 2}, delta)
    assert store.lookup(keys[2:3], ids[2:3]).vectors[0].tolist() == [7, 7, 0, 0, 0, 0, 0, 0]


def test_redis_rows_of_a_narrower_table_fill_the_first_columns():
    vectors = np.full((3, 4), -1, np.float32)
    found, refused = decode_rows(
        [np.arange(4, dtype=np.float32).tobytes(), None, np.ones(2, np.float32).tobytes()],
        vectors,
        np.array([4, 2, 2]),  # each key's table width
    )
    assert found.tolist() == [True, False, True] and refused.size == 0
    assert vectors.tolist() == [[0, 1, 2, 3], [-1, -1, -1, -1], [1, 1, 0, 0]]


def test_avazus_narrow_tables_travel_as_a_dense_input_per_width():
    avazu = load_spec("avazu")
    assert avazu.other_widths == (1, 4, 8)
    contract = {t.name: t.shape for t in dense_contract(avazu)[0]}
    assert contract == {
        "dense_normalized": (-1, 1),  # C15 read as a number too
        SPARSE_EMBEDDINGS: (-1, 17, 16),
        "sparse_embeddings__1": (-1, 21, 1),  # the first-order weights
        "sparse_embeddings__4": (-1, 4, 4),
        "sparse_embeddings__8": (-1, 2, 8),
    }
    raw = generate(avazu, 9, seed=3)
    keys = FeatureTransform(avazu).transform(raw.to_wire(avazu))[SPARSE_KEYS]
    rng = np.random.default_rng(0)
    tables = {}
    for i, (name, table) in enumerate(avazu.tables.items()):
        column = [f.table for f in avazu.categorical.features].index(name)
        unique = np.unique(keys[:, column])
        vectors = rng.normal(size=(len(unique), table.dim)).astype(np.float32)
        tables[name] = TableArrays(name, unique, vectors, np.full(table.dim, i, np.float32))
    store = TieredStore.from_tables(tables)
    out = FeaturesToEmbeddings(avazu, EmbeddingLookup(avazu, store))(raw.to_wire(avazu))
    for name, width, slots in sparse_inputs(avazu):
        assert out[name].shape == (9, len(slots), width)
        for k, slot in enumerate(slots):
            feature = avazu.categorical.features[slot]
            table = tables[feature.table]
            rows = np.searchsorted(table.keys, keys[:, slot])
            np.testing.assert_array_equal(out[name][:, k], table.vectors[rows])


def _doc(name: str) -> dict:
    return tomllib.loads(spec_path(name).read_text())


def test_the_tables_of_summed_sequences_and_their_targets_stay_at_embedding_dim():
    doc = _doc("taobao")
    doc["tables"]["item"]["dim"] = 8
    with pytest.raises(
        SpecError,
        match="sequence 'hist_item_ids' is summed with its group: its table 'item' "
        "needs embedding_dim=16, got dim 8",
    ):
        parse_spec(doc)


def test_some_categorical_table_keeps_embedding_dim():
    doc = _doc("avazu")
    for entry in doc["tables"].values():
        entry["dim"] = 8
    doc["tables"]["hour_hour_of_day"] = {"cardinality": 24, "dim": 8}
    doc["tables"]["hour_weekday"] = {"cardinality": 7, "dim": 8}
    with pytest.raises(SpecError, match="at least one categorical or multi-hot feature needs a table of"):
        parse_spec(doc)


def test_an_update_of_a_narrow_table_is_checked_at_its_width_and_served_padded(tmp_path):
    store = TieredStore.from_tables(_tables())
    log = UpdateLog(tmp_path / "log", base_version=1)
    updater = StoreUpdater(store, log)
    keys = np.array([100, 101], np.int64)
    with pytest.raises(DeltaError, match="table dim 2"):
        log.publish("narrow", keys, np.ones((2, 8), np.float32), store.table_dim("narrow"))
    log.publish("narrow", keys, np.full((2, 2), 9, np.float32), store.table_dim("narrow"))
    assert updater.poll() and store.version_of("narrow") == 2
    got = store.lookup(keys, np.full(2, store.table_id("narrow"))).vectors
    assert got.tolist() == [[9, 9, 0, 0, 0, 0, 0, 0]] * 2
