"""The compiled merge from cached states: the same history and outcomes as the step's other path.

A batch whose every row is a fresh cached hit is merged in one compiled call
(:class:`~recserve.backends.store.user_state.index.StateIndex`); every other batch takes the path that
fetches. Both must give the same keys, mask, weights and row states, bit for bit.
"""

import threading
import time

import numpy as np
import pytest

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.steps.user_history import UserHistories
from recserve.backends.store import kernels
from recserve.backends.store.user_state.index import FRESH, Refresher, StateCache, StateIndex
from recserve.backends.store.user_state.state import CLUSTERED, EXACT, UserState
from recserve.backends.store.user_state.states import LocalUserStates
from recserve.backends.store.user_state.tokens import dedup
from recserve.core.names import HISTORY_KEYS, HISTORY_LOG_WEIGHTS, HISTORY_MASK
from recserve.errors import InvalidInput
from tests.unit.helpers import USER_TAIL as TAIL
from tests.unit.helpers import user_rows, user_state_spec

SPEC = user_state_spec()

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the compiled kernels are not built")


class Entry:
    """A cached value naming a state of ``size`` tokens at ``seq`` (no arrays: nothing is merged)."""

    def __init__(self, seq: int, mode: int = 0, size: int = 0) -> None:
        self.index_entry = (0, 0, size, seq, mode)


def _found(index: StateIndex, user: int, now: float = 0.0, stale_ok: bool = False) -> tuple[int, int] | None:
    """The sequence number and stale flag ``user``'s one-row batch is served with (None: not served)."""
    served = index.merge(
        (np.array([[user]], np.int64), np.array([[0]], np.int64), np.array([[0]], np.int32)),
        TAIL,
        now,
        stale_ok,
        np.zeros((1, 8), np.int64),
        np.zeros((1, 8), np.float32),
        False,
        0,
        np.array([8], np.int64),
        8,
    )
    return None if served is None else (int(served[3][0, 0]), int(served[3][0, 3]))


def test_the_index_finds_every_user_put_and_none_removed_through_collisions():
    rng = np.random.default_rng(0)
    index, held = StateIndex.of(8), {}
    assert index is not None and index.slots == 16
    for step in range(3000):  # few slots, many users: long probe runs, removals inside them
        user = int(rng.choice([rng.integers(-(2**62), 2**62), rng.integers(0, 24)]))
        if held and (len(held) >= 8 or rng.random() < 0.45):
            gone = int(rng.choice(list(held)))
            index.remove(gone)
            del held[gone]
            assert _found(index, gone) is None
        else:
            index.put(user, Entry(seq=step), fresh_until=10.0, expires=10.0)
            held[user] = step
        assert len(index) == len(held)
    assert all(_found(index, user) == (seq, 0) for user, seq in held.items())


def test_an_entry_is_served_while_fresh_then_stale_where_allowed_then_not():
    index = StateIndex.of(4)
    index.put(7, Entry(seq=3), fresh_until=2.0, expires=4.0)
    assert _found(index, 7, now=2.0) == (3, 0) and _found(index, 7, now=2.000002) is None
    assert _found(index, 7, now=4.0, stale_ok=True) == (3, 1)
    assert _found(index, 7, now=4.000002, stale_ok=True) is None


def test_a_cache_tells_its_index_of_every_value_put_and_evicted():
    now = [0.0]
    index = StateIndex.of(2)
    cache = StateCache(2, ttl_s=1.0, clock=lambda: now[0], mirror=index)
    for user in (1, 2, 3):
        cache.put(user, Entry(seq=user))
    assert len(index) == 2 and _found(index, 1) is None and _found(index, 3) == (3, 0)
    now[0] = 1.5
    assert _found(index, 3, now=now[0]) is None  # as the cache: no longer fresh
    assert _found(index, 3, now=now[0], stale_ok=True) == (3, 1)  # served while read again
    cache.put(3, Entry(seq=9))
    assert _found(index, 3, now=now[0]) == (9, 0)
    cache.remove(3)
    assert len(index) == 1 and _found(index, 3, now=now[0], stale_ok=True) is None


