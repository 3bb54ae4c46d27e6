"""Sequences sharing positions concatenated (``combine = "concat"``), as DIN-style models take them."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tomllib
import torch

from recserve.backends.dense.network import CTRNet
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.store.device.cache import DeviceL1
from recserve.backends.store.table_data import TableArrays
from recserve.backends.store.tiered import TieredStore
from recserve.build.export import candidate_inputs, example_inputs, export_candidates_onnx, torch_predict
from recserve.build.repository import build_repository, reference_pipeline
from recserve.build.synthetic import generate
from recserve.core.contract import attention_inputs, dense_contract, sequence_inputs
from recserve.core.names import HISTORY_KEYS, HISTORY_USER, SPARSE_KEYS, TARGET_KEY
from recserve.core.sections.base import SpecError
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import parse_spec, spec_path

CART = ("target_embedding__cart_item_ids", "history_embeddings__cart_item_ids", "history_mask__cart_item_ids")


def _feature(doc: dict, name: str) -> dict:
    return next(f for f in doc["features"] if f["name"] == name)


def _taobao(cate_dim: int = 8) -> dict:
    """Taobao with both behaviours' items and categories side by side, the categories ``cate_dim`` wide."""
    doc = tomllib.loads(spec_path("taobao").read_text())
    for name in ("hist_item_ids", "cart_item_ids"):
        _feature(doc, name)["combine"] = "concat"
    doc["tables"]["cate"]["dim"] = cate_dim
    return doc


def test_a_concatenated_group_carries_the_sum_of_its_tables_widths():
    spec = parse_spec(_taobao())
    assert [g.combine for g in spec.attention_groups] == ["concat", "concat"]
    assert [s.combine for s in spec.sequences] == ["concat"] * 4
    assert [g.width for g in attention_inputs(spec)] == [24, 24]
    contract = {t.name: t for t in dense_contract(spec)[0]}
    assert contract["target_embedding"].shape == (-1, 24)
    assert contract["history_embeddings"].shape == (-1, -1, 24)
    assert contract[CART[1]].shape == (-1, -1, 24) and contract[CART[2]].shape == (-1, -1)
    history = contract["history_embeddings"].holds
    assert history.startswith("hist_item_ids (table 'item', 0:16) | hist_cate_ids (table 'cate', 16:24)")
    assert contract["target_embedding"].holds.startswith("item_id (table 'item', 0:16) | cate_id")
    summed = parse_spec(tomllib.loads(spec_path("taobao").read_text()))
    assert [g.combine for g in summed.attention_groups] == ["sum", "sum"]
    assert dense_contract(summed)[0][-1].shape == (-1, -1)  # the default stays the sum


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: _feature(d, "hist_item_ids").__setitem__("combine", "mean"),
            "sequence 'hist_item_ids': combine must be one of sum, concat, got 'mean'",
        ),
        (
            lambda d: _feature(d, "cart_cate_ids").__setitem__("combine", "sum"),
            "sequence 'cart_cate_ids' shares positions with 'cart_item_ids': "
            "its combine is 'concat', got 'sum'",
        ),
        (
            lambda d: _feature(d, "cart_item_ids").__setitem__("combine", "sum"),
            "sequence 'cart_cate_ids' is summed with its group: "
            "its table 'cate' needs embedding_dim=16, got dim 8",
        ),
        (
            lambda d: _feature(d, "cate_id").__setitem__("table", "item"),
            "'cate_id' and 'hist_cate_ids' must share a table to attend, got 'item' and 'cate'",
        ),
    ],
)
def test_an_inconsistent_group_is_refused_naming_the_sequence_and_the_value(edit, message):
    doc = _taobao()
    edit(doc)
    with pytest.raises(SpecError, match=message):
        parse_spec(doc)


def _tables(spec: ModelSpec, features: dict[str, np.ndarray]) -> dict[str, TableArrays]:
    """Random rows for every key the transformed rows use, per table, and a default row of 0.5."""
    width = features[HISTORY_KEYS].shape[1] // len(spec.sequences)
    rng = np.random.default_rng(1)
    tables = {}
    for name, table in spec.tables.items():
        columns = [i for i, f in enumerate(spec.categorical.features) if f.table == name]
        used = [i for i, s in enumerate(spec.sequences) if s.table == name]
        keys = [features[SPARSE_KEYS][:, columns], features[TARGET_KEY][:, used]]
        keys += [features[HISTORY_KEYS][:, i * width : (i + 1) * width] for i in used]
        unique = np.unique(np.concatenate([k.ravel() for k in keys]))
        vectors = rng.normal(size=(len(unique), table.dim)).astype(np.float32)
        tables[name] = TableArrays(name, unique, vectors, np.full(table.dim, 0.5, np.float32))
    return tables


