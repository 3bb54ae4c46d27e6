import copy

import pytest
import tomllib

from recserve.spec import SpecError, parse_spec, spec_from_json, spec_path


def _doc() -> dict:
    with open(spec_path("ctr"), "rb") as fh:
        return tomllib.load(fh)


def test_default_spec_follows_the_criteo_schema(spec):
    assert spec.dense.columns == tuple(f"I{i}" for i in range(1, 14))
    assert spec.categorical.columns == tuple(f"C{i}" for i in range(1, 27))
    assert spec.sequence.max_length == 256
    assert spec.target.table == spec.sequence.table == "item"
    assert len(spec.tables) == 27 and all(t.dim == spec.embedding_dim for t in spec.tables.values())


def test_wire_inputs_are_derived_from_feature_names(spec):
    names = [t.name for t in spec.wire_inputs()]
    assert names == ["dense", "dense__missing", "categorical", "target_item", "history_items", "history_items__length"]
    ragged = [t.name for t in spec.wire_inputs() if t.ragged]
    assert ragged == ["history_items"]


@pytest.mark.parametrize(("length", "bucket"), [(0, 8), (1, 8), (8, 8), (9, 32), (255, 256), (256, 256)])
def test_sequence_bucket(spec, length, bucket):
    assert spec.sequence_bucket(length) == bucket


def test_bucket_beyond_the_largest_is_an_error(spec):
    with pytest.raises(SpecError, match="257"):
        spec.sequence_bucket(257)
    with pytest.raises(SpecError, match="257"):
        spec.batch_bucket(257)


def test_json_round_trip_is_lossless(spec):
    assert spec_from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["dense_net"].__setitem__("bottom_mlp", [64, 8]), "bottom_mlp"),
        (lambda d: d["serving"].__setitem__("batch_buckets", [1, 8]), "max_batch_size"),
        (lambda d: d["serving"].__setitem__("sequence_buckets", [8, 32]), "max_length"),
        (lambda d: d["features"][1].__setitem__("cardinalities", [10]), "cardinalities"),
        (lambda d: d["features"][2].__setitem__("table", "nope"), "undefined table"),
        (lambda d: d["features"][0].__setitem__("kind", "image"), "unknown feature kind"),
        (lambda d: d["serving"]["queue"].__setitem__("max_queue_size", -1), "serving.queue needs"),
        (lambda d: d["serving"]["queue_profiles"]["latency_first"].__setitem__("timeout_action", "DROP"), "timeout_action"),
        (lambda d: d["serving"]["queue_profiles"].__setitem__("latency first", {}), "identifier"),
    ],
)
def test_inconsistent_specs_are_refused(edit, message):
    doc = copy.deepcopy(_doc())
    edit(doc)
    with pytest.raises(SpecError, match=message):
        parse_spec(doc)
