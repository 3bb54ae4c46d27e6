"""The store's compiled probe-and-gather loops (``_kernels.c``) and user-state merge (``_user_merge.c``).

Called through ctypes. ``pip install`` compiles both files into the optional extension
``recserve.backends.store._kernels`` (plain C, no Python API: it is loaded as a shared library,
not imported). Where it could not be built (no C compiler), :func:`load` returns ``None`` and the
store keeps its numpy path, which gives the same results bit for bit, only slower.
``RECSERVE_STORE_KERNELS=numpy`` forces the numpy path.

The addresses of arrays that live as long as a table version (index, vectors, cache) are resolved
once, when a probe is bound; a call only converts the per-batch buffers.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, cast

import numpy as np

from recserve.backends.base.compiled import compiled_library

if TYPE_CHECKING:
    from typing_extensions import Buffer

LOGGER = logging.getLogger(__name__)

_POINTER, _SIZE, _SMALL = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int8
_SIGNATURES = {
    # keys, n, slot_keys, slots, vectors, dim, out, tiers, tier, misses
    "recserve_cache_take": [
        _POINTER,
        _SIZE,
        _POINTER,
        _SIZE,
        _POINTER,
        _SIZE,
        _POINTER,
        _POINTER,
        _SMALL,
        _POINTER,
    ],
    # keys, positions, n, buckets, shift, overflow_keys, overflow_rows, overflow, vectors, dim, half,
    # out, tiers, tier, misses
    "recserve_index_take": [
        _POINTER,
        _POINTER,
        _SIZE,
        _POINTER,
        _SIZE,
        _POINTER,
        _POINTER,
        _SIZE,
        _POINTER,
        _SIZE,
        ctypes.c_int32,
        _POINTER,
        _POINTER,
        _SMALL,
        _POINTER,
    ],
    # table_ids, tiers, n, tier_count, counts
    "recserve_count": [_POINTER, _POINTER, _SIZE, _SIZE, _POINTER],
    # positions, n, size, table_ids, rows, tables, dim, out, tiers, tier
    "recserve_fill_rows": [_POINTER, *[_SIZE] * 2, *[_POINTER] * 2, *[_SIZE] * 2, *[_POINTER] * 2, _SMALL],
    # table, rows, keys, mask, width, left, pad_key, widths, width_count, max_width, out
    "recserve_merge_histories": [
        _POINTER,
        _SIZE,
        _POINTER,
        _POINTER,
        *[_SIZE] * 3,
        _POINTER,
        *[_SIZE] * 2,
        _POINTER,
    ],
    # index, slots, entry (user_state.index.StateIndex)
    "recserve_index_put": [_POINTER, _SIZE, _POINTER],
    # index, slots, user
    "recserve_index_remove": [_POINTER, _SIZE, _SIZE],
    # index, slots, users, newest, lengths, rows, tail_limit, now, stale_ok, then as
    # recserve_merge_histories from keys to out, then row_states
    "recserve_merge_cached": [
        *[_POINTER] * 5,
        *[_SIZE] * 4,
        *[_POINTER] * 2,
        *[_SIZE] * 3,
        _POINTER,
        *[_SIZE] * 2,
        *[_POINTER] * 2,
    ],
}


_CHAR_AT, _ADDRESS_OF = ctypes.c_char.from_buffer, ctypes.addressof


def address(array: np.ndarray) -> int:
    """Where ``array``'s data starts (for the compiled loops)."""
    flags = array.flags
    if flags.writeable and flags.c_contiguous and array.size:  # a third of ``ctypes.data``'s cost
        return _ADDRESS_OF(_CHAR_AT(cast("Buffer", array)))
    return array.ctypes.data


def contiguous(array: np.ndarray, dtype: type) -> np.ndarray:
    """``array`` itself, checked to be C-contiguous of ``dtype`` (raises ValueError otherwise)."""
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise ValueError(
            f"expected a C-contiguous {np.dtype(dtype).name} array, got {array.dtype} {array.shape}"
        )
    return array


