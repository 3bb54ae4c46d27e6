"""Error messages never echo a whole request value: ``shorten``, ``shorten_all`` and ``cap_message``."""

from __future__ import annotations

import numpy as np

from recserve.errors import MESSAGE_LIMIT, cap_message, shorten, shorten_all


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
