"""The transform's hashing and normalisation as torch ops against the host's numpy: the same bits."""

import copy

import numpy as np
import pytest
import torch

from recserve.backends.features import device_transform, hashing
from recserve.backends.features.device_transform import DeviceNormalizer, int64_bits, masked_keys
from recserve.backends.features.transform import FeatureTransform
from recserve.core.spec.parse import parse_spec
from tests.unit.helpers import DEVICES

INT64 = np.iinfo(np.int64)
EDGES = [0, -1, 1, INT64.max, INT64.min, INT64.max - 1, INT64.min + 1]


def random_values(size=200_000, seed=3):
    rng = np.random.default_rng(seed)
    values = rng.integers(INT64.min, INT64.max, size=size, dtype=np.int64, endpoint=True)
    values[: len(EDGES)] = EDGES
    values[len(EDGES) : 1000] = rng.integers(-5, 100, 1000 - len(EDGES))  # small ids
    return values


def test_int64_bits_are_the_unsigned_bits():
    assert int64_bits(0) == 0 and int64_bits(2**63 - 1) == 2**63 - 1
    assert int64_bits(2**63) == -(2**63) and int64_bits(2**64 - 1) == -1 and int64_bits(-1) == -1
    assert np.array([int64_bits(0x9E3779B97F4A7C15)], np.int64).view(np.uint64)[0] == 0x9E3779B97F4A7C15


@pytest.mark.parametrize("device", DEVICES)
def test_splitmix64_and_keys_match_the_host_bit_for_bit(device):
    values = random_values()
    on_device = torch.from_numpy(values).to(device)
    want = hashing.splitmix64(values.view(np.uint64)).view(np.int64)
    assert np.array_equal(device_transform.splitmix64(on_device).cpu().numpy(), want)
    for table in ("item", "C1", "C26"):
        salt = hashing.table_salt("recserve", table)
        want = hashing.keys_for(values.view(np.uint64), salt)
        assert np.array_equal(device_transform.keys_for(on_device, salt).cpu().numpy(), want), table
    salts = np.array([hashing.table_salt("recserve", f"C{i}") for i in range(1, 27)], np.uint64)
    grid = values[: 26 * 500].reshape(500, 26)
    want = hashing.keys_for(grid.view(np.uint64), salts[None, :])
    got = device_transform.keys_for(
        torch.from_numpy(grid).to(device), torch.from_numpy(salts.view(np.int64)).to(device)
    )
    assert np.array_equal(got.cpu().numpy(), want)
    assert (salts > np.uint64(2**63)).any()  # a salt above 2**63 went through its int64 bits


@pytest.mark.parametrize("device", DEVICES)
def test_masked_keys_match_the_host_history_keys(device, spec):
    transform = FeatureTransform(spec)
    rng = np.random.default_rng(9)
    items = rng.integers(0, 2**62, size=(64, 256), dtype=np.int64)
    items[0, :4] = [0, INT64.max, 1, 2]
    lengths = rng.integers(0, 257, size=64).astype(np.int32)
    host = transform.history(items, lengths, bucket=256)
    sequence = spec.sequences[0]
    mask = torch.from_numpy(host["history_mask"] > 0).to(device)
    got = masked_keys(
        torch.from_numpy(items).to(device),
        mask,
        hashing.table_salt(spec.hashing.namespace, sequence.table),
        hashing.missing_key(spec.hashing.namespace, sequence.name),
    )
    assert np.array_equal(got.cpu().numpy(), host["history_keys"])


def varied_spec(spec, flags=False):
    """The default spec with numeric columns that clip, log, standardize and min-max differently.

    With ``flags``: real-valued columns with missing flags, and a feature reading another's column.
    """
    doc = copy.deepcopy(spec.source)
    numeric = [
        {"name": "I{1..4}", "kind": "numeric", "fill_na": 0.0, "clip": [0.0, 1e9], "log1p": True},
        {
            "name": "I{5..7}",
            "kind": "numeric",
            "fill_na": -2.0,
            "clip": [-10.0, 1e6],
            "standardize": [3.5, 2.25],
        },
        {
            "name": "I{8..10}",
            "kind": "numeric",
            "fill_na": 1.0,
            "log1p": True,
            "clip": [-0.5, 3e4],
            "minmax": [0.0, 7.0],
        },
        {"name": "I{11..13}", "kind": "numeric", "fill_na": 0.5},
    ]
    if flags:
        numeric[-1] |= {"value_type": "real", "missing_flag": True}
        numeric.append({"name": "I5_log", "kind": "numeric", "column": "I5", "log1p": True, "clip": [0, 9]})
    doc["features"] = numeric + [f for f in doc["features"] if f.get("kind") != "numeric"]
    return parse_spec(doc)


@pytest.mark.parametrize("device", DEVICES)
def test_normalisation_matches_the_host_bit_for_bit(device, spec):
    for variant in (spec, varied_spec(spec), varied_spec(spec, flags=True)):
        transform = FeatureTransform(variant)
        rng = np.random.default_rng(21)
        columns = len(variant.dense.columns)
        values = (
            rng.standard_normal((20_000, columns)) * 10.0 ** rng.uniform(-6, 9, (20_000, columns))
        ).astype(np.float32)
        values[:7, :] = np.array([0.0, -1.0, 1.0, 1e9, -1e9, 3.4e38, -0.0], np.float32)[:, None]
        missing = rng.random(values.shape) < 0.1
        want = transform.dense_values(values, missing)
        normalizer = DeviceNormalizer(variant, device)
        got = normalizer(torch.from_numpy(values).to(device), torch.from_numpy(missing).to(device))
        assert got.dtype == torch.float32
        assert np.array_equal(
            got.cpu().numpy().view(np.int32), want.view(np.int32)
        )  # bit for bit, signs of 0 too


def test_a_missing_flag_is_its_own_dense_column_reading_its_features_column(spec):
    flagged = varied_spec(spec, flags=True)
    assert flagged.dense.columns == tuple(f"I{i}" for i in range(1, 14))  # the wire carries each once
    names = flagged.normalized_columns
    assert names[names.index("I11") + 1] == "I11_missing" and names[-1] == "I5_log"
    values = np.arange(2 * 13, dtype=np.float32).reshape(2, 13) + 0.25
    missing = np.zeros((2, 13), bool)
    missing[0, 10] = missing[1, 12] = True  # I11 missing in row 0, I13 in row 1
    dense = FeatureTransform(flagged).dense_values(values, missing)
    flags = dense[:, [names.index(f"I{i}_missing") for i in (11, 12, 13)]]
    np.testing.assert_array_equal(flags, [[1, 0, 0], [0, 0, 1]])
    np.testing.assert_array_equal(dense[:, names.index("I11")], [0.5, values[1, 10]])  # filled as before
