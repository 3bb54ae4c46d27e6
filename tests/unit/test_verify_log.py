"""``verify --log``: which specs' records can be scored again from the log, and how they are rebuilt."""

import numpy as np
import pytest

from recserve.backends.features.hashing import missing_key
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.request_log.records import Identity, sequence_lengths
from recserve.backends.request_log.step_log import FeatureLog
from recserve.build.synthetic import generate
from recserve.core.names import HISTORY_KEYS, MULTI_HOT_KEYS, MULTI_HOT_WEIGHTS, SPARSE_KEYS, TARGET_KEY
from recserve.core.spec.parse import load_spec, parse_spec
from recserve.verify_log import _features, unrescorable
from tests.unit.helpers import ctr_spec_document, tagged_ctr_spec, two_behaviour_ctr_spec


def test_specs_whose_log_cannot_say_what_the_model_saw_are_refused_with_the_reason():
    assert unrescorable(load_spec("ctr")) is None and unrescorable(tagged_ctr_spec()) is None
    assert unrescorable(two_behaviour_ctr_spec()) is None
    doc = ctr_spec_document()
    doc["user_state"] = {"enabled": True, "tokens": 96, "exact_tokens": 64, "tail": 32}
    assert "tail" in str(unrescorable(parse_spec(doc)))


def test_logged_keys_and_histories_become_the_transforms_output_again():
    spec = load_spec("ctr")
    single = len(spec.categorical.features)
    keys = np.arange(2 * (single + 1), dtype=np.int64).reshape(2, single + 1)
    features = _features(spec, keys, np.zeros((2, 13), np.float32), [[7, 8, 9], []])
    assert np.array_equal(features[SPARSE_KEYS], keys[:, :single])
    assert features[TARGET_KEY].tolist() == [[single], [2 * single + 1]]
    history = features[HISTORY_KEYS]
    assert history.shape == (2, spec.sequence_bucket(3)) and history[0, :3].tolist() == [7, 8, 9]
    assert (history[0, 3:] == missing_key(spec.hashing.namespace, "history_items")).all()
    assert features["history_mask"].sum(axis=1).tolist() == [3.0, 0.0]


def test_logged_multi_hot_keys_give_back_their_pooling_weights():
    spec = tagged_ctr_spec()
    single, pad = len(spec.categorical.features), missing_key(spec.hashing.namespace, "tags")
    tags = np.array([[11, 12, pad, pad], [pad, pad, pad, pad]], np.int64)
    keys = np.concatenate([np.zeros((2, single), np.int64), tags, [[5], [6]]], axis=1)
    features = _features(spec, keys, np.zeros((2, 13), np.float32), [[], []])
    assert np.array_equal(features[MULTI_HOT_KEYS], tags) and features[TARGET_KEY].tolist() == [[5], [6]]
    assert features[MULTI_HOT_WEIGHTS].tolist() == [[0.5, 0.5, 0.0, 0.0], [0.0] * 4]  # mean; no value: none


@pytest.mark.parametrize("pooling", ["sum", "mean", "sqrtn"])
def test_the_weights_read_back_from_a_logged_record_are_those_the_transform_served(pooling):
    spec = tagged_ctr_spec(pooling)
    served = FeatureTransform(spec).transform(generate(spec, 64, seed=3).to_wire(spec))
    versions = np.ones((1, len(spec.table_names)), np.int64)
    record = FeatureLog(spec, spec.logging, None).records(Identity("r"), 0, served, versions)  # type: ignore[arg-type]
    keys = np.array(record.column("keys").to_pylist(), np.int64)
    rebuilt = _features(spec, keys, np.zeros((64, 13), np.float32), [[]] * 64)
    assert len({int(n) for n in (served[MULTI_HOT_WEIGHTS] > 0).sum(axis=1)}) == 5  # 0 to 4 values
    assert np.array_equal(rebuilt[MULTI_HOT_KEYS], served[MULTI_HOT_KEYS])
    assert np.array_equal(rebuilt[MULTI_HOT_WEIGHTS], served[MULTI_HOT_WEIGHTS])  # exactly


def test_behaviours_with_lengths_of_their_own_are_rebuilt_as_the_transform_served_them():
    """Two attention groups (views and carts) of other lengths: their histories come back exactly."""
    spec = two_behaviour_ctr_spec()
    served = FeatureTransform(spec).transform(generate(spec, 48, seed=4).to_wire(spec))
    versions = np.ones((1, len(spec.table_names)), np.int64)
    record = FeatureLog(spec, spec.logging, None).records(Identity("r"), 0, served, versions)  # type: ignore[arg-type]
    carrier = record.column("history_row")  # each row's history is on this row of the request
    history, logged = record.column("history").take(carrier), record.column("history_lengths").take(carrier)
    split = sequence_lengths(history, logged, 2)
    assert (split[:, 0] != split[:, 1]).any()  # the behaviours' lengths differ
    keys = np.array(record.column("keys").to_pylist(), np.int64)
    rebuilt = _features(spec, keys, np.zeros((48, 13), np.float32), history.to_pylist(), split)
    for name in (HISTORY_KEYS, "history_mask", "history_mask__cart"):
        assert np.array_equal(rebuilt[name], served[name]), name
