"""A user's behaviour events as attention tokens: distinct items with counts, and the online merge.

The built-in target attention has no position or time encoding: a history item's key and value
depend on the item's embedding alone. So ``c`` identical items give the same softmax terms as one
token whose logit is raised by ``ln c``, and a user's events reduce *exactly* to their distinct
items with counts. Counts (not their logarithms) are kept, so merging newer events into a stored
state is integer arithmetic and stays exact; the dense step gets ``ln count`` per token.

Tokens are ordered by each item's last occurrence, oldest first: the newest distinct items are the
last ones, which is what the clustered mode keeps exactly (see :mod:`.user_state_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

#: How a request's real-time tail met the user's stored state (the ``outcome`` of the merge).
HIT, GAP, MISS = "hit", "gap", "miss"
_HIT_OR_GAP = np.array([HIT, GAP], object)


@dataclass(frozen=True)
class Tokens:
    """Distinct items and their counts, ordered by last occurrence (oldest first)."""

    items: np.ndarray  # int64 [n], distinct
    counts: np.ndarray  # int64 [n], each >= 1

    @classmethod
    def empty(cls) -> Tokens:
        """No tokens."""
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return int(self.items.size)

    @property
    def events(self) -> int:
        """How many events the tokens stand for (the sum of the counts)."""
        return int(self.counts.sum())

    def log_weights(self) -> np.ndarray:
        """``ln count`` per token (float32): what the attention adds to each token's logit."""
        return np.log(self.counts.astype(np.float64)).astype(np.float32)

    def equals(self, other: Tokens) -> bool:
        """Same items with the same counts in the same order."""
        return np.array_equal(self.items, other.items) and np.array_equal(self.counts, other.counts)


@dataclass(frozen=True)
class StoredTokens:
    """A stored state's tokens and sequence number, as the online merge reads them."""

    tokens: Tokens
    seq: int

    @cached_property
    def entry(self) -> tuple[int, int, int, int]:
        """The compiled merge's fields of a row with this state, taken once.

        The addresses of the items and counts, their number, the sequence number.

        Raises:
            ValueError: items and counts not contiguous int64 arrays of one size.
        """
        items, counts = self.tokens.items, self.tokens.counts
        for array in (items, counts):
            if array.dtype != np.int64 or not array.flags.c_contiguous:
                raise ValueError(f"tokens need contiguous int64 arrays, got {array.dtype}")
        if items.shape != counts.shape:
            raise ValueError(f"{items.size} items with {counts.size} counts")
        return items.ctypes.data, counts.ctypes.data, items.size, self.seq


def dedup(items: np.ndarray) -> Tokens:
    """The tokens of events ``items`` (oldest first): each distinct item once, with its count.

    Ordered by each item's last occurrence, oldest first.
    """
    items = np.asarray(items, np.int64).reshape(-1)
    if items.size == 0:
        return Tokens.empty()
    backwards = items[::-1]
    distinct, first_back, counts = np.unique(backwards, return_index=True, return_counts=True)
    last = items.size - 1 - first_back  # each item's last position, forwards
    order = np.argsort(last, kind="stable")
    return Tokens(distinct[order], counts[order].astype(np.int64))


@dataclass(frozen=True)
class Merged:
    """The tokens a request is served with, and how its tail met the state."""

    tokens: Tokens
    outcome: str  # HIT, GAP (events between the state and the tail are missing) or MISS (no state)
    merged_events: int  # tail events newer than the state, added to its tokens
    lag_events: int  # events the state lacked that the request knows of (its newest seq - state's)


def tail_sequence(tail_length: int, newest_seq: int) -> np.ndarray:
    """The sequence numbers of a tail of ``tail_length`` consecutive events ending at ``newest_seq``."""
    return np.arange(newest_seq - tail_length + 1, newest_seq + 1, dtype=np.int64)


@dataclass(frozen=True)
class MergedRows:
    """:func:`merge` of many rows: their tokens (concatenated, row after row) and how each met its state."""

    lengths: np.ndarray  # int64 [rows]: each row's number of tokens
    items: np.ndarray  # int64 [sum(lengths)]: the rows' tokens, row after row
    counts: np.ndarray  # int64 [sum(lengths)]
    outcomes: np.ndarray  # str [rows]: HIT or GAP
    merged_events: np.ndarray  # int64 [rows]
    lag_events: np.ndarray  # int64 [rows]

    def row(self, r: int) -> Tokens:
        """Row ``r``'s tokens."""
        start = int(self.lengths[:r].sum())
        span = slice(start, start + int(self.lengths[r]))
        return Tokens(self.items[span], self.counts[span])

    def log_weights(self) -> np.ndarray:
        """``ln count`` per token (float32), row after row, as :meth:`Tokens.log_weights`."""
        return Tokens(self.items, self.counts).log_weights()


