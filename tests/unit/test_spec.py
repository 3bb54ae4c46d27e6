import copy

import pytest

from recserve.core.sections.base import SpecError
from recserve.core.sections.serving import StoreSection, TrainingSection
from recserve.core.spec.parse import load_spec, parse_spec, spec_from_json, spec_path
from tests.unit.helpers import ctr_spec_document


def test_max_batch_size_defaults_to_256():
    doc = load_spec("tiny").source | {}
    doc = {**doc, "model": {k: v for k, v in doc["model"].items() if k != "max_batch_size"}}
    assert parse_spec(doc).model.max_batch_size == 256


def test_default_spec_follows_the_criteo_schema(spec):
    assert spec.dense.columns == tuple(f"I{i}" for i in range(1, 14))
    assert spec.categorical.columns == tuple(f"C{i}" for i in range(1, 27))
    assert spec.sequence.max_length == 256
    assert spec.target.table == spec.sequence.table == "item"
    assert len(spec.tables) == 27 and all(t.dim == spec.model.embedding_dim for t in spec.tables.values())


def test_wire_inputs_are_derived_from_feature_names(spec):
    names = [t.name for t in spec.wire_inputs()]
    assert names == [
        "dense",
        "dense__missing",
        "categorical",
        "target_item",
        "history_items",
        "history_items__length",
    ]
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
        (lambda d: d["features"][1].__setitem__("table", "nope"), "undefined table"),
        (lambda d: d["features"][0].__setitem__("kind", "image"), "unknown feature kind"),
        (lambda d: d["serving"].__setitem__("queue", {"max_queue_size": -1}), "serving.queue needs"),
        (
            lambda d: d["serving"]["queue_policies"]["latency_first"].__setitem__("timeout_action", "DROP"),
            "timeout_action",
        ),
        (lambda d: d["serving"]["queue_policies"].__setitem__("latency first", {}), "identifier"),
    ],
)
def test_inconsistent_specs_are_refused(edit, message):
    doc = copy.deepcopy(ctr_spec_document())
    edit(doc)
    with pytest.raises(SpecError, match=message):
        parse_spec(doc)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["store"].__setitem__("cache_mb", 8),
            r"\[store\] has an unknown key 'cache_mb'; known keys: .*cache_mib",
        ),
        (lambda d: d["training"].__setitem__("epoch", 3), r"\[training\] has an unknown key 'epoch'"),
        (
            lambda d: d["serving"].__setitem__("queue", {"max_queue": 3}),
            r"\[serving\.queue\] has an unknown key 'max_queue'",
        ),
        (
            lambda d: d["features"][2].__setitem__("max_len", 3),
            r"features\[2\] \(history_items\) has an unknown key 'max_len'",
        ),
        (lambda d: d["tables"]["item"].__setitem__("dims", 8), r"\[tables\.item\] has an unknown key 'dims'"),
        (lambda d: d.__setitem__("hashin", {}), r"the spec has an unknown key 'hashin'"),
        (
            lambda d: d["training"].__setitem__("epochs", 2.5),
            r"training\.epochs must be an integer, got 2\.5",
        ),
        (
            lambda d: d["store"].__setitem__("cache_refresh_s", "5"),
            r"store\.cache_refresh_s must be a number, got '5'",
        ),
        (
            lambda d: d["store"].__setitem__("float16_tables", ["C1", "nope"]),
            r"float16_tables names unknown tables \['nope'\]",
        ),
        (lambda d: d["store"].__setitem__("remote_tables", ["item"]), "remote_tables needs redis_nodes"),
        (
            lambda d: d["model"].pop("embedding_dim"),
            r"\[model\] needs embedding_dim, or \[tables.<name>\] their dim",
        ),
    ],
)
def test_every_section_refuses_unknown_keys_and_wrong_types(edit, message):
    doc = copy.deepcopy(ctr_spec_document())
    edit(doc)
    with pytest.raises(SpecError, match=message):
        parse_spec(doc)


def test_sections_are_typed_with_defaults_in_one_place():
    doc = copy.deepcopy(ctr_spec_document())
    del doc["store"], doc["training"]
    spec = parse_spec(doc)
    assert spec.store == StoreSection() and spec.store.cache_bytes == 8 << 20
    assert spec.training == TrainingSection()
    full = parse_spec(ctr_spec_document())
    assert full.store.cache_mib == 8.0 and isinstance(full.store.float16_tables, tuple)
    assert full.training.rows == 120_000 and isinstance(full.training.learning_rate, float)


def test_an_unknown_key_in_a_spec_file_names_its_line(tmp_path):
    text = spec_path("ctr").read_text()
    lines = text.splitlines()
    typo = next(i for i, line in enumerate(lines) if line.startswith("cache_refresh_s"))
    lines[typo] = lines[typo].replace("cache_refresh_s", "cache_refresh")
    path = tmp_path / "typo.toml"
    path.write_text("\n".join(lines))
    with pytest.raises(
        SpecError, match=rf"typo\.toml, line {typo + 1}: \[store\] has an unknown key 'cache_refresh'"
    ):
        load_spec(path)
