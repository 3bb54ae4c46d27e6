"""A user's events as distinct items with counts, and the merge of a stored state with a newer tail."""

import numpy as np
import pytest

from recserve.backends.store.user_state.tokens import (
    GAP,
    HIT,
    MISS,
    StoredTokens,
    Tokens,
    dedup,
    merge,
    merge_rows,
    tail_sequence,
)


def test_dedup_counts_each_item_once_ordered_by_its_last_occurrence():
    tokens = dedup(np.array([5, 7, 5, 9, 7, 7]))
    assert tokens.items.tolist() == [5, 9, 7]
    assert tokens.counts.tolist() == [2, 1, 3]
    assert tokens.events == 6
    np.testing.assert_allclose(tokens.log_weights(), np.log([2, 1, 3]), rtol=1e-7)
    assert len(dedup(np.zeros(0, np.int64))) == 0


def test_a_tail_of_consecutive_events_ends_at_its_newest_sequence_number():
    assert tail_sequence(3, 10).tolist() == [8, 9, 10]
    assert tail_sequence(0, 10).tolist() == []


def _events(rng, count, distinct):
    return rng.integers(1, distinct + 1, count).astype(np.int64)


@pytest.mark.parametrize("seed", range(40))
def test_state_plus_tail_equals_dedup_of_all_events_with_overlap_or_none(seed):
    """Events 1..n; the state holds 1..k; the tail holds j..n with j <= k + 1 (overlapping or adjacent)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    events = _events(rng, n, int(rng.integers(1, 60)))
    k = int(rng.integers(0, n + 1))  # events in the state (0: an empty state, seq 0)
    j = int(rng.integers(max(1, k + 1 - 64), k + 2))  # the tail's first event, 1-based
    tail = events[j - 1 :]
    merged = merge(dedup(events[:k]), k, tail, n)
    assert merged.tokens.equals(dedup(events)), (n, k, j)
    assert merged.outcome == HIT
    assert merged.merged_events == n - k
    assert merged.lag_events == n - k


@pytest.mark.parametrize("seed", range(20))
def test_a_gap_is_reported_and_the_result_is_the_state_plus_the_whole_tail(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(10, 300))
    events = _events(rng, n, 30)
    k = int(rng.integers(0, n - 2))
    j = int(rng.integers(k + 2, n + 1))  # events k+1 .. j-1 reach neither the state nor the tail
    merged = merge(dedup(events[:k]), k, events[j - 1 :], n)
    assert merged.outcome == GAP
    assert merged.tokens.equals(dedup(np.concatenate([events[:k], events[j - 1 :]])))


def test_an_empty_tail_serves_the_state_and_no_state_serves_the_tail_alone():
    state = dedup(np.array([1, 2, 2]))
    same = merge(state, 3, np.zeros(0, np.int64), 3)
    assert same.tokens.equals(state) and same.outcome == HIT and same.merged_events == 0
    miss = merge(None, 0, np.array([4, 4, 6]), 9)
    assert miss.outcome == MISS and miss.tokens.equals(dedup(np.array([4, 4, 6])))
    empty = merge(Tokens.empty(), 0, np.array([4, 6]), 2)
    assert empty.tokens.equals(dedup(np.array([4, 6])))


def test_a_state_newer_than_the_request_is_served_as_it_is():
    state = dedup(np.array([1, 2, 3, 4]))
    merged = merge(state, 4, np.array([2, 3]), 3)  # the client knows events up to 3 only
    assert merged.tokens.equals(state)
    assert merged.merged_events == 0 and merged.lag_events == 0 and merged.outcome == HIT


def test_the_merge_leaves_its_inputs_untouched():
    state = dedup(np.array([1, 2, 2, 3]))
    items, counts = state.items.copy(), state.counts.copy()
    merge(state, 4, np.array([2, 5]), 6)
    assert np.array_equal(state.items, items) and np.array_equal(state.counts, counts)


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("seed", range(10))
def test_a_batch_merged_at_once_gives_each_row_its_states_events_and_its_newer_tail_events(seed, padding):
    """Rows of a few users (a user on several rows, with tails of its own), padded tails, gaps, overlaps."""
    rng = np.random.default_rng(200 + seed)
    users = int(rng.integers(1, 5))
    events = [_events(rng, int(rng.integers(1, 200)), int(rng.integers(1, 40))) for _ in range(users)]
    built = [int(rng.integers(0, e.size + 1)) for e in events]  # user u's state holds 1..built[u]
    which = rng.integers(0, users, int(rng.integers(1, 9)))
    spans = []
    for u in which:
        n = int(rng.integers(1, events[u].size + 1))  # the row's client knows events 1..n
        spans.append((int(rng.integers(1, n + 2)), n))  # its tail: events j..n (empty when j = n + 1)
    tails = [events[u][j - 1 : n] for u, (j, n) in zip(which, spans, strict=True)]
    width = max(1, max(t.size for t in tails))
    padded = np.full((which.size, width), -7, np.int64)  # never read
    sizes = np.array([t.size for t in tails])
    for r, tail in enumerate(tails):
        padded[r, width - tail.size if padding == "left" else 0 :][: tail.size] = tail
    rows = merge_rows(
        [dedup(e[:k]) for e, k in zip(events, built, strict=True)],
        np.array(built),
        which,
        padded,
        sizes,
        np.array([n for _, n in spans]),
        width - sizes if padding == "left" else None,
    )
    assert rows.lengths.sum() == rows.items.size == rows.counts.size
    for r, (u, (j, n)) in enumerate(zip(which, spans, strict=True)):
        k = built[u]
        expected = dedup(np.concatenate([events[u][:k], events[u][max(j, k + 1) - 1 : n]]))
        assert rows.row(r).equals(expected), r
        assert rows.outcomes[r] == (GAP if j <= n and j > k + 1 else HIT)
        assert rows.merged_events[r] == max(0, n - max(j, k + 1) + 1) and rows.lag_events[r] == max(0, n - k)


def test_a_stored_state_gives_the_compiled_merge_its_addresses_only_for_contiguous_int64_arrays_of_one_size():
    tokens = Tokens(np.arange(3, dtype=np.int64), np.ones(3, np.int64))
    assert StoredTokens(tokens, 9).entry == (tokens.items.ctypes.data, tokens.counts.ctypes.data, 3, 9)
    for items, counts in [
        (np.arange(3, dtype=np.int32), np.ones(3, np.int64)),
        (np.arange(6, dtype=np.int64)[::2], np.ones(3, np.int64)),
        (np.arange(3, dtype=np.int64), np.ones(2, np.int64)),
    ]:
        with pytest.raises(ValueError):
            _ = StoredTokens(Tokens(items, counts), 0).entry
