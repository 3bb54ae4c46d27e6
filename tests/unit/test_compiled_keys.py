"""The compiled key loops give the numpy paths' keys bit for bit, and leave every refusal to them."""

import numpy as np
import pytest

from recserve.backends.features import compiled_keys
from recserve.backends.features.hashing import splitmix64
from recserve.backends.features.transform import FeatureTransform
from recserve.build.synthetic import generate
from recserve.core.spec.parse import load_spec
from recserve.errors import InvalidInput

LOOPS = compiled_keys.load()
pytestmark = pytest.mark.skipif(
    LOOPS is None, reason="the compiled key loops are not built (no C compiler at install)"
)


def numpy_keys(values, salts):
    return splitmix64(np.asarray(values, dtype=np.uint64) ^ salts).view(np.int64)


def test_keys_with_one_salt_or_one_per_column_are_the_numpy_keys():
    rng = np.random.default_rng(1)
    values = rng.integers(0, 2**63, size=(7, 5), dtype=np.int64).astype(np.uint64) * np.uint64(2)
    per_column = rng.integers(0, 2**63, size=(1, 5), dtype=np.int64).astype(np.uint64)
    for view, salts in [
        (values, np.uint64(12345)),
        (values, per_column),
        (values[:, 1:4], per_column[:, 1:4]),  # not contiguous
        (values[:1], per_column[0]),
        (values[:0], per_column),
        (values.reshape(-1), np.uint64(3)),
    ]:
        got = LOOPS.keys(view, np.asarray(salts))
        assert got is not None and got.dtype == np.int64 and np.array_equal(got, numpy_keys(view, salts))


def test_a_salt_broadcast_along_another_axis_is_left_to_numpy():
    values = np.arange(9, dtype=np.uint64).reshape(3, 3)
    assert LOOPS.keys(values, np.arange(3, dtype=np.uint64)[:, None]) is None
    assert LOOPS.keys(values, np.arange(2, dtype=np.uint64)) is None


class NumpyOnly:
    """A transform whose every key is made by the numpy paths (its own and ``keys_for``'s)."""

    def __init__(self, spec, monkeypatch):
        self.transform_ = FeatureTransform(spec)
        self.transform_._loops = self.transform_._categorical_loop = None
        self.monkeypatch = monkeypatch

    def __getattr__(self, name):
        def call(*args):
            with self.monkeypatch.context() as patch:
                patch.setattr(compiled_keys, "load", lambda: None)
                return getattr(self.transform_, name)(*args)

        return call


@pytest.fixture(params=["ctr", "tiny"])
def transforms(request, monkeypatch):
    spec = load_spec(request.param)
    compiled = FeatureTransform(spec)
    assert compiled._loops is not None
    return spec, compiled, NumpyOnly(spec, monkeypatch)


def assert_same(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].dtype == expected[name].dtype and np.array_equal(got[name], expected[name]), name


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_transform_makes_the_numpy_paths_keys(transforms, rows):
    spec, compiled, reference = transforms
    batch = generate(spec, rows, seed=rows)
    for form in ("bytes", "ids"):
        inputs = batch.to_wire(spec, form)
        assert_same(compiled.transform(inputs), reference.transform(inputs))


def test_both_padding_sides_absent_targets_and_every_length(transforms):
    spec, compiled, reference = transforms
    if not spec.sequences:
        pytest.skip("the spec has no sequence")
    sequence = spec.sequences[0]
    rng = np.random.default_rng(3)
    width = sequence.max_length
    items = rng.integers(0, 2**40, size=(6, width), dtype=np.int64)
    lengths = np.array([0, 1, 2, width // 2, width - 1, width], np.int32)
    bucket = spec.sequence_bucket(width)
    for padding in ("right", "left"):
        seq = type(sequence)(**{**sequence.__dict__, "padding": padding})
        assert_same(
            compiled.history(items, lengths, seq, bucket), reference.history(items, lengths, seq, bucket)
        )
    targets = np.array([[-1], [0], [2**62], [17]], np.int64)
    assert np.array_equal(compiled.target_keys(targets), reference.target_keys(targets))


@pytest.mark.parametrize(
    "case",
    ["negative id", "length over the width", "negative length", "id past the maximum", "target below -1"],
)
def test_a_refused_request_gets_the_numpy_paths_error(transforms, case):
    spec, compiled, reference = transforms
    if not spec.sequences:
        pytest.skip("the spec has no sequence")
    sequence = spec.sequences[0]
    items = np.ones((2, 4), np.int64)
    lengths = np.array([2, 3], np.int32)
    if case == "negative id":
        items[1, 2] = -5
    elif case == "length over the width":
        lengths[0] = 5
    elif case == "negative length":
        lengths[1] = -1
    elif case == "id past the maximum":
        items = np.ones((2, sequence.max_length + 2), np.int64)
    errors = []
    for transform in (compiled, reference):
        with pytest.raises(InvalidInput) as raised:
            if case == "target below -1":
                transform.target_keys(np.array([[3], [-2]], np.int64))
            else:
                transform.history(items, lengths, sequence, spec.sequence_bucket(1))
        errors.append(str(raised.value))
    assert errors[0] == errors[1]
