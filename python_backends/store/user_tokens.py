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


def merge(state: Tokens | None, state_seq: int, tail: np.ndarray, newest_seq: int) -> Merged:
    """The state's tokens with the tail's events that are newer than the state.

    A user's events carry consecutive sequence numbers; the tail (oldest first) ends at
    ``newest_seq``, so its events have ``newest_seq - len(tail) + 1 .. newest_seq``. Events at or
    below ``state_seq`` are already counted in the state (an overlap) and are skipped. When the
    tail starts after ``state_seq + 1`` the events between are in neither, and the outcome is
    ``gap``: the result is still the state plus the whole tail. Without a state (``None``) the
    result is the tail's own tokens (``miss``), what today's request with that history computes.

    With no gap the result equals :func:`dedup` of all the user's events up to ``newest_seq``.
    """
    tail = np.asarray(tail, np.int64).reshape(-1)
    if state is None:
        return Merged(dedup(tail), MISS, int(tail.size), int(tail.size))
    first_seq = newest_seq - tail.size + 1
    skip = min(max(0, state_seq - first_seq + 1), tail.size)
    newer = dedup(tail[skip:])
    outcome = GAP if tail.size and first_seq > state_seq + 1 else HIT
    lag = max(0, newest_seq - state_seq)
    if len(newer) == 0:
        return Merged(state, outcome, 0, lag)
    kept = ~np.isin(state.items, newer.items, assume_unique=True)
    counts = newer.counts.copy()
    if not kept.all():  # items seen before: their stored counts join the tail's
        moved = state.items[~kept]
        sorter = np.argsort(moved, kind="stable")
        where = np.searchsorted(moved, newer.items, sorter=sorter)
        where = sorter[np.minimum(where, moved.size - 1)]
        found = moved[where] == newer.items
        counts[found] += state.counts[~kept][where[found]]
    items = np.concatenate([state.items[kept], newer.items])
    return Merged(
        Tokens(items, np.concatenate([state.counts[kept], counts])), outcome, int(tail.size - skip), lag
    )