def test_the_lookup_puts_each_sequences_rows_side_by_side_at_its_tables_width():
    spec = parse_spec(_taobao(cate_dim=4))
    raw = generate(spec, 7, seed=5)
    raw.lengths[:3] = [0, 1, 5]
    features = FeatureTransform(spec).transform(raw.to_wire(spec))
    tables = _tables(spec, features)
    store = TieredStore.from_tables(tables)
    out = FeaturesToEmbeddings(spec, EmbeddingLookup(spec, store))(raw.to_wire(spec))

    width = features[HISTORY_KEYS].shape[1] // len(spec.sequences)

    def row(table: str, key: int) -> np.ndarray:
        arrays = tables[table]
        return arrays.vectors[np.searchsorted(arrays.keys, key)]

    for g, names in enumerate(attention_inputs(spec)):
        assert out[names.history].shape == (7, width, 20) and out[names.target].shape == (7, 20)
        first = 2 * g  # the group's first sequence and target
        for r in range(7):
            item, cate = features[TARGET_KEY][r, first], features[TARGET_KEY][r, first + 1]
            np.testing.assert_array_equal(
                out[names.target][r], np.concatenate([row("item", item), row("cate", cate)])
            )
            for p in (0, width - 1):
                item = features[HISTORY_KEYS][r, first * width + p]
                cate = features[HISTORY_KEYS][r, (first + 1) * width + p]
                np.testing.assert_array_equal(
                    out[names.history][r, p], np.concatenate([row("item", item), row("cate", cate)])
                )


def test_the_built_in_network_attends_over_the_concatenated_width_and_ignores_padding():
    spec = parse_spec(_taobao(cate_dim=4))
    torch.manual_seed(0)
    net = CTRNet(spec).eval()
    inputs = example_inputs(spec, 5, 8, seed=2)
    assert inputs["history_embeddings"].shape == (5, 8, 20)
    inputs["history_mask"][:] = 0.0
    inputs["history_mask"][:, :3] = 1.0

    def score(named):
        with torch.no_grad():
            return net(*(torch.from_numpy(named[n]) for n in net.input_names)).numpy()

    base = score(inputs)
    padded = {**inputs, "history_embeddings": inputs["history_embeddings"].copy()}
    padded["history_embeddings"][:, 3:] += 5.0
    np.testing.assert_allclose(score(padded), base, atol=1e-6)
    for columns in (slice(0, 16), slice(16, 20)):  # the items' and the categories' columns both count
        moved = {**inputs, "history_embeddings": inputs["history_embeddings"].copy()}
        moved["history_embeddings"][:, :3, columns] += 0.5
        assert np.abs(score(moved) - base).max() > 1e-4


def _tiny_concat() -> dict:
    """The tiny spec with the items' categories (4 wide) beside them: one concatenated group, 12 wide."""
    doc = tomllib.loads(spec_path("tiny").read_text())
    sequence = _feature(doc, "history_items")
    sequence["combine"] = "concat"
    at = doc["features"].index(sequence) + 1
    doc["features"][at:at] = [
        {"name": "history_cates", "kind": "sequence", "table": "cate", "positions": "history_items"},
    ]
    doc["features"].append(
        {
            "name": "target_cate",
            "kind": "categorical",
            "value_type": "int64",
            "table": "cate",
            "attends": "history_cates",
        }
    )
    doc["tables"]["cate"] = {"cardinality": 12, "dim": 4}
    return doc


def test_a_concatenated_model_trains_exports_and_serves_the_same_in_torch_and_onnx(tmp_path):
    doc = _tiny_concat()
    spec = parse_spec(doc)
    assert attention_inputs(spec)[0].width == 12
    build_repository(spec, tmp_path / "repo", lambda message: None)
    rows = generate(spec, 200, seed=8)
    torch_scores, onnx_scores = (
        reference_pipeline(spec, tmp_path / "repo", runtime).predict(rows.to_wire(spec))
        for runtime in ("torch", "onnx")
    )
    np.testing.assert_allclose(onnx_scores, torch_scores, atol=1e-5)
    assert np.std(torch_scores) > 1e-3


def test_the_device_l1_serves_a_concatenated_group_as_the_host_path_does():
    spec = parse_spec(_tiny_concat())
    wire = generate(spec, 40, seed=2).to_wire(spec)
    store = TieredStore.from_tables(_tables(spec, FeatureTransform(spec).transform(wire)))
    host = FeaturesToEmbeddings(spec, EmbeddingLookup(spec, store))(wire)
    device = FeaturesToEmbeddings(spec, EmbeddingLookup(spec, store, DeviceL1(store, "cpu")))(wire)
    for name in ("target_embedding", "history_embeddings"):
        assert isinstance(device[name], torch.Tensor) and host[name].shape[-1] == 12
        np.testing.assert_array_equal(device[name].numpy(), host[name])


def test_a_candidate_list_over_concatenated_groups_scores_as_its_rows_in_torch_and_onnx(tmp_path):
    spec = parse_spec(_taobao(cate_dim=4))
    torch.manual_seed(1)
    net = CTRNet(spec).eval()
    sample = candidate_inputs(spec, users=2, candidates=3, length=8, seed=3)
    owner = sample[HISTORY_USER]
    rows = {n: sample[n][owner] if n in sequence_inputs(spec) else sample[n] for n in net.input_names}
    want = torch_predict(net, rows)
    export_candidates_onnx(spec, net, tmp_path / "lists.onnx")
    session = ort.InferenceSession(str(tmp_path / "lists.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, sample)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.std(want) > 1e-4
