"""Multi-hot pooling and sequences sharing positions (the ``taobao`` spec), against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import tomllib

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.features.vocabulary import vocabulary_keys
from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.store.table_data import TableArrays
from recserve.backends.store.tiered import TieredStore
from recserve.build.synthetic import generate
from recserve.clients.rows import RowFormatError, read_rows
from recserve.clients.writers import write_csv, write_tsv
from recserve.core.names import (
    HISTORY_EMBEDDINGS,
    HISTORY_KEYS,
    MULTI_HOT_KEYS,
    MULTI_HOT_WEIGHTS,
    SPARSE_EMBEDDINGS,
    SPARSE_KEYS,
    TARGET_EMBEDDING,
    TARGET_KEY,
)
from recserve.core.spec.parse import load_spec, parse_spec, spec_path
from recserve.errors import InvalidInput


@pytest.fixture(scope="module")
def taobao():
    return load_spec("taobao")


def _store(spec, features):
    """Tables holding every key of the batch that names them, with random vectors."""
    width = features[HISTORY_KEYS].shape[1] // len(spec.sequences)
    keys: dict[str, list[np.ndarray]] = {name: [] for name in spec.table_names}
    for i, feature in enumerate(spec.categorical.features):
        keys[feature.table].append(features[SPARSE_KEYS][:, i])
    (tags,) = spec.categorical.multi_hot
    keys[tags.table].append(features[MULTI_HOT_KEYS].ravel())
    for i, (target, sequence) in enumerate(zip(spec.targets, spec.sequences, strict=True)):
        keys[target.table].append(features[TARGET_KEY][:, i])
        keys[sequence.table].append(features[HISTORY_KEYS][:, i * width : (i + 1) * width].ravel())
    rng = np.random.default_rng(3)
    tables = {}
    for name, parts in keys.items():
        unique = np.unique(np.concatenate(parts))
        vectors = rng.normal(size=(len(unique), spec.model.embedding_dim)).astype(np.float32)
        tables[name] = TableArrays(name, unique, vectors, np.zeros(spec.model.embedding_dim, np.float32))
    return tables, TieredStore.from_tables(tables)


def test_pooled_and_summed_embeddings_equal_numpy(taobao):
    raw = generate(taobao, 24, seed=4)
    inputs = raw.to_wire(taobao)
    features = FeatureTransform(taobao).transform(inputs)
    tables, store = _store(taobao, features)

    def vector(table, key):
        return tables[table].vectors[np.searchsorted(tables[table].keys, key)]

    out = FeaturesToEmbeddings(taobao, EmbeddingLookup(taobao, store))(inputs)
    sparse = np.asarray(out[SPARSE_EMBEDDINGS])
    (tags,) = taobao.categorical.multi_hot
    column = taobao.categorical.raw_columns[tags.column]
    pools = 0
    for r in range(len(raw)):
        for i, feature in enumerate(taobao.categorical.features):
            np.testing.assert_allclose(sparse[r, i], vector(feature.table, features[SPARSE_KEYS][r, i]))
        values = [v for v in raw.categorical[r, tags.column].split(column.separator.encode()) if v]
        values = values[: tags.max_length]
        assert (features[MULTI_HOT_WEIGHTS][r] > 0).sum() == len(values)
        expected = np.zeros(taobao.model.embedding_dim, np.float32)
        for k in range(len(values)):  # mean pooling over this row's values
            expected += vector(tags.table, features[MULTI_HOT_KEYS][r, k]) / len(values)
        pools += bool(values)
        np.testing.assert_allclose(sparse[r, -1], expected, rtol=1e-5, atol=1e-6)
        item, cate = features[TARGET_KEY][r, :2]  # item_id and cate_id attend over both behaviours
        target = vector("item", item) + vector("cate", cate)
        np.testing.assert_allclose(out[TARGET_EMBEDDING][r], target)
        np.testing.assert_allclose(out["target_embedding__cart_item_ids"][r], target)
        width = out[HISTORY_EMBEDDINGS].shape[1]
        keys = features[HISTORY_KEYS][r].reshape(4, width)  # clicks, their categories, cart, ...
        for p in range(int(raw.lengths[r])):
            summed = vector("item", keys[0, p]) + vector("cate", keys[1, p])
            np.testing.assert_allclose(out[HISTORY_EMBEDDINGS][r, p], summed, rtol=1e-6)
        cart = int(raw.lengths_of("cart_item_ids__length")[r])
        for p in range(width - cart, width):  # the cart is padded on the left
            summed = vector("item", keys[2, p]) + vector("cate", keys[3, p])
            np.testing.assert_allclose(out["history_embeddings__cart_item_ids"][r, p], summed, rtol=1e-6)
        assert (
            out["history_mask__cart_item_ids"][r].sum()
            == cart
            == out["history_mask__cart_item_ids"][r, -cart:].sum()
        )
    assert pools > 10  # most rows have tags


@pytest.mark.parametrize(("pooling", "scale"), [("sum", 1.0), ("mean", 3.0), ("sqrtn", np.sqrt(3.0))])
def test_pooling_weights(pooling, scale):
    doc = tomllib.loads(spec_path("taobao").read_text())
    next(f for f in doc["features"] if f["name"] == "tags")["pooling"] = pooling
    spec = parse_spec(doc)
    (tags,) = spec.categorical.multi_hot
    column = np.array([b"1|2||3", b"", b"|".join(b"%d" % i for i in range(20))], dtype=object)
    categorical = np.full((3, len(spec.categorical.raw_columns)), b"", dtype=object)
    categorical[:, tags.column] = column
    keys, weights = FeatureTransform(spec).multi_hot_keys(categorical)
    np.testing.assert_allclose(weights[0, :3], 1.0 / scale, rtol=1e-6)
    assert (weights[0, 3:] == 0).all() and (weights[1] == 0).all()  # empty elements and rows pool nothing
    assert (weights[2] > 0).sum() == tags.max_length  # the first max_length values are kept
    assert keys[0, 0] == vocabulary_keys(spec, tags.table, ["1"])[0]


def test_a_bad_element_names_its_row_and_column(taobao):
    spec = taobao
    (tags,) = spec.categorical.multi_hot
    categorical = np.full((2, len(spec.categorical.raw_columns)), b"1", dtype=object)
    categorical[1, tags.column] = b"4|x"
    with pytest.raises(InvalidInput, match=r"tags \(row 1\) is b'4\|x': not a list of int64 values"):
        FeatureTransform(spec).multi_hot_keys(categorical)


def test_a_multi_hot_list_travels_as_its_own_tensor_and_keys_as_the_joined_field(taobao):
    column = taobao.categorical.multi_hot[0].column
    tags = taobao.categorical.raw_columns[column]
    assert tags.as_list and "tags" in {t.name for t in taobao.wire_inputs()}
    raw = generate(taobao, 12, seed=5)
    sent = raw.to_wire(taobao)
    assert sent["categorical"].shape == (12, len(taobao.categorical.raw_columns) - 1)
    joined = [b"|".join(v for v in row if v) for row in sent["tags"]]
    assert joined == [b"|".join(t for t in f.split(b"|") if t) for f in raw.categorical[:, column]]
    transform = FeatureTransform(taobao)
    keys = transform.transform(sent)[MULTI_HOT_KEYS]
    np.testing.assert_array_equal(keys, transform.multi_hot_keys(raw.categorical)[0])
    bad = {**sent, "tags": sent["tags"].copy()}
    bad["tags"][3, 0] = b"1|2"
    with pytest.raises(
        InvalidInput, match=r"input 'tags': row 3 position 0 is b'1\|2': one value per element"
    ):
        transform.transform(bad)
    bad["tags"][3, 0] = b"x"
    with pytest.raises(InvalidInput, match=r"input 'tags': tags \(row 3\) is b'x.*not a list of int64"):
        transform.transform(bad)


def test_files_with_both_sequences_round_trip(taobao, tmp_path):
    raw = generate(taobao, 30, seed=8)
    for write in (write_csv, write_tsv):
        back = read_rows(write(tmp_path / f"rows.{write.__name__}", raw, taobao), taobao)
        sent = raw.to_wire(taobao)
        sent["dense"] = np.where(sent["dense__missing"], 0.0, sent["dense"])
        for name, values in back.to_inputs(taobao).items():
            np.testing.assert_array_equal(values, sent[name], err_msg=name)


@pytest.mark.parametrize("column", ["hist_cate_ids", "cart_cate_ids"])
def test_sequences_sharing_positions_must_have_the_same_lengths(taobao, tmp_path, column):
    path = write_csv(tmp_path / "rows.csv", generate(taobao, 20, seed=9), taobao)
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    row = next(i for i in range(1, len(lines)) if lines[i].split(",")[header.index(column)])
    fields = lines[row].split(",")
    fields[header.index(column)] += " 7"
    lines[row] = ",".join(fields)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RowFormatError, match=rf"line {row + 1}, column {column}: .*shared positions"):
        read_rows(path, taobao)
