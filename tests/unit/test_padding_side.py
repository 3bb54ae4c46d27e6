"""A sequence padded on the left: the newest id at the last position, at every stage that pads."""

from __future__ import annotations

import numpy as np
import pytest
import tomllib

from recserve.backends.base.batching import merge, split
from recserve.backends.dense.buckets import Bucket, pad_to_bucket
from recserve.backends.features.transform import FeatureTransform, right_align
from recserve.backends.steps.explain import explain
from recserve.backends.store.tiered import TieredStore
from recserve.build.export import example_inputs
from recserve.build.repository import build_repository, reference_pipeline, version_dir
from recserve.build.synthetic import generate
from recserve.core.contract import dense_contract, left_padded_inputs
from recserve.core.names import EMBEDDING_LOOKUP, HISTORY_EMBEDDINGS, HISTORY_KEYS, HISTORY_MASK
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import parse_spec, spec_path


def _taobao(**padding: str) -> dict:
    doc = tomllib.loads(spec_path("taobao").read_text())
    for feature in doc["features"]:
        if feature["name"] in padding:
            feature["padding"] = padding[feature["name"]]
    return doc


def test_the_padding_side_is_the_first_sequences_and_shared_by_its_positions():
    cart = ("history_embeddings__cart_item_ids", "history_mask__cart_item_ids")
    assert left_padded_inputs(parse_spec(_taobao())) == cart  # the clicks are padded on the right
    spec = parse_spec(_taobao(hist_item_ids="left"))
    assert left_padded_inputs(spec) == (HISTORY_EMBEDDINGS, HISTORY_MASK, *cart)
    assert [s.padding for s in spec.sequences] == ["left"] * 4
    assert "padded to a sequence bucket on the left" in dense_contract(spec)[0][-2].holds


@pytest.mark.parametrize(
    ("padding", "message"),
    [
        ({"hist_item_ids": "pre"}, "padding must be one of right, left, got 'pre'"),
        ({"hist_cate_ids": "left"}, "its padding is 'right', got 'left'"),
    ],
)
def test_a_bad_or_disagreeing_padding_side_is_refused(padding, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(_taobao(**padding))


def test_right_align_moves_each_rows_real_positions_to_its_end():
    array = np.array([[1, 2, 3, 0], [4, 0, 0, 0], [0, 0, 0, 0], [5, 6, 7, 8]])
    aligned = right_align(array, np.array([3, 1, 0, 4]))
    assert aligned.tolist() == [[0, 1, 2, 3], [0, 0, 0, 4], [0, 0, 0, 0], [5, 6, 7, 8]]
    vectors = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    assert right_align(vectors, np.array([1, 2]))[:, :, 0].tolist() == [[0, 0, 0], [0, 6, 8]]


def test_the_transform_puts_the_newest_id_last_and_the_keys_follow_the_wire():
    right, left = parse_spec(_taobao()), parse_spec(_taobao(hist_item_ids="left"))
    items = np.array([[7, 8, 9, 0], [3, 0, 0, 0]], np.int64)
    lengths = np.array([3, 1], np.int32)
    a = FeatureTransform(right).history(items, lengths)
    b = FeatureTransform(left).history(items, lengths)
    width = a[HISTORY_KEYS].shape[1]
    assert b[HISTORY_MASK].tolist() == [[0.0] * (width - 3) + [1.0] * 3, [0.0] * (width - 1) + [1.0]]
    np.testing.assert_array_equal(b[HISTORY_KEYS][0, -3:], a[HISTORY_KEYS][0, :3])
    np.testing.assert_array_equal(b[HISTORY_KEYS][1, -1], a[HISTORY_KEYS][1, 0])
    padding = a[HISTORY_KEYS][0, -1]  # the missing key of the sequence
    assert (b[HISTORY_KEYS][0, : width - 3] == padding).all()


def test_left_padded_tensors_merge_and_split_on_the_left():
    a = {"history_mask": np.array([[0, 1.0]]), "x": np.array([[1.0]])}
    b = {"history_mask": np.array([[0, 0, 1.0, 1.0]]), "x": np.array([[2.0]])}
    merged, sizes = merge([a, b], left=("history_mask",))
    assert merged["history_mask"].tolist() == [[0, 0, 0, 1], [0, 0, 1, 1]]
    parts = split(merged, sizes, {"history_mask": [2, 4]}, left=("history_mask",))
    assert parts[0]["history_mask"].tolist() == [[0, 1]]
    assert parts[1]["history_mask"].tolist() == [[0, 0, 1, 1]]


def test_a_bucket_pads_left_padded_sequences_before_their_positions():
    spec = parse_spec(_taobao(hist_item_ids="left"))
    inputs = example_inputs(spec, 3, 8, seed=4)
    inputs[HISTORY_MASK][:] = right_align(inputs[HISTORY_MASK], inputs[HISTORY_MASK].sum(1))
    padded = pad_to_bucket(inputs, Bucket(4, 32), left=left_padded_inputs(spec))
    for name in (HISTORY_EMBEDDINGS, HISTORY_MASK):
        np.testing.assert_array_equal(padded[name][:3, 24:], inputs[name])
        assert not padded[name][:, :24].any() and not padded[name][3:].any()


def test_the_built_in_network_scores_the_same_whichever_side_it_is_trained_and_served_on(tmp_path):
    scores, history_keys = {}, {}
    for side in ("right", "left"):
        doc = tomllib.loads(spec_path("tiny").read_text())
        next(f for f in doc["features"] if f["kind"] == "sequence")["padding"] = side
        spec = parse_spec(doc)
        build_repository(spec, tmp_path / side, lambda message: None)
        rows = generate(spec, 100, seed=3)
        scores[side] = [
            reference_pipeline(spec, tmp_path / side, runtime).predict(rows.to_wire(spec))
            for runtime in ("torch", "onnx")
        ]
        store = TieredStore.load(version_dir(tmp_path / side, EMBEDDING_LOOKUP, spec), spec)
        history_keys[side] = [
            (e["feature"], e["value"], e["key"])
            for e in explain(spec, store, rows.take(slice(0, 4)).to_wire(spec))
            if e["feature"].startswith(spec.sequence.name)
        ]
    np.testing.assert_allclose(scores["left"][0], scores["right"][0], atol=1e-6)
    np.testing.assert_allclose(scores["left"][1], scores["left"][0], atol=1e-6)
    assert history_keys["left"] == history_keys["right"] and history_keys["left"]  # explain names each id
