"""Building a user's state from their newest events: exact while the distinct items fit, else grouped.

``exact``: every distinct item is a token with its count (see :mod:`.user_tokens`); the attention
over the tokens equals the attention over the events. ``clustered``: the user has more distinct
items than the budget ``tokens``; the newest ``exact_tokens`` distinct items stay exact and the
older ones are grouped in the attention's key space: the most frequent ungrouped item leads a new
group and takes every ungrouped item within ``radius`` of it, until the budget's groups are made;
items left over join their nearest leader (they are counted, as the radius does not hold for them).
A group is one token: its leader's id with the group's total count. This is an approximation: its
error is measured (``recserve user-state`` and the tests report it), never assumed.

With attributes (the values of the sequences aligned to the items, e.g. each event's category), a
token is a distinct (item, attributes) tuple, placed in the key space by its item.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from recserve.backends.store.user_state.state import CLUSTERED, EXACT, UserState
from recserve.backends.store.user_state.tokens import Tokens, dedup

#: Item ids to their vectors in the attention's key space ``[n, d]``.
KeySpace = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Budget:
    """How many tokens a state may hold, how many of them exact, and the groups' radius."""

    tokens: int
    exact_tokens: int
    radius: float


@dataclass(frozen=True)
class Built:
    """A state and what grouping it took."""

    state: UserState
    grouped_items: int  # distinct items that went into groups (0: exact)
    over_radius: int  # of them, the ones farther than the radius from their leader


def build_state(
    items: np.ndarray,
    seq: int,
    budget: Budget,
    key_space: KeySpace,
    versions: tuple[int, int] = (0, 0),
    attributes: np.ndarray | None = None,
) -> Built:
    """The state of a user whose newest events are ``items`` (oldest first), the last one ``seq``.

    Args:
        items: the events' item ids, oldest first (the builder's window of the user's events).
        seq: the sequence number of the last event.
        budget: the token budget.
        key_space: item ids to key vectors; called only when the items do not fit.
        versions: ``(table version, dense version)`` the key space belongs to.
        attributes: int64 ``[events, k]``: each event's attributes (None: none); a token is then a
            distinct (item, attributes) tuple.
    """
    if attributes is not None and attributes.shape[1]:
        # each distinct tuple as a local id: the tokens are built over the ids, then mapped back
        tuples, local = np.unique(np.column_stack([items, attributes]), axis=0, return_inverse=True)
        built = build_state(local.reshape(-1), seq, budget, lambda ids: key_space(tuples[ids, 0]), versions)
        state, ids = built.state, built.state.tokens.items
        tokens = Tokens(tuples[ids, 0].copy(), state.tokens.counts)
        with_attributes = UserState(
            seq, state.mode, tokens, state.table_version, state.dense_version, tuples[ids, 1:].copy()
        )
        return Built(with_attributes, built.grouped_items, built.over_radius)
    tokens = dedup(items)
    if len(tokens) <= budget.tokens:
        return Built(UserState(seq, EXACT, tokens, *versions), 0, 0)
    keep = budget.exact_tokens
    older = Tokens(tokens.items[:-keep], tokens.counts[:-keep])
    newest = Tokens(tokens.items[-keep:], tokens.counts[-keep:])
    groups, over = group_tokens(older, budget.tokens - keep, budget.radius, key_space)
    merged = Tokens(
        np.concatenate([groups.items, newest.items]), np.concatenate([groups.counts, newest.counts])
    )
    return Built(UserState(seq, CLUSTERED, merged, *versions), len(older), over)


def group_tokens(tokens: Tokens, groups: int, radius: float, key_space: KeySpace) -> tuple[Tokens, int]:
    """At most ``groups`` tokens for ``tokens``: each a leader's id with its group's total count.

    Returns the groups (in the order of their leaders in ``tokens``) and how many items joined a
    leader farther than ``radius``.
    """
    vectors = np.asarray(key_space(tokens.items), np.float64)
    n = len(tokens)
    group = np.full(n, -1, np.int64)
    by_count = np.argsort(-tokens.counts, kind="stable")  # most frequent first, ties oldest first
    leaders: list[int] = []
    for candidate in by_count.tolist():
        if len(leaders) == groups:
            break
        if group[candidate] >= 0:
            continue
        free = np.flatnonzero(group < 0)
        near = np.linalg.norm(vectors[free] - vectors[candidate], axis=1) <= radius
        group[free[near]] = len(leaders)
        group[candidate] = len(leaders)
        leaders.append(candidate)
    left = np.flatnonzero(group < 0)
    if left.size:
        centres = vectors[leaders]
        distances = np.linalg.norm(vectors[left, None, :] - centres[None, :, :], axis=2)
        group[left] = np.argmin(distances, axis=1)
    totals = np.bincount(group, weights=tokens.counts, minlength=len(leaders)).astype(np.int64)
    order = np.argsort(leaders, kind="stable")
    ids = tokens.items[np.asarray(leaders, np.int64)[order]]
    return Tokens(ids, totals[order]), int(left.size)
