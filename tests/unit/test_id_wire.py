"""The id form of the wire: the same keys as the bytes form, read without per-element Python."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from recserve.backends.features import transform as transform_module
from recserve.backends.features.transform import FeatureTransform
from recserve.build import configs
from recserve.build.synthetic import generate
from recserve.clients.base import ClientBase
from recserve.clients.errors import InvalidRequestError
from recserve.core.candidate_lists import candidate_list_inputs, candidate_rows, with_profiles_of
from recserve.core.names import BYTES_WIRE, IDS_WIRE
from recserve.core.spec.parse import load_spec
from recserve.core.wire_forms import ids_from_bytes, request_form
from recserve.errors import InvalidInput
from tests.wire_rows import column_index, edge_rows

SPECS = ("ctr", "tiny", "avazu", "taobao")


@pytest.mark.parametrize("name", SPECS)
def test_both_forms_give_bit_identical_keys(name):
    spec = load_spec(name)
    rows = edge_rows(spec)
    transform = FeatureTransform(spec)
    text, ids = (
        transform.transform(rows.to_wire(spec, BYTES_WIRE)),
        transform.transform(rows.to_wire(spec, IDS_WIRE)),
    )
    assert list(text) == list(ids)
    for key in text:
        np.testing.assert_array_equal(text[key], ids[key], err_msg=key)
    assert rows.to_wire(spec, IDS_WIRE)[f"{spec.categorical.name}__missing"][1].all()  # the empty row


@pytest.mark.parametrize("name", ["ctr", "taobao"])
def test_both_forms_give_the_same_keys_as_candidate_lists(name):
    spec = load_spec(name)
    rows = edge_rows(spec, count=12)
    transform = FeatureTransform(spec)
    features = {}
    for form in (BYTES_WIRE, IDS_WIRE):
        wire = with_profiles_of(spec, rows.to_wire(spec, form), np.zeros(12, np.int64), form)
        user = {n: wire[n][:1] for s in spec.sequences for n in (s.name,)}
        user.update({g.length_input: wire[g.length_input][:1] for g in spec.attention_groups})
        listed = {
            **user,
            **{
                f"candidate_{k}" if k in {t.name for t in spec.wire_form(form).candidate_inputs} else k: v
                for k, v in candidate_list_inputs(spec, wire, form).items()
            },
        }
        assert request_form(spec, listed) == form
        as_rows, users = candidate_rows(spec, listed, form)
        features[form] = transform.transform(as_rows, users=1)
    for key, value in features[BYTES_WIRE].items():
        np.testing.assert_array_equal(value, features[IDS_WIRE][key], err_msg=key)


def test_the_id_form_is_read_without_the_text_codec(monkeypatch):
    spec = load_spec("taobao")
    wire = edge_rows(spec).to_wire(spec, IDS_WIRE)

    def refuse(*args, **kwargs):
        raise AssertionError("the id form went through the text codec")

    for name in ("categorical_values", "multi_hot_values", "join_list"):
        monkeypatch.setattr(transform_module, name, refuse)
    keys = FeatureTransform(spec).transform(wire)
    assert keys["sparse_keys"].shape[0] == len(wire["categorical__ids"])


def test_a_request_carries_one_form():
    spec = load_spec("tiny")
    rows = generate(spec, 4, seed=1)
    both = {**rows.to_wire(spec, BYTES_WIRE), **rows.to_wire(spec, IDS_WIRE)}
    with pytest.raises(InvalidInput, match="this one carries both") as both_error:
        FeatureTransform(spec).transform(both)
    assert both_error.value.input_name == "categorical__ids"
    neither = {k: v for k, v in both.items() if not k.startswith("categorical")}
    with pytest.raises(InvalidInput, match="this one carries neither") as neither_error:
        FeatureTransform(spec).transform(neither)
    assert neither_error.value.input_name == "categorical"


def test_ids_outside_what_the_text_could_say_are_refused():
    spec = load_spec("taobao")
    transform = FeatureTransform(spec)
    wire = generate(spec, 4, seed=1).to_wire(spec, IDS_WIRE)
    single = spec.wire_form(IDS_WIRE).single
    time = single.index(column_index(spec, "time_stamp"))
    before_1970 = {k: v.copy() for k, v in wire.items()}
    before_1970["categorical__ids"][2, time] = -1
    with pytest.raises(InvalidInput, match=r"time_stamp \(row 2\) is -1: not unix seconds in 0\.\."):
        transform.transform(before_1970)
    before_1970["categorical__missing"][2, time] = True  # an empty value's id is not read
    transform.transform(before_1970)
    too_long = {k: v.copy() for k, v in wire.items()}
    too_long["tags__length"][1, 0] = too_long["tags__ids"].shape[1] + 1
    with pytest.raises(InvalidInput, match="row 1 is") as error:
        transform.transform(too_long)
    assert error.value.input_name == "tags__length"
    ctr = load_spec("ctr")
    group = ctr.categorical  # hex columns of at most 8 digits
    narrow = tuple(dataclasses.replace(c, max_hex_digits=8) for c in group.raw_columns)
    ctr = dataclasses.replace(ctr, categorical=dataclasses.replace(group, raw_columns=narrow))
    wide = generate(ctr, 4, seed=1).to_wire(ctr, IDS_WIRE)
    wide["categorical__ids"][3, 5] = 1 << 32
    with pytest.raises(
        InvalidInput, match=r"C6 \(row 3\) is 4294967296: not a hex value of at most 8 digits"
    ):
        FeatureTransform(ctr).transform(wide)


def test_the_sdk_sends_ids_by_default_and_converts_the_bytes_form():
    spec = load_spec("taobao")
    inputs = edge_rows(spec, count=8).to_inputs(spec)  # the bytes form
    sent = ClientBase(None, "grpc", 1.0, spec, None)._prepare(inputs)
    assert set(sent) == {t.name for t in spec.wire_form(IDS_WIRE).inputs}
    for name, array in ids_from_bytes(spec, inputs).items():
        np.testing.assert_array_equal(sent[name], array)
    text = ClientBase(None, "grpc", 1.0, spec, None, wire=BYTES_WIRE)._prepare(inputs)
    assert set(text) == set(inputs)
    bad = dict(inputs)
    bad["categorical"] = bad["categorical"].copy()
    bad["categorical"][0, column_index(spec, "user")] = b"not a number"
    with pytest.raises(InvalidRequestError, match="user"):
        ClientBase(None, "grpc", 1.0, spec, None)._prepare(bad)
    with pytest.raises(ValueError, match="wire form"):
        ClientBase(None, "grpc", 1.0, spec, None, wire="json")


@pytest.mark.parametrize("name", ["ctr", "avazu"])
def test_the_configs_take_both_forms_each_input_optional(name):
    """Triton sees every wire input as optional (it would only count them); the step names a missing one."""
    spec = load_spec(name)
    built = configs.all_configs(spec)
    inputs = {i.name: i for i in built[spec.name].input}
    ids, text = spec.wire_form(IDS_WIRE), spec.wire_form(BYTES_WIRE)
    assert set(inputs) == {t.name for t in (*ids.inputs, *text.inputs)}
    only_one = {t.name for t in ids.inputs} ^ {t.name for t in text.inputs}
    assert all(i.optional for i in inputs.values())
    assert {"categorical", "categorical__ids", "categorical__missing"} <= only_one
