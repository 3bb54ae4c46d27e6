import numpy as np

from recserve.backends.steps.lookup import EmbeddingLookup
from recserve.backends.store.table_data import RowBlock
from recserve.core.names import EMBEDDING_VERSION, HISTORY_KEYS, SPARSE_KEYS, TARGET_KEY
from tests.store_tables import spec_store


def key_inputs(spec, tables, rows=3, width=5):
    rng = np.random.default_rng(6)
    sparse = np.stack([rng.choice(tables[f.table].keys, rows) for f in spec.categorical.features], axis=1)
    items = tables[spec.target.table].keys
    return {
        SPARSE_KEYS: sparse,
        TARGET_KEY: rng.choice(items, (rows, 1)),
        HISTORY_KEYS: rng.choice(items, (rows, width)),
    }


def test_a_batch_reports_the_table_versions_of_one_snapshot_once_in_spec_order(spec):
    tables, store = spec_store(spec, base_version=4)
    lookup = EmbeddingLookup(spec, store)
    inputs = key_inputs(spec, tables)
    versions = lookup.lookup(inputs)[EMBEDDING_VERSION]
    # one row for the batch of 3 (every request of it gets that row), not one per row
    assert versions.shape == (1, len(spec.table_names)) and versions.dtype == np.int64
    assert (versions == 4).all()

    item = spec.target.table
    store.install(
        {item: 7}, RowBlock.of(tables[item].keys[:2], np.ones((2, spec.model.embedding_dim), np.float32))
    )
    versions = lookup.lookup(inputs)[EMBEDDING_VERSION]
    column = spec.table_names.index(item)
    assert (versions[:, column] == 7).all()
    assert (np.delete(versions, column, axis=1) == 4).all()


def test_table_names_follow_the_spec_and_cover_every_table(spec):
    assert spec.table_names[0] == spec.target.table  # [tables.*] first
    assert spec.table_names[1:] == tuple(f.table for f in spec.categorical.features)
    assert set(spec.table_names) == set(spec.tables)
