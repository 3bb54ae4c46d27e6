"""The history columns of the ``features`` records: each history once per request, on its first row.

Within a request, a history is written once, on the first row that has it (an owner's rows are
consecutive, so a list's user's is on its first candidate); every other row names that row
(``history_row``). Each owner's history is kept as its valid keys in order, sequence after sequence,
with each sequence's count of them (``history_lengths``), so requests of different history widths
need no padding. Two owners of a request share a row only when their histories are equal.

:func:`history_columns` runs the compiled loop (``_histories.c``, the optional extension
``recserve.backends.request_log._histories``, loaded with ctypes and run without the interpreter
lock, so that the step's request threads never wait on the writer's build) where it was built, else
:func:`numpy_history_columns`; both give the same columns.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa

from recserve.backends.base.compiled import compiled_library

_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_ARGUMENTS: list[Any] = [_POINTER, _POINTER, _SIZE, _SIZE, _POINTER, _POINTER, _SIZE] + [_POINTER] * 6
Columns = tuple[np.ndarray, pa.Array, pa.Array]


@lru_cache(maxsize=1)
def _loop() -> Any:
    """``recserve_history_columns``, or None where the extension was not built."""
    library = compiled_library(__package__, "_histories", keep_gil=False)  # lets go of the interpreter lock
    if library is None:
        return None
    function = library.recserve_history_columns
    function.argtypes, function.restype = _ARGUMENTS, _SIZE
    return function


def history_columns(keys: Sequence[np.ndarray], splits: Sequence[np.ndarray], counts: np.ndarray) -> Columns:
    """``history_row``, ``history`` and ``history_lengths`` of requests of ``counts`` rows each.

    ``keys``: each request's owners' valid history keys, owner after owner; ``splits``: each
    request's ``[owners, sequences]`` lengths of them.
    """
    owners = np.array([s.shape[0] for s in splits], np.int64)
    split = np.ascontiguousarray(np.concatenate(splits), dtype=np.int32)
    values = np.ascontiguousarray(np.concatenate(keys), dtype=np.int64)
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    if split.ndim != 2 or split.min(initial=0) < 0 or int(split.sum()) != values.shape[0]:
        raise ValueError(f"history lengths {split.shape} do not split the {values.shape[0]} history keys")
    if np.any((owners == 0) & (counts > 0)):
        raise ValueError("a request with rows has no history owner")
    loop = _loop()
    if loop is None:
        return numpy_history_columns(values, split, counts, owners)
    rows, sequences = int(counts.sum()), split.shape[1]
    history_row, absent = np.empty(rows, np.int32), np.empty(rows, np.bool_)
    offsets, split_offsets = np.empty(rows + 1, np.int32), np.empty(rows + 1, np.int32)
    kept_values, kept_split = np.empty(values.shape[0], np.int64), np.empty(split.size, np.int32)
    kept = loop(
        values.ctypes.data,
        split.ctypes.data,
        split.shape[0],
        sequences,
        counts.ctypes.data,
        owners.ctypes.data,
        counts.shape[0],
        *(a.ctypes.data for a in (history_row, offsets, absent, kept_values, split_offsets, kept_split)),
    )
    if kept < 0:
        raise MemoryError("the history columns' scratch memory could not be allocated")
    mask = pa.array(absent)
    carrying = int(split_offsets[-1])
    return (
        history_row,
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(kept_values[:kept]), mask=mask),
        pa.ListArray.from_arrays(pa.array(split_offsets), pa.array(kept_split[:carrying]), mask=mask),
    )


def numpy_history_columns(
    values: np.ndarray, split: np.ndarray, counts: np.ndarray, owners: np.ndarray
) -> Columns:
    """:func:`history_columns` in whole-array passes (the requests' arrays concatenated)."""
    lengths = split.sum(axis=1, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    row_start, owner_start = np.cumsum(counts) - counts, np.cumsum(owners) - owners
    rows = int(counts.sum())
    row_in_request = np.arange(rows) - np.repeat(row_start, counts)
    owner_of_row = row_in_request * np.repeat(owners, counts) // np.repeat(counts, counts)
    owner_of_row += np.repeat(owner_start, counts)
    first_row = np.searchsorted(owner_of_row, np.arange(lengths.shape[0]))
    request = np.repeat(np.arange(counts.shape[0]), owners)
    first = first_row[_first_equal(values, starts, split, request)][owner_of_row]
    carriers = first == np.arange(rows)  # the rows that carry a history
    carrying = owner_of_row[carriers]  # their owners, in order
    offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(np.where(carriers, lengths[owner_of_row], 0), out=offsets[1:])
    if carrying.shape[0] < lengths.shape[0]:  # some owners' histories are written by others
        values = values[_segments(starts[carrying], lengths[carrying])]
    absent = pa.array(~carriers)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), mask=absent)
    sequences = split.shape[1]
    split_offsets = pa.array(np.cumsum(np.r_[0, carriers]).astype(np.int32) * sequences)
    split_column = pa.ListArray.from_arrays(split_offsets, pa.array(split[carrying].reshape(-1)), mask=absent)
    return (first - np.repeat(row_start, counts)).astype(np.int32), column, split_column


def _segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices of the segments ``[start, start + length)``, one after the other."""
    return np.arange(int(lengths.sum())) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)


def _first_equal(
    values: np.ndarray, starts: np.ndarray, split: np.ndarray, request: np.ndarray
) -> np.ndarray:
    """For each owner, the first owner of its request with the same history (itself when none).

    An owner's history is ``values[start:start + length]``, ``split`` ``[owners, sequences]`` its
    sequences' lengths (``length`` their sum). Owners are grouped by a cheap digest (the request,
    the lengths and a sum of the spread keys) and each is checked against its group's first, so
    two different histories are never merged.
    """
    lengths = split.sum(axis=1, dtype=np.int64)
    spread = values.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    sums = np.zeros(values.shape[0] + 1, np.uint64)
    np.cumsum(spread, out=sums[1:])
    digest = sums[starts + lengths] - sums[starts]
    shape = split.astype(np.uint64) * (
        np.arange(split.shape[1], dtype=np.uint64) * np.uint64(2) + np.uint64(3)
    )
    digest ^= (shape.sum(axis=1, dtype=np.uint64) << np.uint64(40)) ^ request.astype(np.uint64)
    _, first, which = np.unique(digest, return_index=True, return_inverse=True)
    found = first[which.reshape(-1)]
    claimed = np.flatnonzero(found != np.arange(found.shape[0]))
    if claimed.size:
        other = found[claimed]
        same = (request[claimed] == request[other]) & (split[claimed] == split[other]).all(axis=1)
        checked, length = np.flatnonzero(same), lengths[claimed[same]]
        differs = values[_segments(starts[claimed[checked]], length)]
        differs = differs != values[_segments(starts[other[checked]], length)]
        owner = np.repeat(np.arange(checked.shape[0]), length)
        same[checked[np.bincount(owner[differs], minlength=checked.shape[0]) > 0]] = False
        found[claimed[~same]] = claimed[~same]
    return found
