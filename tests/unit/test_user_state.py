"""The user state: its stored bytes (checked on the way back), the local store, the spec section."""

import sqlite3
import struct

import numpy as np
import pytest

from recserve.backends.store.user_state.state import (
    CLUSTERED,
    EXACT,
    HEADER_BYTES,
    StateFormatError,
    UserState,
    decode_state,
    decode_states,
)
from recserve.backends.store.user_state.states import ABSENT, BAD_VALUE, FOUND, LocalUserStates
from recserve.backends.store.user_state.tokens import Tokens, dedup
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import parse_spec
from tests.unit.helpers import ctr_spec_document


def _state(seq=7, mode=EXACT):
    return UserState(seq, mode, dedup(np.array([3, 9, 3, 12, -5])), table_version=4, dense_version=2)


def test_a_state_round_trips_through_its_bytes():
    state = _state(seq=2**63 - 1, mode=CLUSTERED)
    back = decode_state(state.encode(), max_tokens=8)
    assert back.seq == state.seq and back.mode == CLUSTERED
    assert back.tokens.equals(state.tokens)
    assert (back.table_version, back.dense_version) == (4, 2)
    assert decode_state(UserState(0, EXACT, Tokens.empty()).encode(), 1).tokens.events == 0


def _patched(value: bytes, at: int, new: bytes) -> bytes:
    return value[:at] + new + value[at + len(new) :]


GOOD = _state().encode()
COUNTS_AT = HEADER_BYTES + 8 * 4


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("a string", "not bytes"),
        (None, "not bytes"),
        (b"", "not a user state"),
        (b"RSU2" + GOOD[4:], "not a user state"),
        (_patched(GOOD, 4, b"12345678901234567x90"), "is not 20 digits"),
        (_patched(GOOD, 4, b"%020d" % 2**63), "beyond 9223372036854775807"),
        (_patched(GOOD, 24, b"\x07"), "unknown mode"),
        (GOOD[:-1], "bytes for 4 tokens"),
        (GOOD + b"\0" * 12, "bytes for 4 tokens"),
        (_patched(GOOD, 26, struct.pack("<I", 1 << 30)), "over the limit"),
        (_patched(GOOD, COUNTS_AT, b"\0\0\0\0"), "count 0"),
        (_patched(GOOD, HEADER_BYTES, GOOD[HEADER_BYTES + 8 : HEADER_BYTES + 16]), "two tokens"),
    ],
)
def test_a_stored_value_that_is_not_a_state_is_refused_naming_what_is_wrong(value, says):
    with pytest.raises(StateFormatError, match=says):
        decode_state(value, max_tokens=8)


def test_a_batch_decodes_each_value_as_alone_and_a_bad_one_costs_only_its_own_place():
    other = UserState(9, CLUSTERED, dedup(np.array([5, 6, 5, 5])), table_version=1).encode()
    zero_count = _patched(GOOD, COUNTS_AT, b"\0\0\0\0")
    twice = _patched(GOOD, HEADER_BYTES, GOOD[HEADER_BYTES + 8 : HEADER_BYTES + 16])
    values = [GOOD, b"junk", other, zero_count, UserState(3, EXACT, Tokens.empty()).encode(), twice, GOOD]
    decoded = decode_states(values, max_tokens=8)
    assert [type(d).__name__ for d in decoded] == [
        "UserState", "StateFormatError", "UserState", "StateFormatError", "UserState", "StateFormatError",
        "UserState",
    ]  # fmt: skip
    for value, got in zip(values, decoded, strict=True):
        if isinstance(got, UserState):
            alone = decode_state(value, max_tokens=8)
            assert (got.seq, got.mode, got.raw) == (alone.seq, alone.mode, value)
            assert got.tokens.equals(alone.tokens) and got.tokens.items.dtype == np.int64
    assert "count 0" in str(decoded[3]) and "two tokens" in str(decoded[5])
    assert decode_states([], max_tokens=8) == []