class CacheProbe:
    """The compiled L1 probe bound to one direct-mapped cache's arrays (``HotCache``)."""

    def __init__(self, function: Callable[..., int], slot_keys: np.ndarray, vectors: np.ndarray) -> None:
        self._function = function
        self._arrays = (slot_keys, vectors)  # kept alive: the library reads them through raw addresses
        self._slot_keys, self._slots = address(contiguous(slot_keys, np.int64)), slot_keys.size
        self._vectors, self._dim = address(contiguous(vectors, np.float32)), vectors.shape[1]

    def take(
        self, keys: np.ndarray, out: np.ndarray, tiers: np.ndarray, tier: int, misses: np.ndarray
    ) -> int:
        """Copy the cached rows of ``keys`` into ``out`` and mark them in ``tiers``.

        The positions of the misses go to ``misses``.

        Returns:
            How many keys missed (the first entries of ``misses``).
        """
        (
            contiguous(keys, np.int64),
            contiguous(out, np.float32),
            contiguous(tiers, np.int8),
            contiguous(misses, np.int64),
        )
        return self._function(
            address(keys),
            keys.size,
            self._slot_keys,
            self._slots,
            self._vectors,
            self._dim,
            address(out),
            address(tiers),
            tier,
            address(misses),
        )


class IndexProbe:
    """The compiled probe bound to one key index (``KeyIndex``) and its vectors (float32 or float16)."""

    def __init__(
        self,
        function: Callable[..., int],
        buckets: np.ndarray,
        overflow_keys: np.ndarray,
        overflow_rows: np.ndarray,
        vectors: np.ndarray,
    ) -> None:
        half = vectors.dtype == np.float16
        self._function = function
        self._arrays = (buckets, overflow_keys, overflow_rows, vectors)  # kept alive, as above
        self._buckets, self._shift = (
            address(contiguous(buckets, np.int64)),
            64 - (len(buckets).bit_length() - 1),
        )
        self._overflow_keys, self._overflow = (
            address(contiguous(overflow_keys, np.int64)),
            overflow_keys.size,
        )
        self._overflow_rows = address(contiguous(overflow_rows, np.int32))
        self._vectors, self._dim = (
            address(contiguous(vectors, np.float16 if half else np.float32)),
            vectors.shape[1],
        )
        self._half = int(half)

    def take(
        self,
        keys: np.ndarray,
        positions: np.ndarray,
        out: np.ndarray,
        tiers: np.ndarray,
        tier: int,
        misses: np.ndarray,
    ) -> int:
        """Copy the rows of ``keys[positions]`` into ``out[positions]``; positions not found go to ``misses``.

        Returns:
            How many positions were not found (the first entries of ``misses``).
        """
        (
            contiguous(keys, np.int64),
            contiguous(positions, np.int64),
            contiguous(out, np.float32),
            contiguous(tiers, np.int8),
            contiguous(misses, np.int64),
        )
        return self._function(
            address(keys),
            address(positions),
            positions.size,
            self._buckets,
            self._shift,
            self._overflow_keys,
            self._overflow_rows,
            self._overflow,
            self._vectors,
            self._dim,
            self._half,
            address(out),
            address(tiers),
            tier,
            address(misses),
        )


