"""Error messages never echo a whole request value: ``shorten``, ``shorten_all`` and ``cap_message``."""

from __future__ import annotations

import time

import numpy as np
import pytest

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.features.vocabulary import vocabulary_keys
from recserve.build.synthetic import generate
from recserve.core.spec.parse import load_spec
from recserve.core.values import categorical_values, hash_strings, parse_hex
from recserve.errors import MESSAGE_LIMIT, InvalidInput, cap_message, shorten, shorten_all


def test_shorten_keeps_a_short_value_as_its_repr() -> None:
    assert shorten("abc") == "'abc'"
    assert shorten(b"ab") == "b'ab'"
    assert shorten(12) == "12"


def test_shorten_cuts_a_long_string_and_states_its_length() -> None:
    text = shorten("a" * 1_048_576)
    assert text == "'" + "a" * 64 + "…' (1048576 chars)"


def test_shorten_cuts_bytes_and_never_splits_an_escape() -> None:
    text = shorten(b"\x00" * 70_000, limit=10)
    assert text == "b'\\x00\\x00…' (70000 bytes)"


def test_shorten_escapes_newlines_so_a_message_stays_on_one_line() -> None:
    text = shorten("x\n" * 1000)
    assert "\n" not in text
    assert text.endswith("(2000 chars)")
    assert len(text) < 100


def test_shorten_counts_escapes_against_the_limit() -> None:
    text = shorten("\x00" * 60)
    assert len(text) < 100
    assert text.endswith("(60 chars)")


def test_shorten_cuts_other_values_on_their_repr() -> None:
    text = shorten(list(range(10_000)), limit=20)
    assert text.startswith("[0, 1, 2, 3")
    assert len(text) < 50
    assert "chars)" in text


def test_shorten_reads_numpy_strings_as_plain_ones() -> None:
    assert shorten(np.str_("z" * 100), limit=3) == "'zzz…' (100 chars)"
    assert shorten(np.bytes_(b"q" * 100), limit=3) == "b'qqq…' (100 bytes)"


def test_shorten_all_names_a_few_then_counts_the_rest() -> None:
    assert shorten_all(["a", "b"]) == "'a', 'b'"
    assert shorten_all([f"n{i}" for i in range(100)], most=3) == "'n0', 'n1', 'n2' and 97 more"
    assert len(shorten_all(["x" * 100_000] * 1000)) < 600


def test_cap_message_keeps_short_messages_and_cuts_long_ones() -> None:
    assert cap_message("fine") == "fine"
    capped = cap_message("y" * 5000)
    assert len(capped) == MESSAGE_LIMIT
    assert capped.endswith("… (5000 chars)")


# Each request-path message that names a value shows it shortened, with its length.

HUGE = 1 << 18  # 256 KiB: past any sane field, and every message stays under BOUND
BOUND = 400  # a whole message naming one shortened value stays well under this


def _refusal(call) -> str:
    with pytest.raises(InvalidInput) as err:
        call()
    message = str(err.value)
    assert len(message) < BOUND, f"a {len(message)}-character message: {message[:200]}"
    return message


def test_a_huge_hex_value_is_named_shortened_with_its_length() -> None:
    values = np.array([b"ab", b"z" * HUGE], dtype=object)
    message = _refusal(lambda: parse_hex(values, 16, "categorical"))
    assert message.startswith("input 'categorical': value b'zzz")
    assert f"({HUGE} bytes) at flat index 1" in message


def test_a_huge_non_ascii_value_is_named_shortened() -> None:
    values = np.array(["é" * HUGE], dtype=object)
    message = _refusal(lambda: parse_hex(values, 16, "categorical"))
    assert "'éé" in message and f"({HUGE} chars)" in message


def test_a_huge_decimal_value_is_named_shortened() -> None:
    group = load_spec("avazu").categorical
    row = [b"14102100", b"9" * HUGE] + [b"1"] * (len(group.raw_columns) - 2)
    message = _refusal(lambda: categorical_values(np.array([row], dtype=object), group))
    assert "C1 (row 0) is b'999" in message and f"({HUGE} bytes): not an int64" in message


def test_a_huge_time_value_and_its_parse_error_are_shortened() -> None:
    group = load_spec("avazu").categorical
    row = [b"1" * HUGE] + [b"1"] * (len(group.raw_columns) - 1)
    message = _refusal(lambda: categorical_values(np.array([row], dtype=object), group))
    assert "hour (row 0) is b'111" in message and "not a time in format" in message