def test_a_state_over_this_servers_token_limit_is_refused():
    with pytest.raises(StateFormatError, match="4 tokens, over the limit of 3"):
        decode_state(GOOD, max_tokens=3)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_local_store_never_lets_an_older_build_replace_a_newer_one(tmp_path):
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=60, max_tokens=8)
    assert states.put(1, _state(seq=10))
    assert not states.put(1, _state(seq=9))  # an older build, late
    assert states.put(1, _state(seq=10, mode=CLUSTERED))  # the same events regrouped
    fetched = states.fetch(np.array([1, 2]))
    assert fetched.outcomes == [FOUND, ABSENT]
    assert fetched.states[0].seq == 10 and fetched.states[0].mode == CLUSTERED
    other = LocalUserStates(tmp_path / "s.sqlite", ttl_s=60, max_tokens=8)  # another process's view
    assert other.fetch(np.array([1])).states[0].seq == 10


def test_a_state_expires_after_its_ttl_and_an_expired_one_may_be_replaced_by_any(tmp_path):
    clock = Clock()
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=60, max_tokens=8, clock=clock)
    states.put(5, _state(seq=30))
    clock.now += 59
    assert states.fetch(np.array([5])).outcomes == [FOUND]
    clock.now += 2
    assert states.fetch(np.array([5])).outcomes == [ABSENT]
    assert states.put(5, _state(seq=3))  # the log was replayed from its start


def test_delete_erases_a_users_state(tmp_path):
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=60, max_tokens=8)
    states.put(5, _state())
    assert states.delete(5) and not states.delete(5)
    assert states.fetch(np.array([5])).outcomes == [ABSENT]


def test_a_state_read_again_with_the_same_bytes_is_reused_and_a_changed_one_decoded(tmp_path):
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=60, max_tokens=8)
    states.put(1, _state(seq=5))
    states.put(2, _state(seq=6))
    first = states.fetch(np.array([1, 2])).states
    assert first[0].raw == _state(seq=5).encode()
    states.put(2, _state(seq=9))
    again = states.fetch(np.array([1, 2]), first).states
    assert again[0] is first[0] and again[1] is not first[1] and again[1].seq == 9
    states.delete(1)
    assert states.fetch(np.array([1]), first[:1]).outcomes == [ABSENT]


def test_a_bad_value_costs_its_own_user_its_state_and_nothing_else(tmp_path):
    path = tmp_path / "s.sqlite"
    states = LocalUserStates(path, ttl_s=60, max_tokens=8)
    states.put(1, _state())
    states.put(2, _state())
    with sqlite3.connect(path) as db:
        db.execute("UPDATE states SET value = ? WHERE user = 2", (b"RSU1garbage",))
    fetched = states.fetch(np.array([1, 2, 3]))
    assert fetched.outcomes == [FOUND, BAD_VALUE, ABSENT]
    assert fetched.states[1] is None and fetched.states[0] is not None


def _spec(**section):
    doc = ctr_spec_document()
    doc["user_state"] = section
    return parse_spec(doc)


def test_the_section_is_off_by_default_and_its_budget_must_fit_the_largest_bucket():
    assert not parse_spec(ctr_spec_document()).user_state.enabled
    assert _spec(enabled=True).user_state.tokens + _spec(enabled=True).user_state.tail <= 256
    with pytest.raises(
        SpecError, match=r"tokens \+ tail \(250 \+ 64\) must fit the largest sequence bucket 256"
    ):
        _spec(enabled=True, tokens=250, exact_tokens=200)
    with pytest.raises(SpecError, match="exact_tokens < tokens"):
        _spec(enabled=True, exact_tokens=192)
    with pytest.raises(SpecError, match="store must be one of"):
        _spec(enabled=True, store="memcached")
    with pytest.raises(SpecError, match="unknown key 'token'|token"):
        _spec(token=3)
    with pytest.raises(SpecError, match="bucket_margin must be >= 0"):
        _spec(enabled=True, bucket_margin=-1)


def test_states_get_their_own_sequence_bucket_below_the_largest():
    today = parse_spec(ctr_spec_document()).serving.sequence_buckets
    assert today[-2:] == (128, 256)
    assert _spec(enabled=True).serving.sequence_buckets == (*today[:-1], 192 + 16, 256)
    assert _spec(enabled=True, tokens=100, exact_tokens=90, bucket_margin=4).serving.sequence_buckets == (
        *today[:-2],
        104,
        128,
        256,
    )
    for unchanged in (
        _spec(),  # off
        _spec(enabled=True, bucket_margin=0),
        _spec(enabled=True, bucket_margin=64),  # 256: the largest already
        _spec(enabled=True, tokens=120, exact_tokens=100, bucket_margin=8),  # 128: a bucket already
    ):
        assert unchanged.serving.sequence_buckets == today