class Kernels:
    """The loaded library and typed entry points."""

    def __init__(self, library: ctypes.CDLL) -> None:  # a PyDLL (a CDLL that keeps the GIL)
        self.library = library
        for name, arguments in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes = arguments
            function.restype = None if name == "recserve_count" else ctypes.c_int64

    def cache_probe(self, slot_keys: np.ndarray, vectors: np.ndarray) -> CacheProbe:
        """Bind the L1 probe to one cache's arrays."""
        return CacheProbe(self.library.recserve_cache_take, slot_keys, vectors)

    def index_probe(
        self, buckets: np.ndarray, overflow_keys: np.ndarray, overflow_rows: np.ndarray, vectors: np.ndarray
    ) -> IndexProbe:
        """Bind the index probe to one index and its vector array."""
        return IndexProbe(self.library.recserve_index_take, buckets, overflow_keys, overflow_rows, vectors)

    def count(self, table_ids: np.ndarray, tiers: np.ndarray, counts: np.ndarray) -> None:
        """``counts[table, tier] += 1`` for every key (``counts`` int64 ``[tables, tiers]``, in place)."""
        contiguous(counts, np.int64)
        self.library.recserve_count(
            address(contiguous(table_ids, np.int16)),
            address(contiguous(tiers, np.int8)),
            tiers.size,
            counts.shape[1],
            address(counts),
        )

    def fill_rows(
        self,
        positions: np.ndarray,
        table_ids: np.ndarray,
        rows: np.ndarray,
        out: np.ndarray,
        tiers: np.ndarray,
        tier: int,
    ) -> None:
        """``out[p] = rows[table_ids[p]]``, ``tiers[p] = tier`` for each of ``positions`` (in place).

        Raises:
            ValueError: ``rows`` and ``out`` of other widths, arrays of other types or sizes, or a
                position outside ``out`` or whose table id is not a row of ``rows`` (nothing is
                written then).
        """
        for array, dtype in (
            (positions, np.int64),
            (table_ids, np.int16),
            (rows, np.float32),
            (out, np.float32),
            (tiers, np.int8),
        ):
            contiguous(array, dtype)
        if rows.ndim != 2 or out.ndim != 2 or rows.shape[1] != out.shape[1]:
            raise ValueError(f"rows {rows.shape} for an output of {out.shape}")
        if not table_ids.size == tiers.size == out.shape[0]:
            raise ValueError(f"{table_ids.size} table ids and {tiers.size} tiers for {out.shape[0]} rows")
        filled = self.library.recserve_fill_rows(
            address(positions),
            positions.size,
            out.shape[0],
            address(table_ids),
            address(rows),
            rows.shape[0],
            out.shape[1],
            address(out),
            address(tiers),
            tier,
        )
        if filled < 0:
            raise ValueError(f"a position outside {out.shape[0]} rows, or a table id outside {rows.shape[0]}")

    def merge_histories(
        self,
        table: np.ndarray,
        keys: np.ndarray,
        mask: np.ndarray,
        left: bool,
        pad_key: int,
        widths: np.ndarray,
        max_width: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What ``user_state.merge.merge_numpy_histories`` computes, in one pass over the rows.

        ``table`` (int64 ``[rows, 6]``) gives each row the addresses of its state's items and
        counts (:attr:`StoredTokens.entry <recserve.backends.store.user_state.tokens.StoredTokens.entry>`:
        live arrays of at least the size given), the state's size (-1: none) and sequence number,
        its tail's length and newest sequence number. The history is as wide as the first of
        ``widths`` (int64, ascending) that holds the longest merged row, and at least as ``keys``;
        each row's state and tail must fit ``max_width`` columns.

        Returns:
            The history's keys, mask and log-weights, and per row its tokens (-1: no state), gap
            (1/0) and lag (-1: no state) as int64 ``[rows, 3]``.

        Raises:
            ValueError: a table of another shape, a tail wider than its history, a row's state and
                tail wider than ``max_width``, or no width up to it holding the longest merged row
                (the loop writes raw memory; the request checks come first, these keep a caller's
                mistake from reaching it).
        """
        rows, width = keys.shape
        for array in (table, keys, widths):
            contiguous(array, np.int64)
        contiguous(mask, np.float32)
        if table.shape != (rows, 6) or mask.shape != keys.shape:
            raise ValueError(f"a table {table.shape} and mask {mask.shape} for keys {keys.shape}")
        out = np.empty(history_bytes(rows, max_width), np.uint8)
        history = self.library.recserve_merge_histories(
            address(table),
            rows,
            address(keys),
            address(mask),
            width,
            int(left),
            int(pad_key),
            address(widths),
            widths.size,
            max_width,
            address(out),
        )
        if history < 0:
            raise ValueError(f"a row's tail or its state and tail wider than {width} or {max_width} columns")
        return history_views(out, rows, history)


def history_bytes(rows: int, max_width: int) -> int:
    """The bytes the compiled merge writes a history of up to ``max_width`` columns into."""
    return 16 * rows * max_width + 24 * rows  # keys (int64), mask, weights, then 3 int64 per row


def history_views(
    out: np.ndarray, rows: int, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The compiled merge's history in ``out`` (``width`` columns): keys, mask, weights, row fields."""
    shape, cells = (rows, width), rows * width
    return (
        np.ndarray(shape, np.int64, out, 0),
        np.ndarray(shape, np.float32, out, 8 * cells),
        np.ndarray(shape, np.float32, out, 12 * cells),
        np.ndarray((rows, 3), np.int64, out, 16 * cells),
    )


@lru_cache(maxsize=1)
def load() -> Kernels | None:
    """The compiled kernels, or ``None`` where they were not built (or ``RECSERVE_STORE_KERNELS=numpy``)."""
    if os.environ.get("RECSERVE_STORE_KERNELS", "").lower() == "numpy":
        LOGGER.debug("store kernels: numpy (RECSERVE_STORE_KERNELS=numpy)")
        return None
    # keep_gil (a PyDLL): the loops run for microseconds and keep the GIL; a CDLL call would hand it
    # to any busy background thread (the L1 refresh, an update) and wait up to a switch interval for it
    library = compiled_library(__package__, "_kernels", keep_gil=True)
    if library is None:
        LOGGER.debug("store kernels: the compiled extension is not built; the store uses its numpy path")
        return None
    LOGGER.debug("store kernels: compiled")
    return Kernels(library)