def test_a_huge_list_element_and_multi_hot_field_are_shortened() -> None:
    spec = load_spec("taobao")
    sent = generate(spec, 4, seed=3).to_wire(spec)
    transform = FeatureTransform(spec)
    sent["tags"] = sent["tags"].copy()
    sent["tags"][1, 0] = b"1|" * HUGE
    message = _refusal(lambda: transform.transform(sent))
    assert "input 'tags': row 1 position 0 is b'1|1|" in message and f"({2 * HUGE} bytes)" in message
    sent["tags"][1, 0] = b"x" * HUGE
    message = _refusal(lambda: transform.transform(sent))
    assert "tags (row 1) is b'xxx" in message and "not a list of int64 values" in message


def test_a_huge_categorical_value_in_a_request_is_shortened(spec) -> None:
    sent = generate(spec, 3, seed=4).to_wire(spec)
    sent[spec.categorical.name][2, 5] = "q" * HUGE
    message = _refusal(lambda: FeatureTransform(spec).transform(sent))
    assert f"input '{spec.categorical.name}'" in message and f"({HUGE} chars)" in message


def test_a_vocabulary_token_is_named_by_its_row_counting_the_pad_row(spec) -> None:
    table = spec.categorical.features[0].table
    with pytest.raises(InvalidInput, match=r"value 'zz' at flat index 2 "):
        vocabulary_keys(spec, table, ["<pad>", "ab", "zz"], skip=[0])
    item = spec.targets[0].table
    with pytest.raises(InvalidInput, match=r"token 2 is 'x'"):
        vocabulary_keys(spec, item, ["<pad>", "1", "x"], skip=[0])
    with pytest.raises(InvalidInput, match=r"token 3 is None"):
        vocabulary_keys(spec, item, ["1", None, "2", None], skip=[1])


def test_skipped_vocabulary_rows_are_left_out_of_the_keys(spec) -> None:
    table = spec.categorical.features[0].table
    keys = vocabulary_keys(spec, table, [None, "ab", "cd", {}], skip=[0, 3])
    np.testing.assert_array_equal(keys, vocabulary_keys(spec, table, ["ab", "cd"]))
    item = spec.targets[0].table
    np.testing.assert_array_equal(
        vocabulary_keys(spec, item, ["1", "junk", "-1"], skip=[1]), vocabulary_keys(spec, item, ["1", "-1"])
    )


def test_a_vocabulary_refusal_reads_well_and_shortens_the_token() -> None:
    spec = load_spec("avazu")
    message = _refusal(lambda: vocabulary_keys(spec, "site_id", ["a", b"b" * HUGE]))
    assert "token 1 is b'bbb" in message and f"({HUGE} bytes); this table's values are strings" in message
    assert "string strings" not in message
    message = _refusal(lambda: vocabulary_keys(spec, "t" * HUGE, ["a"]))
    assert f"({HUGE} chars) is not a table of spec" in message


def test_long_strings_hash_as_fnv1a_and_in_time_linear_in_their_bytes() -> None:
    from recserve.backends.features.hashing import fnv1a64

    texts = ["", "a", "x" * 64, "y" * 65, "café" * 40, "z" * 1000]
    keys, empty = hash_strings(np.array(texts, dtype=object).reshape(-1, 1))
    assert keys[:, 0].tolist() == [fnv1a64(t) for t in texts]
    assert empty[:, 0].tolist() == [True] + [False] * 5
    batch = np.array([[b"s" * (1 << 20)]] + [[b"short"]] * 63, dtype=object)
    started = time.perf_counter()
    hash_strings(batch)  # was one numpy step per byte of the longest value: 20 to 50 s here
    assert time.perf_counter() - started < 5


def test_a_huge_field_in_a_client_file_is_named_shortened(spec) -> None:
    import io

    from recserve.clients.rows import RowFormatError, read_rows

    def line(dense: list[str], cats: list[str]) -> str:
        return "\t".join(dense + cats + ["3", "4"]) + "\n"

    dense, cats = [str(i) for i in range(13)], [f"{i:08x}" for i in range(26)]
    for bad_dense, bad_cats in [
        ([*dense[:3], "q" * HUGE, *dense[4:]], cats),
        (dense, [*cats[:5], "g" * HUGE, *cats[6:]]),
    ]:
        with pytest.raises(RowFormatError, match=f"line 1, column .*\\({HUGE} chars\\) is not a") as err:
            read_rows(io.StringIO(line(bad_dense, bad_cats)), spec)
        assert len(str(err.value)) < BOUND


@pytest.mark.parametrize("token", ["9" * HUGE, "--5", "5-", ""])
def test_an_item_vocabulary_token_that_is_no_id_is_refused_naming_it(spec, token) -> None:
    message = _refusal(lambda: vocabulary_keys(spec, spec.targets[0].table, ["1", "-1", token]))
    assert "token 2 is '" in message and "ids >= 0 (-1: absent)" in message
