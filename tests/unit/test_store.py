import json

import numpy as np
import pytest

from recserve.backends.artifacts import load_array, read_manifest, save_array, write_manifest
from recserve.backends.errors import ArtifactError
from recserve.backends.store import EmbeddingStore, EmbeddingTable


@pytest.fixture
def table():
    keys = np.array([30, -10, 20], dtype=np.int64)
    vectors = np.array([[3, 3], [1, 1], [2, 2]], dtype=np.float32)
    return EmbeddingTable.from_arrays("t", keys, vectors, default=np.array([9, 9], np.float32))


def test_lookup_returns_vectors_by_key_and_default_for_unknown(table):
    out = table.lookup(np.array([[20, 99], [-10, 30]], dtype=np.int64))
    assert out.shape == (2, 2, 2)
    assert out[:, :, 0].tolist() == [[2, 9], [1, 3]]
    assert (table.stats.lookups, table.stats.unknown) == (4, 1)


def test_lookup_of_keys_beyond_the_largest_is_unknown(table):
    assert table.lookup(np.array([10**12, -(10**12)]))[:, 0].tolist() == [9, 9]


@pytest.mark.parametrize(("mode", "expected"), [("sum", [5, 9]), ("mean", [2.5, 9])])
def test_pooling_over_multi_valued_features(table, mode, expected):
    keys = np.array([[20, 30, 0], [77, 0, 0]], dtype=np.int64)
    mask = np.array([[1, 1, 0], [1, 0, 0]], dtype=np.float32)
    assert table.lookup_pooled(keys, mask, mode)[:, 0].tolist() == expected


def test_duplicate_keys_are_refused():
    with pytest.raises(ArtifactError, match="duplicate"):
        EmbeddingTable.from_arrays("t", np.array([1, 1]), np.zeros((2, 2)), np.zeros(2))


def test_checksum_mismatch_is_refused(tmp_path):
    entry = save_array(tmp_path, "a.npy", np.arange(10, dtype=np.int64))
    assert load_array(tmp_path, entry).tolist() == list(range(10))
    np.save(tmp_path / "a.npy", np.arange(10, dtype=np.int64) + 1)
    with pytest.raises(ArtifactError, match="checksum"):
        load_array(tmp_path, entry)


def test_manifest_shape_lie_is_refused(tmp_path):
    entry = save_array(tmp_path, "a.npy", np.zeros((4, 2), np.float32))
    with pytest.raises(ArtifactError, match="manifest says"):
        load_array(tmp_path, {**entry, "shape": [2, 4]})


def test_paths_outside_the_model_folder_are_refused(tmp_path):
    (tmp_path / "inner").mkdir()
    save_array(tmp_path, "x.npy", np.zeros(2))
    entry = json.loads(json.dumps(save_array(tmp_path, "x.npy", np.zeros(2))))
    entry["path"] = "../x.npy"
    with pytest.raises(ArtifactError, match="outside"):
        load_array(tmp_path / "inner", entry)


def test_missing_manifest_says_how_to_build(tmp_path):
    with pytest.raises(ArtifactError, match="recserve build"):
        read_manifest(tmp_path)


def test_store_refuses_a_manifest_without_a_spec_table(spec, tmp_path):
    write_manifest(tmp_path, {"format": "recserve-embeddings/1", "version": 1, "tables": {}})
    with pytest.raises(ArtifactError, match="not in the manifest"):
        EmbeddingStore.load(tmp_path, spec)
