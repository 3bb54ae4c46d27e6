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
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from recserve.backends.store import kernels
from recserve.backends.store.kernels import address, history_bytes, history_views

LOGGER = logging.getLogger(__name__)

FIELDS = 9  # a slot's int64 fields (IX_FIELDS in _user_merge.c)
MICROS = 1_000_000  # the index keeps the cache's clock in microseconds
T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)
_WIRE = (np.dtype(np.int64), np.dtype(np.int64), np.dtype(np.int32))  # users, newest, lengths


class CacheMirror(Protocol[T_contra]):
    """What follows a :class:`StateCache`'s values (the compiled merge's index)."""

    def put(self, user: int, value: T_contra, fresh_until: float, expires: float) -> None:
        """``user``'s value is now ``value``: fresh until ``fresh_until``, served stale until ``expires``."""

    def remove(self, user: int) -> None:
        """``user``'s value is about to leave the cache."""


#: How old a cached value is: within its time to live; past it but served while it is read again
#: off the request path (up to twice the time to live); older (read again on the request path).
FRESH, REFRESH, EXPIRED = "fresh", "refresh", "expired"


class StateCache(Generic[T]):
    """Values fetched lately, per user, each fresh for ``ttl_s`` after its fetch (LRU, ``capacity``).

    Past ``ttl_s`` a value is :data:`REFRESH` until twice that age, then :data:`EXPIRED`. ``mirror``
    learns of every value put and every value evicted or removed, before the cache lets it go. A
    value it serves is not moved to the end of the LRU order (it is looked up where the cache is
    not). Safe to use from several threads.
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
        self._lock = threading.Lock()

    def peek(self, user: int) -> tuple[T | None, str]:
        """The cached value of ``user`` however old (None: not cached), and how old it is."""
        with self._lock:
            entry = self._values.get(user)
            if entry is None:
                return None, EXPIRED
            self._values.move_to_end(user)
        age = self.clock() - entry[0]
        return entry[1], FRESH if age <= self.ttl_s else REFRESH if age <= 2 * self.ttl_s else EXPIRED

    def put(self, user: int, value: T) -> None:
        """Cache ``value`` (the least recently used user leaves beyond ``capacity``)."""
        if self.capacity <= 0:
            return
        with self._lock:
            now = self.clock()
            if self.mirror is not None:
                self.mirror.put(user, value, now + self.ttl_s, now + 2 * self.ttl_s)
            self._values[user] = (now, value)
            self._values.move_to_end(user)
            while len(self._values) > self.capacity:
                self._drop(next(iter(self._values)))

    def remove(self, user: int) -> None:
        """Forget ``user``'s value, if cached."""
        with self._lock:
            if user in self._values:
                self._drop(user)

    def _drop(self, user: int) -> None:
        if self.mirror is not None:
            self.mirror.remove(user)
        del self._values[user]


class Refresher:
    """Users whose cached states are served past their time to live, read again on a thread of their own.

    ``refresh(users)`` reads them and updates the cache; a failure is logged and leaves them stale
    (the request path reads them itself once they expire). The thread reads in the step's quiet
    moments: once no request has been in the step (:meth:`serving`) for ``quiet_s``, or after
    ``patience_s`` without one. A read in the middle of a request would take the interpreter from
    it: that request, the one that found its states past their time to live, would pay for it.
    """

    def __init__(
        self,
        refresh: Callable[[list[int]], None],
        batch: int = 512,
        quiet_s: float = 0.001,
        patience_s: float = 0.05,
    ) -> None:
        self.refresh, self.batch = refresh, batch
        self.quiet_s, self.patience_s = quiet_s, patience_s
        self.queued = self.refreshed = self.failed = 0  # users handed over, read again, failed
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._serving, self._left = 0, 0.0  # requests in the step; when the last one left it
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="recserve-state-refresh", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A request is in the step."""
        return self._serving > 0

    @contextmanager
    def serving(self) -> Iterator[None]:
        """A request in the step: the thread waits until it and the next ``quiet_s`` are over."""
        with self._lock:
            self._serving += 1
        try:
            yield
        finally:
            with self._lock:
                self._serving -= 1
                self._left = time.monotonic()

    def add(self, users: list[int]) -> None:
        """Queue ``users`` (a set update under a lock; the thread is woken)."""
        with self._lock:
            self._pending.update(users)
            self.queued += len(users)
        self._wake.set()

    def run_once(self) -> int:
        """Refresh up to ``batch`` queued users now; how many."""
        with self._lock:
            users = [self._pending.pop() for _ in range(min(self.batch, len(self._pending)))]
        if not users:
            return 0
        try:
            self.refresh(users)
            self.refreshed += len(users)
        except Exception as exc:  # the store's failure must not stop the thread
            self.failed += len(users)
            LOGGER.warning("refreshing %d cached user states failed: %s", len(users), type(exc).__name__)
        return len(users)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            while self._pending and self._await_quiet() and self.run_once():
                pass  # waits for a quiet moment only while users are queued

    def _await_quiet(self) -> bool:
        """Wait for the step's quiet moment (at most ``patience_s``); False once stopped."""
        give_up = time.monotonic() + self.patience_s
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                quiet = self._serving == 0 and now - self._left >= self.quiet_s
            if quiet or now >= give_up:
                return True
            time.sleep(self.quiet_s)
        return False

    def close(self) -> None:
        """Stop the thread (what is queued is left)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)


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

    def put(self, user: int, value: Indexed, fresh_until: float, expires: float) -> None:
        """Name ``value`` as ``user``'s state: fresh until ``fresh_until``, stale until ``expires``.

        Both on the cache's clock.

        Raises:
            RuntimeError: no free slot (the cache holds more users than the index was made for).
        """
        self._entry[:] = (user, *value.index_entry, _micros(fresh_until), _micros(expires))
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
        stale_ok: bool,
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
            stale_ok: serve a state past its freshness until it expires (it is being read again).
            keys: the tails' keys, ``[rows, width]`` int64.
            mask: their mask, float32 of the same shape.
            left: the history is padded on the left.
            pad_key: the key of a padding position.
            buckets: the sequence buckets, int64 ascending.
            max_width: room for the widest state and tail (at least ``keys``' width).

        Returns:
            The history's keys, mask and log-weights, and per row its state's sequence number,
            mode, lag and 1 where it was served past its freshness (int64 ``[rows, 4]``); or
            None when a row is not served so (an input missing or not of its type and shape, an
            invalid tail, a user not cached or not servable, a state leaving a gap): the
            caller's other path then answers, naming what is wrong.

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
        out = np.empty(room + 32 * rows, np.uint8)  # the history, then each row's state fields
        at = address(out)
        history = self.library.recserve_merge_cached(
            self._table,
            self.slots,
            *(address(array) for array in wire),
            rows,
            tail_limit,
            _micros(now),
            int(stale_ok),
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
        return merged_keys, merged_mask, weights, np.ndarray((rows, 4), np.int64, out, room)
