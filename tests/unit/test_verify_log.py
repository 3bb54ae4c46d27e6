"""``verify --log``: which specs' records can be scored again from the log, and how they are rebuilt."""

import numpy as np

from recserve.backends.features.hashing import missing_key
from recserve.core.names import HISTORY_KEYS, SPARSE_KEYS, TARGET_KEY
from recserve.core.spec.parse import load_spec, parse_spec
from recserve.verify_log import _features, unrescorable
from tests.unit.helpers import ctr_spec_document


def test_specs_whose_log_cannot_say_what_the_model_saw_are_refused_with_the_reason():
    assert unrescorable(load_spec("ctr")) is None
    assert "multi-hot" in str(unrescorable(load_spec("taobao")))
    doc = ctr_spec_document()
    doc["features"] += [
        {"name": "cart", "kind": "sequence", "table": "item", "max_length": 256},
        {
            "name": "cart_target",
            "kind": "categorical",
            "value_type": "int64",
            "table": "item",
            "attends": "cart",
        },
    ]
    assert "lengths of their own" in str(unrescorable(parse_spec(doc)))
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
