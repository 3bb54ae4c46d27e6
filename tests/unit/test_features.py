import numpy as np
import pytest

from recserve.backends.features.hashing import missing_key
from recserve.backends.features.transform import FeatureTransform
from recserve.build.synthetic import generate
from recserve.core.names import DENSE_NORMALIZED, HISTORY_KEYS, HISTORY_MASK, SPARSE_KEYS, TARGET_KEY
from recserve.core.values import parse_hex
from recserve.errors import InvalidInput


@pytest.fixture
def transform(spec):
    return FeatureTransform(spec)


@pytest.fixture
def wire(spec):
    return generate(spec, 6, seed=11).to_wire(spec)


def test_parse_hex_reads_upper_and_lower_case_and_empty():
    values, empty = parse_hex(np.array([[b"ff", b""], [b"DEADbeef", b"0"]], dtype=object), 16, "c")
    assert values.tolist() == [[255, 0], [0xDEADBEEF, 0]]
    assert empty.tolist() == [[False, True], [False, False]]


@pytest.mark.parametrize("bad", [b"xyz", b"12 4", b"1" * 17, "é".encode(), b"a\x00b"])
def test_parse_hex_names_the_input_and_value(bad):
    with pytest.raises(InvalidInput, match=r"input 'categorical'.*not a") as err:
        parse_hex(np.array([b"ab", bad], dtype=object), 16, "categorical")
    assert err.value.input_name == "categorical"


def test_dense_values_are_log1p_of_clipped_values_and_missing_is_zero(spec, transform, wire):
    wire[spec.dense.name][0, :3] = [np.e - 1, -5.0, 123456.0]
    wire[spec.dense_missing_input][0, 2] = True
    out = transform.transform(wire)[DENSE_NORMALIZED]
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[0, :3], [1.0, 0.0, 0.0], rtol=1e-6)


def test_empty_categorical_gets_the_feature_missing_key(spec, transform, wire):
    wire[spec.categorical.name][1, 4] = b""
    keys = transform.transform(wire)[SPARSE_KEYS]
    assert keys.shape == (6, 26)
    assert keys[1, 4] == missing_key(spec.hashing.namespace, "C5")


def test_absent_target_gets_its_missing_key(spec, transform, wire):
    wire[spec.target.name][2, 0] = -1
    keys = transform.transform(wire)[TARGET_KEY]
    assert keys[2, 0] == missing_key(spec.hashing.namespace, spec.target.name)


@pytest.mark.parametrize(("lengths", "bucket"), [([0, 0], 8), ([1, 0], 8), ([9, 3], 32), ([255, 1], 256)])
def test_history_is_padded_to_the_bucket_of_the_longest_row(spec, transform, lengths, bucket):
    items = np.arange(1, 2 * 256 + 1, dtype=np.int64).reshape(2, 256)
    out = transform.history(items, np.array(lengths, dtype=np.int32))
    assert out[HISTORY_KEYS].shape == (2, bucket)
    assert out[HISTORY_MASK].sum(1).tolist() == lengths


def test_history_keys_do_not_depend_on_the_client_padding_width(spec, transform):
    items = np.array([[5, 6, 7, 0, 0, 0, 0, 0, 0, 0]], dtype=np.int64)
    wide = transform.history(items, np.array([3], dtype=np.int32))
    narrow = transform.history(items[:, :3], np.array([3], dtype=np.int32))
    assert np.array_equal(wide[HISTORY_KEYS], narrow[HISTORY_KEYS])


def _bad_cases(spec):
    d, dm, c, t, h, hl = (x.name for x in spec.wire_inputs())

    def nan(w):
        w[d][3, 5], w[dm][3, 5] = np.nan, False

    def inf(w):
        w[d][0, 0], w[dm][0, 0] = np.inf, False

    return [
        ("wrong dtype", lambda w: w.__setitem__(d, w[d].astype(np.float64)), d, "dtype float64"),
        ("wrong shape", lambda w: w.__setitem__(d, w[d][:, :12]), d, "shape"),
        ("missing input", lambda w: w.pop(c), c, "missing"),
        ("NaN dense", nan, d, "I6 .row 3. is nan"),
        ("Inf dense", inf, d, "inf"),
        ("row count mismatch", lambda w: w.__setitem__(t, w[t][:2]), t, "rows"),
        ("too long history", lambda w: w.__setitem__(hl, np.full_like(w[hl], 257)), hl, "257"),
        ("length above width", lambda w: w.__setitem__(h, w[h][:, :1]) or w[hl].fill(2), hl, "width"),
        ("negative length", lambda w: w[hl].fill(-1), hl, "-1"),
        ("negative target", lambda w: w[t].fill(-7), t, "-7"),
        ("negative history id", lambda w: w[hl].fill(1) or w[h].fill(-3), h, "-3"),
        ("non-hex categorical", lambda w: w[c].__setitem__((0, 0), b"zz"), c, "zz"),
        ("wide history", lambda w: w.__setitem__(h, np.ones((6, 300), np.int64)), h, "300"),
        (
            "batch above max",
            lambda w: [w.__setitem__(k, np.repeat(v, 50, axis=0)) for k, v in list(w.items())],
            c,
            "300 rows",
        ),
    ]


def test_bad_inputs_name_the_input_and_value(spec, transform, wire):
    for label, corrupt, name, message in _bad_cases(spec):
        case = {k: v.copy() for k, v in wire.items()}
        corrupt(case)
        with pytest.raises(InvalidInput) as err:
            transform.transform(case)
            pytest.fail(f"{label}: no error")
        assert err.value.input_name == name, label
        assert f"input '{name}'" in str(err.value), label
        assert __import__("re").search(message, str(err.value)), (label, str(err.value))
