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

import numpy as np

#: How a request's real-time tail met the user's stored state (the ``outcome`` of the merge).
HIT, GAP, MISS = "hit", "gap", "miss"


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
) -> MergedRows:
    """:func:`merge` of every row of a batch in a constant number of array operations.

    Args:
        states: the distinct states (a user's state once, however many rows it has).
        state_seqs: each state's sequence number.
        which: per row, the index of its state in ``states``.
        tails: int64 [rows, width]: each row's tail (oldest first) in its first ``tail_lengths[r]``
            columns.
        tail_lengths: per row, its tail's length.
        newest_seqs: per row, the sequence number of its tail's newest event.

    A row's state tokens keep their order, numbered 0..n-1, and its tail's newer events follow,
    numbered from n on; grouping a row's (item, number) pairs by item sums the counts and keeps the
    highest number, and sorting each row's groups by it orders them by last occurrence. That is
    :func:`merge` row by row, without a Python step per row or per element.
    """
    which = np.asarray(which, np.int64)
    rows = which.size
    sizes = np.array([len(s) for s in states], np.int64)
    offsets = np.cumsum(sizes) - sizes
    seqs = np.asarray(state_seqs, np.int64)[which]
    tail_lengths = np.asarray(tail_lengths, np.int64)
    newest_seqs = np.asarray(newest_seqs, np.int64)
    first = newest_seqs - tail_lengths + 1
    skip = np.clip(seqs - first + 1, 0, tail_lengths)
    # the states' tokens, gathered per row: (row, item, count, number)
    state_len = sizes[which]
    state_row = np.repeat(np.arange(rows), state_len)
    number = np.arange(state_row.size) - np.repeat(np.cumsum(state_len) - state_len, state_len)
    gather = np.repeat(offsets[which], state_len) + number
    all_items = np.concatenate([s.items for s in states]) if states else np.zeros(0, np.int64)
    all_counts = np.concatenate([s.counts for s in states]) if states else np.zeros(0, np.int64)
    # the tails' newer events: columns skip .. length-1
    columns = np.arange(tails.shape[1])
    tail_row, tail_col = np.nonzero((columns >= skip[:, None]) & (columns < tail_lengths[:, None]))
    row = np.concatenate([state_row, tail_row])
    item = np.concatenate([all_items[gather], tails[tail_row, tail_col].astype(np.int64)])
    count = np.concatenate([all_counts[gather], np.ones(tail_row.size, np.int64)])
    number = np.concatenate([number, state_len[tail_row] + tail_col])
    if row.size:
        order = np.lexsort((item, row))
        row, item, count, number = row[order], item[order], count[order], number[order]
        starts = np.flatnonzero(np.r_[True, (row[1:] != row[:-1]) | (item[1:] != item[:-1])])
        row, item = row[starts], item[starts]
        count = np.add.reduceat(count, starts)
        last = np.maximum.reduceat(number, starts)
        order = np.argsort(row * (int(last.max()) + 1) + last)  # by row, then last occurrence (distinct)
        row, item, count = row[order], item[order], count[order]
    gap = (tail_lengths > 0) & (first > seqs + 1)
    return MergedRows(
        lengths=np.bincount(row, minlength=rows).astype(np.int64),
        items=item,
        counts=count,
        outcomes=np.where(gap, GAP, HIT).astype(object),
        merged_events=tail_lengths - skip,
        lag_events=np.maximum(0, newest_seqs - seqs),
    )


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
