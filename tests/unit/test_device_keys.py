"""Keys of the id form made on the device: bit for bit the host transform's, the same checks, the same scores.

On torch's CPU device, through the objects the ``embedding_lookup`` and ``dense`` adapters hold.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recserve.backends.dense.runner import DenseStep
from recserve.backends.features import device_transform
from recserve.backends.features import transform as transform_module
from recserve.backends.features.device_keys import DeviceKeys
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.store.served import ServedStore
from recserve.build.repository import version_dir
from recserve.core.candidate_lists import candidate_list_inputs, with_profiles_of
from recserve.core.names import (
    ALL_KEYS,
    CANDIDATE_PREFIX,
    DENSE,
    EMBEDDING_LOOKUP,
    EMBEDDING_VERSION,
    HISTORY_KEYS,
    IDS_WIRE,
    PROBABILITY,
    SPARSE_KEYS,
    TARGET_KEY,
)
from recserve.core.spec.parse import load_spec
from recserve.errors import InvalidInput
from tests.wire_rows import edge_rows


def host(value):
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def candidate_list(spec, wire, users=1):
    """One list of ``users`` users sharing the wire rows' candidates (each history: the first row's)."""
    count = len(wire[spec.targets[0].name])
    wire = with_profiles_of(spec, wire, np.zeros(count, np.int64), IDS_WIRE)
    listed = {n: np.repeat(wire[s.name][:1], users, axis=0) for s in spec.sequences for n in (s.name,)}
    listed.update(
        {g.length_input: np.repeat(wire[g.length_input][:1], users, 0) for g in spec.attention_groups}
    )
    per_candidate = {t.name for t in spec.wire_form(IDS_WIRE).candidate_inputs}
    for name, value in candidate_list_inputs(spec, wire, IDS_WIRE).items():
        if name in per_candidate:
            listed[CANDIDATE_PREFIX + name] = np.repeat(value, users, axis=0)
        else:
            listed[name] = np.repeat(value, users, axis=0)
    return listed


@pytest.mark.parametrize("name", ["ctr", "tiny"])
def test_device_keys_are_the_host_transforms_bit_for_bit(name):
    spec = load_spec(name)
    assert DeviceKeys.serves(spec)
    transform, on_device = FeatureTransform(spec), DeviceKeys(spec, "cpu")
    for count, seed in ((64, 3), (1, 4), (17, 5)):
        wire = edge_rows(spec, count=max(count, 5), seed=seed).to_wire(spec, IDS_WIRE)
        wire = {n: a[:count] for n, a in wire.items()}
        expected, got = transform.transform(wire), on_device(wire)
        assert [k for k in got if k != ALL_KEYS] == list(expected)
        row_keys = np.concatenate([expected[SPARSE_KEYS], expected[TARGET_KEY]], axis=1)
        flat = np.concatenate([row_keys.ravel(), expected[HISTORY_KEYS].ravel()])
        np.testing.assert_array_equal(host(got[ALL_KEYS]), flat)  # what the device lookup takes
        for key, value in expected.items():
            assert isinstance(got[key], torch.Tensor)
            np.testing.assert_array_equal(host(got[key]), value, err_msg=key)
            assert host(got[key]).dtype == value.dtype, key
        # a candidate list's rows: one history per user
        users = 3
        rows = {n: np.concatenate([a] * users) for n, a in wire.items() if n not in history_names(spec)}
        rows.update(
            {
                n: wire[n][:users] if len(wire[n]) >= users else np.repeat(wire[n][:1], users, 0)
                for n in history_names(spec)
            }
        )
        expected, got = transform.transform(rows, users=users), on_device(rows, users=users)
        for key, value in expected.items():
            np.testing.assert_array_equal(host(got[key]), value, err_msg=key)


def history_names(spec):
    return {s.name for s in spec.sequences} | {g.length_input for g in spec.attention_groups}


def test_specs_with_host_only_ops_keep_the_host_transform():
    assert not DeviceKeys.serves(load_spec("taobao"))  # multi-hot lists, time parts
    assert not DeviceKeys.serves(load_spec("avazu"))  # time parts, a number read from a categorical column
    with pytest.raises(ValueError, match="host-only"):
        DeviceKeys(load_spec("taobao"), "cpu")


def test_left_padding_on_the_device_is_the_hosts():
    rng = np.random.default_rng(5)
    for dtype in (np.int64, bool, np.float32):
        array = rng.integers(0, 9, (7, 11)).astype(dtype)
        lengths = np.array([0, 1, 5, 11, 3, 0, 10])
        np.testing.assert_array_equal(
            device_transform.right_align(torch.from_numpy(array), torch.from_numpy(lengths)).numpy(),
            transform_module.right_align(array, lengths),
        )


@pytest.fixture(scope="module")
def steps(tiny_spec, tiny_repository):
    served = ServedStore.open(
        tiny_spec, version_dir(tiny_repository, EMBEDDING_LOOKUP, tiny_spec), start=False
    )
    dense = DenseStep.load(tiny_spec, version_dir(tiny_repository, DENSE, tiny_spec), 1, "cpu", "cpu")
    try:
        on_host = FeaturesToEmbeddings(tiny_spec, EmbeddingLookup(tiny_spec, served.store))
        on_device = FeaturesToEmbeddings(
            tiny_spec, EmbeddingLookup.for_instance(tiny_spec, served, "cpu", "cpu")
        )
        yield on_host, on_device, dense
    finally:
        dense.close()
        served.close()


def test_the_lookup_step_makes_id_keys_on_the_device_and_scores_as_the_host(tiny_spec, steps, monkeypatch):
    on_host, on_device, dense = steps
    assert on_device.device_keys is not None and on_host.device_keys is None
    requests = [edge_rows(tiny_spec, count=n, seed=n).to_wire(tiny_spec, IDS_WIRE) for n in (5, 16, 40)]
    expected = [on_host(r) for r in requests]
    monkeypatch.setattr(
        on_device.transform, "transform", lambda *a, **k: pytest.fail("the host made the id form's keys")
    )
    for request, want in zip(requests, expected, strict=True):
        before = on_device.copies.totals()
        got = on_device(request)
        after = on_device.copies.totals()
        assert list(got) == list(want)
        for key, value in want.items():
            np.testing.assert_array_equal(host(got[key]), host(value), err_msg=key)
        assert after["d2h"] == before["d2h"], "bytes came back to the host"  # tiers counted on the device
        scores = {
            side: dense.compute(dense.check({k: v for k, v in out.items() if k != EMBEDDING_VERSION}))[
                PROBABILITY
            ]
            for side, out in (("host", want), ("device", got))
        }
        np.testing.assert_array_equal(scores["device"], scores["host"])
    listed = candidate_list(tiny_spec, requests[1], users=2)
    want, got = on_host.candidates(listed), on_device.candidates(listed)
    for key, value in want.items():
        np.testing.assert_array_equal(host(got[key]), host(value), err_msg=key)
    np.testing.assert_array_equal(dense.lists(got), dense.lists(want))


def test_a_bad_id_request_is_refused_as_the_host_refuses_it(tiny_spec, steps):
    on_host, on_device, _ = steps
    good = edge_rows(tiny_spec, count=8).to_wire(tiny_spec, IDS_WIRE)
    target, sequence = tiny_spec.targets[0].name, tiny_spec.sequences[0]
    length = tiny_spec.attention_groups[0].length_input

    def broken(name, row, column, value):
        bad = {n: a.copy() for n, a in good.items()}
        bad[name][row, column] = value
        return bad

    cases = [
        broken(target, 3, 0, -7),
        broken(length, 2, 0, sequence.max_length + 1),
        broken(length, 5, 0, -1),
        {**broken(sequence.name, 4, 0, -3), length: np.full((8, 1), 2, np.int32)},
        {n: a for n, a in good.items() if n != f"{tiny_spec.categorical.name}__missing"},
        {n: a[:0] for n, a in good.items()},
    ]
    if tiny_spec.dense is not None:
        not_a_number = broken(tiny_spec.dense.name, 6, 0, np.nan)
        not_a_number[tiny_spec.dense_missing_input][6, 0] = False
        cases.append(not_a_number)
    for bad in cases:
        with pytest.raises(InvalidInput) as on_host_error:
            on_host(bad)
        with pytest.raises(InvalidInput) as on_device_error:
            on_device(bad)
        assert str(on_device_error.value) == str(on_host_error.value)
