"""Users' states with their tokens as keys: what the lookup step merges, read once per state.

A state's items are hashed to keys when it is read, so no request hashes them again. With sequences
aligned to the items (each behaviour's category, say), a token is an (item, attributes) tuple: the
merge runs on one combined key per token (:func:`~recserve.backends.features.hashing.combined_keys`)
and :func:`aligned_keys` puts each sequence's keys back afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import cast

import numpy as np

from recserve.backends.features.hashing import combined_keys, keys_for
from recserve.backends.store.user_state.state import MODES, UserState
from recserve.backends.store.user_state.tokens import StoredTokens, Tokens


@dataclass(frozen=True)
class KeyedState:
    """A user's state and its tokens by key (the items hashed once, when the state is read)."""

    state: UserState
    keyed: StoredTokens  # what merge_histories reads
    mode: int  # the state's mode, its index in MODES
    #: int64 [n, S]: with aligned sequences, each token's key per sequence (``keyed`` holds their
    #: combined key); None with one sequence
    aligned: np.ndarray | None = None

    @property
    def index_entry(self) -> tuple[int, int, int, int, int]:
        """What :class:`StateIndex` names: the keys' and counts' addresses, size, sequence number, mode."""
        return (*self.keyed.entry, self.mode)

    @classmethod
    def many(cls, states: list[UserState], salts: list[np.uint64]) -> list[KeyedState]:
        """Each of ``states`` with its tokens hashed to keys, in one call per sequence.

        ``salts``: the sequences' tables' (the items', then the aligned attributes' in their order).
        """
        sizes = [len(state.tokens) for state in states]
        ends = list(accumulate(sizes))
        items = np.concatenate([state.tokens.items for state in states]).astype(np.uint64)
        aligned = None
        if len(salts) == 1:
            keys = keys_for(items, salts[0])
        else:
            attributes = np.concatenate([state.attribute_array for state in states]).astype(np.uint64)
            columns = [keys_for(items, salts[0])]
            columns += [keys_for(attributes[:, a], salt) for a, salt in enumerate(salts[1:])]
            keys, aligned = combined_keys(columns), np.stack(columns, axis=1)
        return [
            cls(
                state,
                StoredTokens(
                    Tokens(keys[end - size : end], np.ascontiguousarray(state.tokens.counts, np.int64)),
                    state.seq,
                ),
                MODES.index(state.mode),
                None if aligned is None else aligned[end - size : end],
            )
            for state, size, end in zip(states, sizes, ends, strict=True)
        ]


def aligned_keys(
    merged: np.ndarray,
    merged_mask: np.ndarray,
    states: list[KeyedState],
    tails: np.ndarray,
    tail_mask: np.ndarray,
    columns: list[np.ndarray],
    pad_keys: list[int],
) -> np.ndarray:
    """Each sequence's keys ``[rows, S * width]`` at a merged history's combined keys.

    A merged token came from one of ``states`` (its keys per sequence are the state's) or from a
    row's tail (``columns``: each sequence's keys as the transform made them, ``tails`` their combined
    keys, ``tail_mask`` the tails' positions); padding takes each sequence's key of ``pad_keys``.
    """
    real = tail_mask > 0
    known = np.concatenate([*(k.keyed.tokens.items for k in states), tails[real]])
    per_sequence = np.concatenate(
        [*(cast("np.ndarray", k.aligned) for k in states), np.stack([c[real] for c in columns], axis=1)]
    )
    order = np.argsort(known, kind="stable")
    placed = merged_mask > 0
    source = order[np.searchsorted(known[order], merged[placed])]
    out = []
    for s, pad in enumerate(pad_keys):
        keys = np.full(merged.shape, pad, np.int64)
        keys[placed] = per_sequence[source, s]
        out.append(keys)
    return np.concatenate(out, axis=1)
