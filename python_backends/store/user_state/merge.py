"""A batch's rows merged with their users' states, straight into the lookup step's history.

:func:`merge_histories` runs the store's compiled loop (``_kernels.c``) where it is built, else
:func:`merge_numpy_histories` (the rows' merge of :func:`~.user_tokens.merge_rows` in whole-array
steps, then one boolean placement); both give the same history.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from recserve.backends.store import kernels
from recserve.backends.store.user_state.tokens import GAP, MergedRows, StoredTokens, merge_rows

KERNELS = kernels.load()  # the compiled merge; None: the numpy path
_NO_STATE = (0, 0, -1, -1)  # a row's table entry without a state (see merge_histories)


@dataclass(frozen=True)
class MergedHistories:
    """A batch's history with its rows' states merged (:func:`merge_histories`)."""

    keys: np.ndarray  # int64 [rows, width]
    mask: np.ndarray  # float32 [rows, width]
    weights: np.ndarray  # float32 [rows, width]: ln count per merged token, 0 elsewhere
    lengths: np.ndarray  # int64 [rows]: each row's tokens, -1 for a row without a state
    gaps: np.ndarray  # int64 [rows]: 1 where events between the state and the tail are in neither
    lag_events: np.ndarray  # int64 [rows]: the row's newest sequence number minus its state's (-1: none)


@dataclass(frozen=True)
class Buckets:
    """Sequence buckets (ascending) as Python ints, and as the int64 array the compiled merge reads."""

    widths: tuple[int, ...]
    array: np.ndarray

    @classmethod
    def of(cls, widths: Sequence[int]) -> Buckets:
        """``widths`` sorted."""
        ordered = tuple(sorted(int(w) for w in widths))
        return cls(ordered, np.array(ordered, np.int64))

    def width(self, longest: int, at_least: int) -> int:
        """The first bucket holding ``longest`` tokens (at least 1), and at least ``at_least``.

        Raises:
            ValueError: ``longest`` is over the last bucket.
        """
        at = bisect_left(self.widths, max(longest, 1))
        if at == len(self.widths):
            raise ValueError(f"a merged history of {longest} tokens is over the largest sequence bucket")
        return max(at_least, self.widths[at])


def merge_histories(
    states: Sequence[StoredTokens | None],
    keys: np.ndarray,
    mask: np.ndarray,
    tail_lengths: Sequence[int],
    newest_seqs: Sequence[int],
    left: bool,
    pad_key: int,
    buckets: Buckets,
) -> MergedHistories:
    """Each row's state (None: none) merged with its tail, as a history.

    Row ``r``'s tail is its first ``tail_lengths[r]`` columns of ``keys`` (with ``left``, its
    last), ending at sequence number ``newest_seqs[r]``; its merged tokens are those of
    :func:`merge_rows`. They go to a history as wide as the sequence bucket of the longest merged
    row (:meth:`Buckets.width`, at least ``keys``' width): from its first
    column or, with ``left``, ending at its last, with mask 1 and ``ln count``. A row without a
    state keeps its keys and mask on the same side, weights 0; other positions hold ``pad_key``
    and mask 0.

    The store's compiled loop does it in one pass where it is built and the arrays are of its types
    (``_kernels.c``), else :func:`merge_numpy_histories`; both give the same history.
    """
    if KERNELS is None or keys.dtype != np.int64 or mask.dtype != np.float32:
        return merge_numpy_histories(states, keys, mask, tail_lengths, newest_seqs, left, pad_key, buckets)
    entries = [
        (*(state.entry if state is not None else _NO_STATE), length, newest)
        for state, length, newest in zip(states, tail_lengths, newest_seqs, strict=True)
    ]
    table = np.array(entries, np.int64).reshape(len(states), 6)
    # room for the widest state and tail; the loop writes the history at its merged rows' width
    room = buckets.width(max((entry[2] + entry[4] for entry in entries), default=0), keys.shape[1])
    out_keys, out_mask, weights, rows = KERNELS.merge_histories(
        table, np.ascontiguousarray(keys), np.ascontiguousarray(mask), left, pad_key, buckets.array, room
    )
    return MergedHistories(out_keys, out_mask, weights, rows[:, 0], rows[:, 1], rows[:, 2])


def merge_numpy_histories(
    states: Sequence[StoredTokens | None],
    keys: np.ndarray,
    mask: np.ndarray,
    tail_lengths: Sequence[int],
    newest_seqs: Sequence[int],
    left: bool,
    pad_key: int,
    buckets: Buckets,
) -> MergedHistories:
    """:func:`merge_histories` with :func:`merge_rows` and :func:`place_numpy`."""
    count, old = keys.shape
    lengths, gaps, lag = np.full(count, -1, np.int64), np.zeros(count, np.int64), np.full(count, -1, np.int64)
    merged_rows = np.array([r for r, state in enumerate(states) if state is not None], np.int64)
    merged = None
    if merged_rows.size:
        kept = [state for state in states if state is not None]
        tails = np.asarray(tail_lengths, np.int64)[merged_rows]
        merged = merge_rows(
            [state.tokens for state in kept],
            np.array([state.seq for state in kept], np.int64),
            np.arange(len(kept)),
            keys[merged_rows],
            tails,
            np.asarray(newest_seqs, np.int64)[merged_rows],
            old - tails if left else None,
        )
        lengths[merged_rows] = merged.lengths
        gaps[merged_rows] = merged.outcomes == GAP
        lag[merged_rows] = merged.lag_events
    width = buckets.width(int(lengths.max(initial=0)), old)
    out_keys = np.full((count, width), pad_key, keys.dtype)
    out_mask, weights = np.zeros((count, width), mask.dtype), np.zeros((count, width), np.float32)
    plain = lengths < 0
    columns = slice(width - old, width) if left else slice(0, old)
    out_keys[plain, columns], out_mask[plain, columns] = keys[plain], mask[plain]
    if merged is not None:
        place_numpy(merged, merged_rows, left, out_keys, out_mask, weights)
    return MergedHistories(out_keys, out_mask, weights, lengths, gaps, lag)


def place_numpy(
    merged: MergedRows, rows: np.ndarray, left: bool, keys: np.ndarray, mask: np.ndarray, weights: np.ndarray
) -> None:
    """Write each merged row's tokens into history row ``rows[r]``, in place (``[history rows, width]``).

    From the row's first column, or with ``left`` ending at its last; mask 1 and the weight
    ``ln count`` per token (``rows`` ascending: tokens fill a row-major mask).
    """
    width = keys.shape[1]
    columns = np.arange(width)
    lengths = merged.lengths[:, None]
    place = np.zeros(keys.shape, bool)
    place[rows] = columns >= width - lengths if left else columns < lengths
    keys[place] = merged.items
    mask[place] = 1.0
    weights[place] = merged.log_weights()