def _pair(tmp_path, spec=SPEC):
    """Histories reading one store, with the compiled index and without (every batch the other path)."""
    states = LocalUserStates(tmp_path / "states.sqlite", ttl_s=60, max_tokens=spec.user_state.tokens)
    section = spec.user_state
    plain = UserHistories(spec, states, cache=StateCache(section.cache_users, section.cache_ttl_ms / 1000))
    indexed = UserHistories(spec, states)
    assert indexed.index is not None and plain.index is None
    return indexed, plain, states


def _apply(histories, spec, wire):
    features = FeatureTransform(spec).transform(wire)
    rows = histories.apply(wire, features)
    return features, rows


class Counting:
    """Counts the batches an index serves (a plain wrapper: the index itself runs)."""

    def __init__(self, index: StateIndex) -> None:
        self.index, self.served = index, 0
        self.merge_into = index.merge
        index.merge = self.merge  # type: ignore[method-assign]

    def merge(self, *args):
        served = self.merge_into(*args)
        self.served += served is not None
        return served


@pytest.mark.parametrize("padding", ["right", "left"])
def test_cached_hits_merge_in_one_call_to_what_the_other_path_gives(tmp_path, padding):
    spec = user_state_spec(padding)
    indexed, plain, states = _pair(tmp_path, spec)
    counting = Counting(indexed.index)
    rng = np.random.default_rng(5)
    events = {u: rng.integers(1, 80, 400) for u in range(1, 10)}
    for u, e in events.items():  # users 1..7 leave their tails no gap, 8 and 9 do; 10 has no state
        cut = 400 - (int(rng.integers(0, TAIL // 2)) if u < 8 else 3 * TAIL)
        states.put(u, UserState(cut, CLUSTERED if u % 2 else EXACT, dedup(e[:cut])))
    events[10] = rng.integers(1, 80, 400)
    for batch in range(60):
        users = rng.choice(np.arange(1, 11), int(rng.integers(1, 7)), p=[0.13] * 7 + [0.03] * 3)
        lengths = np.where(rng.random(users.size) < 0.1, 0, rng.integers(TAIL // 2, TAIL + 1, users.size))
        tails = [events[u][400 - n :] for u, n in zip(users, lengths, strict=True)]
        wire = user_rows(spec, users.size, batch, users, [400] * users.size, tails)
        (got, got_rows), (want, want_rows) = _apply(indexed, spec, wire), _apply(plain, spec, wire)
        for name in (HISTORY_KEYS, HISTORY_MASK, HISTORY_LOG_WEIGHTS):
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
        for field in ("outcome_codes", "state_seq", "mode_codes", "lag_events"):
            assert np.array_equal(getattr(got_rows, field), getattr(want_rows, field)), field
    assert 10 < counting.served < 60  # both paths taken


@pytest.mark.parametrize(
    ("change", "name", "match"),
    [
        (
            {"length": TAIL + 1},
            SPEC.attention_groups[0].length_input,
            f"at most \\[user_state\\] tail = {TAIL}",
        ),
        ({"newest": 1}, "user_seq", "below its history's 2 events"),
        ({"dtype": np.int32}, "user_id", "has dtype int32, expected INT64"),
    ],
)
def test_a_bad_input_of_a_cached_user_is_refused_naming_it(tmp_path, change, name, match):
    indexed, _, states = _pair(tmp_path)
    states.put(3, UserState(40, EXACT, dedup(np.arange(1, 41))))
    _apply(indexed, SPEC, user_rows(SPEC, 1, 6, [3], [40], [[1, 2]]))  # now cached and fresh
    length = change.get("length", 2)
    wire = user_rows(SPEC, 1, 6, [3], [change.get("newest", 40)], [list(range(1, length + 1))])
    wire["user_id"] = wire["user_id"].astype(change.get("dtype", np.int64))
    with pytest.raises(InvalidInput, match=match) as raised:
        _apply(indexed, SPEC, wire)
    assert raised.value.input_name == name


class Reads:
    """The store, with the threads that read it noted (the store itself runs)."""

    def __init__(self, states: LocalUserStates) -> None:
        self.states, self.threads = states, []

    def fetch(self, users, known=()):
        self.threads.append(threading.current_thread().name)
        return self.states.fetch(users, known)

    def close(self) -> None:
        self.states.close()


def _wait(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)


def _aging(tmp_path):
    """Histories over a real store, a cache of a 1 s time to live on a clock the test sets."""
    now = [0.0]
    states = LocalUserStates(tmp_path / "states.sqlite", ttl_s=60, max_tokens=SPEC.user_state.tokens)
    reads = Reads(states)
    histories = UserHistories(SPEC, reads, cache=StateCache(100, 1.0, clock=lambda: now[0]))
    states.put(7, UserState(50, EXACT, dedup(np.arange(1, 51))))
    wire = user_rows(SPEC, 1, 5, [7], [52], [[1, 2]])
    assert list(_apply(histories, SPEC, wire)[1].outcomes) == ["hit"]  # read on the request path
    return now, states, reads, histories, wire


def test_a_state_past_its_time_to_live_is_served_and_read_again_off_the_request_path(tmp_path):
    now, states, reads, histories, wire = _aging(tmp_path)
    states.put(7, UserState(51, EXACT, dedup(np.arange(1, 52))))  # rebuilt since
    now[0] = 1.5
    rows = _apply(histories, SPEC, wire)[1]
    assert list(rows.outcomes) == ["hit"] and rows.state_seq.tolist() == [50]  # the cached one
    _wait(lambda: histories.cache.peek(7)[1] == FRESH)
    assert reads.threads == ["MainThread", "recserve-state-refresh"]
    assert _apply(histories, SPEC, wire)[1].state_seq.tolist() == [51]
    histories.close()


def test_an_erased_state_leaves_the_cache_when_read_again(tmp_path):
    now, states, reads, histories, wire = _aging(tmp_path)
    states.delete(7)
    now[0] = 1.5
    assert list(_apply(histories, SPEC, wire)[1].outcomes) == ["hit"]  # served once more, read again
    _wait(lambda: histories.cache.peek(7)[0] is None)
    assert list(_apply(histories, SPEC, wire)[1].outcomes) == ["miss"]
    histories.close()


def test_a_state_past_twice_its_time_to_live_is_read_on_the_request_path(tmp_path):
    now, states, reads, histories, wire = _aging(tmp_path)
    states.put(7, UserState(51, EXACT, dedup(np.arange(1, 52))))
    now[0] = 2.5
    assert _apply(histories, SPEC, wire)[1].state_seq.tolist() == [51]
    assert reads.threads == ["MainThread", "MainThread"]
    histories.close()


def test_a_failing_refresh_is_counted_and_the_thread_goes_on():
    calls = []

    def refresh(users):
        calls.append(sorted(users))
        if len(calls) == 1:
            raise ConnectionError("store down")

    refresher = Refresher(refresh)
    refresher.add([1, 2])
    _wait(lambda: refresher.failed == 2)
    refresher.add([3])
    _wait(lambda: refresher.refreshed == 1)
    assert calls == [[1, 2], [3]]
    refresher.close()


def test_the_refresher_reads_between_requests_not_during_one():
    calls = []
    refresher = Refresher(calls.append, quiet_s=0.01, patience_s=60.0)
    with refresher.serving():
        refresher.add([1])
        time.sleep(0.2)  # the request that found the state stale is still in the step
        assert calls == []
    _wait(lambda: refresher.refreshed == 1)  # read once the step is quiet
    assert calls == [[1]]
    refresher.close()


def test_the_refresher_reads_after_its_patience_when_the_step_is_never_quiet():
    calls = []
    refresher = Refresher(calls.append, quiet_s=0.01, patience_s=0.05)
    with refresher.serving():
        refresher.add([1])
        _wait(lambda: refresher.refreshed == 1)
    assert calls == [[1]]
    refresher.close()
