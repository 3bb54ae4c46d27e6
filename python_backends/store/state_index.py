"""The lookup step's cache of user states, and its index where the compiled merge reads them.

:class:`StateIndex` follows the step's :class:`StateCache`: each cached user has a slot naming the
addresses of its state's keyed tokens (arrays the cache keeps alive), the state's size, sequence
number and mode, and until when the cache holds it fresh. A batch whose every row is then a fresh
hit leaving its tail no gap, the common case, is merged in one compiled call
(``recserve_merge_cached`` in ``_user_merge.c``): users found, table built and history written with
no Python step per row. Any other batch takes the step's other path, which checks the request,
fetches the states, and gives the same history.
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from recserve.backends.store import kernels
from recserve.backends.store.kernels import address, history_bytes, history_views

FIELDS = 8  # a slot's int64 fields (IX_FIELDS in _user_merge.c)
MICROS = 1_000_000  # the index keeps the cache's clock in microseconds
T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)
_WIRE = (np.dtype(np.int64), np.dtype(np.int64), np.dtype(np.int32))  # users, newest, lengths


class CacheMirror(Protocol[T_contra]):
    """What follows a :class:`StateCache`'s values (the compiled merge's index)."""

    def put(self, user: int, value: T_contra, expires: float) -> None:
        """``user``'s value is now ``value``, fresh until ``expires``."""

    def remove(self, user: int) -> None:
        """``user``'s value is about to leave the cache."""


class StateCache(Generic[T]):
    """Values fetched lately, per user, each fresh for ``ttl_s`` after its fetch (LRU, ``capacity``).

    ``mirror`` learns of every value put and every value evicted, before the cache lets it go. A
    value it serves is not moved to the end of the LRU order (it is looked up where the cache is not).
    """

    def __init__(
        self,
        capacity: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        mirror: CacheMirror[T] | None = None,
    ) -> None:
        self.capacity, self.ttl_s, self.clock, self.mirror = capacity, ttl_s, clock, mirror
        self._values: OrderedDict[int, tuple[float, T]] = OrderedDict()

    def peek(self, user: int) -> tuple[T | None, bool]:
        """The cached value of ``user`` even when too old (None: not cached), and whether it is fresh."""
        entry = self._values.get(user)
        if entry is None:
            return None, False
        self._values.move_to_end(user)
        return entry[1], self.clock() - entry[0] <= self.ttl_s

    def put(self, user: int, value: T) -> None:
        """Cache ``value`` (the least recently used user leaves beyond ``capacity``)."""
        if self.capacity <= 0:
            return
        now = self.clock()
        if self.mirror is not None:
            self.mirror.put(user, value, now + self.ttl_s)
        self._values[user] = (now, value)
        self._values.move_to_end(user)
        while len(self._values) > self.capacity:
            oldest = next(iter(self._values))
            if self.mirror is not None:
                self.mirror.remove(oldest)
            del self._values[oldest]


class Indexed(Protocol):
    """A cached value the index can name."""

    @property
    def index_entry(self) -> tuple[int, int, int, int, int]:
        """Its keys' and counts' addresses, its size, sequence number and mode (its index in MODES)."""
        ...


def _micros(seconds: float) -> int:
    return int(seconds * MICROS)


class StateIndex:
    """Cached users' states by user, for the compiled merge (see the module docstring).

    Args:
        library: the compiled kernels' library.
        capacity: the most users it holds at once (the cache's); it has at least twice as many slots.
    """

    def __init__(self, library: ctypes.CDLL, capacity: int) -> None:
        self.library = library
        self.slots = max(8, 1 << (2 * max(capacity, 1) - 1).bit_length())
        self.table = np.zeros((self.slots, FIELDS), np.int64)
        self._table = address(self.table)
        self._entry = np.zeros(FIELDS - 1, np.int64)

    @classmethod
    def of(cls, capacity: int) -> StateIndex | None:
        """An index for a cache of ``capacity`` users; None without the compiled kernels or a cache."""
        compiled = kernels.load()
        return None if compiled is None or capacity <= 0 else cls(compiled.library, capacity)

    def __len__(self) -> int:
        return int(np.count_nonzero(self.table[:, 0]))

    def put(self, user: int, value: Indexed, expires: float) -> None:
        """Name ``value`` as ``user``'s state, fresh until ``expires`` (the cache's clock).

        Raises:
            RuntimeError: no free slot (the cache holds more users than the index was made for).
        """
        self._entry[:] = (user, *value.index_entry, _micros(expires))
        if self.library.recserve_index_put(self._table, self.slots, address(self._entry)) < 0:
            raise RuntimeError(f"the state index of {self.slots} slots is full")

    def remove(self, user: int) -> None:
        """Forget ``user`` (before the cache lets its state go)."""
        self.library.recserve_index_remove(self._table, self.slots, user)

    def merge(
        self,
        wire: tuple[Any, Any, Any],
        tail_limit: int,
        now: float,
        keys: np.ndarray,
        mask: np.ndarray,
        left: bool,
        pad_key: int,
        buckets: np.ndarray,
        max_width: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The history of :func:`~.history_merge.merge_histories` when every row is a fresh hit.

        A few attribute reads and one compiled call: on a request path whose code and data are
        cold between requests, each numpy call saved counts.

        Args:
            wire: each row's user and newest sequence number (int64) and tail length (int32),
                ``[rows, 1]`` each, as the request sent them.
            tail_limit: the most events a tail may have.
            now: the cache's clock.
            keys: the tails' keys, ``[rows, width]`` int64.
            mask: their mask, float32 of the same shape.
            left: the history is padded on the left.
            pad_key: the key of a padding position.
            buckets: the sequence buckets, int64 ascending.
            max_width: room for the widest state and tail (at least ``keys``' width).

        Returns:
            The history's keys, mask and log-weights, and per row its state's sequence number,
            mode and lag (int64 ``[rows, 3]``); or None when a row is not served so (an input
            missing or not of its type and shape, an invalid tail, a user not cached or not
            fresh, a state leaving a gap): the caller's other path then answers, naming what is
            wrong.

        Raises:
            ValueError: a state and tail wider than ``max_width``.
        """
        rows, width = keys.shape
        for array, dtype in zip(wire, _WIRE, strict=True):
            if not (
                isinstance(array, np.ndarray)
                and array.dtype == dtype
                and array.shape == (rows, 1)
                and array.flags.c_contiguous
            ):
                return None
        if mask.shape != keys.shape or max_width < width:
            raise ValueError(f"a mask {mask.shape} or room {max_width} for a history {keys.shape}")
        keys, mask = kernels.contiguous(keys, np.int64), kernels.contiguous(mask, np.float32)
        room = history_bytes(rows, max_width)
        out = np.empty(room + 24 * rows, np.uint8)  # the history, then each row's state fields
        at = address(out)
        history = self.library.recserve_merge_cached(
            self._table,
            self.slots,
            *(address(array) for array in wire),
            rows,
            tail_limit,
            _micros(now),
            address(keys),
            address(mask),
            width,
            int(left),
            pad_key,
            address(buckets),
            buckets.size,
            max_width,
            at,
            at + room,
        )
        if history == 0:
            return None
        if history < 0:
            raise ValueError(f"a row's state and tail wider than {max_width} columns")
        merged_keys, merged_mask, weights, _ = history_views(out, rows, history)
        return merged_keys, merged_mask, weights, np.ndarray((rows, 3), np.int64, out, room)