def merge_rows(
    states: list[Tokens],
    state_seqs: np.ndarray,
    which: np.ndarray,
    tails: np.ndarray,
    tail_lengths: np.ndarray,
    newest_seqs: np.ndarray,
    tail_starts: np.ndarray | None = None,
) -> MergedRows:
    """:func:`merge` of every row of a batch at once, with no Python step per row or per element.

    The merge only compares ids: it gives the same tokens for items as for their keys (a key is a
    one-to-one function of its item), so the lookup step merges keys and hashes nothing.

    Args:
        states: the distinct states (a user's state once, however many rows it has).
        state_seqs: each state's sequence number.
        which: per row, the index of its state in ``states``.
        tails: int64 [rows, width]: each row's tail (oldest first), ``tail_lengths[r]`` columns from
            column ``tail_starts[r]`` (0 by default).
        tail_lengths: per row, its tail's length.
        newest_seqs: per row, the sequence number of its tail's newest event.
        tail_starts: per row, the column where its tail begins (a history padded on the left).

    The lookup step merges straight into its history with
    :func:`~recserve.backends.store.user_state.merge.merge_histories`.
    """
    which = np.asarray(which, np.int64)
    seqs = np.asarray(state_seqs, np.int64)[which]
    tail_lengths = np.asarray(tail_lengths, np.int64)
    newest_seqs = np.asarray(newest_seqs, np.int64)
    starts = np.zeros_like(tail_lengths) if tail_starts is None else np.asarray(tail_starts, np.int64)
    first = newest_seqs - tail_lengths + 1
    skip = np.clip(seqs - first + 1, 0, tail_lengths)  # the tail's events the state already holds
    sizes = np.array([len(s) for s in states], np.int64)
    empty = np.zeros(0, np.int64)
    arguments = (
        np.concatenate([s.items for s in states]) if states else empty,
        np.concatenate([s.counts for s in states]) if states else empty,
        (np.cumsum(sizes) - sizes)[which],
        sizes[which],
        np.ascontiguousarray(tails, np.int64),
        starts + skip,
        starts + tail_lengths,
    )
    merged = merge_numpy(*arguments)
    gap = (tail_lengths > 0) & (first - 1 > seqs)
    return MergedRows(
        lengths=merged[2],
        items=merged[0],
        counts=merged[1],
        outcomes=_HIT_OR_GAP[gap.astype(np.intp)],
        merged_events=tail_lengths - skip,
        lag_events=np.maximum(0, newest_seqs - seqs),
    )


def merge_numpy(
    state_items: np.ndarray,
    state_counts: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    tails: np.ndarray,
    first: np.ndarray,
    ends: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows' merge in whole-array steps.

    Row ``r``'s state is ``state_items/state_counts[starts[r]:starts[r] + sizes[r]]``, its newer
    events ``tails[r, first[r]:ends[r]]``. Only the newer events are sorted (a few per row): they
    are grouped per row and item, and the state tokens they name again are found by a search among
    the groups. A row's result is its other state tokens in their stored order, then its groups by
    last occurrence, each group's count raised by its stored count.
    """
    rows, width = tails.shape
    columns = np.arange(width)
    row, column = np.nonzero((columns >= first[:, None]) & (columns < ends[:, None]))
    item = tails[row, column]
    order = np.lexsort((item, row))
    row, item, column = row[order], item[order], column[order]
    starts_of = np.flatnonzero(np.r_[True, (row[1:] != row[:-1]) | (item[1:] != item[:-1])])
    starts_of = starts_of if row.size else row
    new_row, new_item = row[starts_of], item[starts_of]
    new_count = np.diff(np.r_[starts_of, row.size]).astype(np.int64)
    new_last = np.maximum.reduceat(column, starts_of) if starts_of.size else starts_of
    state_row = np.repeat(np.arange(rows), sizes)
    gather = np.arange(state_row.size) + np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
    state_item, state_count = state_items[gather], state_counts[gather]
    found = np.zeros(state_row.size, bool)
    if new_row.size:
        vocab = np.unique(new_item)
        code = np.minimum(np.searchsorted(vocab, state_item), vocab.size - 1)
        group_keys = new_row * vocab.size + np.searchsorted(vocab, new_item)  # ascending
        state_keys = state_row * vocab.size + code
        at = np.minimum(np.searchsorted(group_keys, state_keys), group_keys.size - 1)
        found = (vocab[code] == state_item) & (group_keys[at] == state_keys)
        np.add.at(new_count, at[found], state_count[found])
    kept = np.flatnonzero(~found)
    by_last = np.argsort(new_row * (width + 1) + new_last)
    new_row, new_item, new_count = new_row[by_last], new_item[by_last], new_count[by_last]
    kept_len = np.bincount(state_row[kept], minlength=rows)
    new_len = np.bincount(new_row, minlength=rows)
    lengths = kept_len + new_len
    items, counts = np.empty(lengths.sum(), np.int64), np.empty(lengths.sum(), np.int64)
    to_kept = np.repeat(np.cumsum(lengths) - lengths, kept_len) + _ranks(kept_len)
    to_new = np.repeat(np.cumsum(lengths) - lengths + kept_len, new_len) + _ranks(new_len)
    items[to_kept], counts[to_kept] = state_item[kept], state_count[kept]
    items[to_new], counts[to_new] = new_item, new_count
    return items, counts, lengths.astype(np.int64)


def _ranks(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 within each of consecutive runs of ``lengths``."""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def merge(state: Tokens | None, state_seq: int, tail: np.ndarray, newest_seq: int) -> Merged:
    """The state's tokens with the tail's events that are newer than the state.

    A user's events carry consecutive sequence numbers; the tail (oldest first) ends at
    ``newest_seq``, so its events have ``newest_seq - len(tail) + 1 .. newest_seq``. Events at or
    below ``state_seq`` are already counted in the state (an overlap) and are skipped. When the
    tail starts after ``state_seq + 1`` the events between are in neither, and the outcome is
    ``gap``: the result is still the state plus the whole tail. Without a state (``None``) the
    result is the tail's own tokens (``miss``), what today's request with that history computes.

    With no gap the result equals :func:`dedup` of all the user's events up to ``newest_seq``.
    One row of :func:`merge_rows`.
    """
    tail = np.asarray(tail, np.int64).reshape(-1)
    if state is None:
        return Merged(dedup(tail), MISS, int(tail.size), int(tail.size))
    rows = merge_rows(
        [state],
        np.array([state_seq]),
        np.zeros(1),
        tail[None, :],
        np.array([tail.size]),
        np.array([newest_seq]),
    )
    return Merged(rows.row(0), str(rows.outcomes[0]), int(rows.merged_events[0]), int(rows.lag_events[0]))
