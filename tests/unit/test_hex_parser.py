"""The compiled hex parser gives recserve.core.values.parse_hex's results bit for bit, and its errors."""

import numpy as np
import pytest

from recserve.backends.features import hex_parser
from recserve.core.values import parse_hex
from recserve.errors import InvalidInput

PARSER = hex_parser.load()
pytestmark = pytest.mark.skipif(
    PARSER is None, reason="the compiled hex parser is not built (no C compiler at install)"
)


def random_hex(rng, count, digits=16):
    lengths = rng.integers(0, digits + 1, size=count)
    alphabet = np.frombuffer(b"0123456789abcdefABCDEF", dtype="S1")
    return np.array([b"".join(rng.choice(alphabet, size=n)) for n in lengths], dtype=object)


@pytest.mark.parametrize("digits", [16, 8, 1])
def test_random_strings_parse_as_the_numpy_path(digits):
    rng = np.random.default_rng(digits)
    values = random_hex(rng, 4000, digits).reshape(200, 20)
    for view in (values, values[:, 3:11], values[:1], values[:0]):  # contiguous or not, one row, none
        got, expected = PARSER(view, digits, "c"), parse_hex(view, digits, "c")
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_edge_values():
    row = [b"", b"0", b"ffffffffffffffff", b"FFFFFFFFFFFFFFFF", "DEADbeef", b"0001"]
    values = np.array([row], dtype=object)
    got, empty = PARSER(values, 16, "c")
    assert got.tolist() == [[0, 0, 2**64 - 1, 2**64 - 1, 0xDEADBEEF, 1]]
    assert empty.tolist() == [[True, False, False, False, False, False]]


@pytest.mark.parametrize(
    "bad", [b"12g4", b"12345678901234567", b"ab\x00cd", b"a b", "caf\u00e9", b"-1", b"0x1f"]
)
def test_a_bad_value_is_refused_with_the_numpy_paths_message(bad):
    values = np.array([[b"ab", b"cd"], [b"ef", bad]], dtype=object)
    with pytest.raises(InvalidInput) as compiled:
        PARSER(values, 16, "categorical")
    with pytest.raises(InvalidInput) as numpy_path:
        parse_hex(values, 16, "categorical")
    assert str(compiled.value) == str(numpy_path.value) and "categorical" in str(compiled.value)


def test_surrounding_whitespace_is_not_part_of_a_value_on_either_path():
    values = np.array([[b" ab", b"cd\t", b" \r\n", b"ffffffffffffffff "]], dtype=object)
    for parse in (PARSER, parse_hex):
        got, empty = parse(values, 16, "c")
        assert got.tolist() == [[0xAB, 0xCD, 0, 2**64 - 1]]
        assert empty.tolist() == [[False, False, True, False]]
