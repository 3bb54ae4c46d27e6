"""The store's compiled probe-and-gather loops (``_kernels.c``), called through ctypes.

``pip install`` compiles ``_kernels.c`` into the optional extension ``recserve.backends.store._kernels``
(plain C, no Python API: it is loaded as a shared library, not imported). Where it could not be
built (no C compiler), :func:`load` returns ``None`` and the store keeps its numpy path, which gives
the same results bit for bit, only slower. ``RECSERVE_STORE_KERNELS=numpy`` forces the numpy path.

The addresses of arrays that live as long as a table version (index, vectors, cache) are resolved
once, when a probe is bound; a call only converts the per-batch buffers.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from collections.abc import Callable
from functools import lru_cache

import numpy as np

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
    # state_items, state_counts, state_total, starts, sizes, tails, width, first, ends, rows,
    # scratch, out_items, out_counts, out_lengths
    "recserve_merge_rows": [
        _POINTER,
        _POINTER,
        _SIZE,
        *[_POINTER] * 3,
        _SIZE,
        _POINTER,
        _POINTER,
        _SIZE,
        *[_POINTER] * 4,
    ],
    # items, counts, lengths, rows, n, width, left, history_rows, out_keys, out_mask, out_weights
    "recserve_place_tokens": [*[_POINTER] * 4, _SIZE, _SIZE, _SIZE, _SIZE, *[_POINTER] * 3],
}


def _address(array: np.ndarray) -> int:
    return array.ctypes.data


def _contiguous(array: np.ndarray, dtype: type) -> np.ndarray:
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
        self._slot_keys, self._slots = _address(_contiguous(slot_keys, np.int64)), slot_keys.size
        self._vectors, self._dim = _address(_contiguous(vectors, np.float32)), vectors.shape[1]

    def take(
        self, keys: np.ndarray, out: np.ndarray, tiers: np.ndarray, tier: int, misses: np.ndarray
    ) -> int:
        """Copy the cached rows of ``keys`` into ``out`` and mark them in ``tiers``.

        The positions of the misses go to ``misses``.

        Returns:
            How many keys missed (the first entries of ``misses``).
        """
        (
            _contiguous(keys, np.int64),
            _contiguous(out, np.float32),
            _contiguous(tiers, np.int8),
            _contiguous(misses, np.int64),
        )
        return self._function(
            _address(keys),
            keys.size,
            self._slot_keys,
            self._slots,
            self._vectors,
            self._dim,
            _address(out),
            _address(tiers),
            tier,
            _address(misses),
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
            _address(_contiguous(buckets, np.int64)),
            64 - (len(buckets).bit_length() - 1),
        )
        self._overflow_keys, self._overflow = (
            _address(_contiguous(overflow_keys, np.int64)),
            overflow_keys.size,
        )
        self._overflow_rows = _address(_contiguous(overflow_rows, np.int32))
        self._vectors, self._dim = (
            _address(_contiguous(vectors, np.float16 if half else np.float32)),
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
            _contiguous(keys, np.int64),
            _contiguous(positions, np.int64),
            _contiguous(out, np.float32),
            _contiguous(tiers, np.int8),
            _contiguous(misses, np.int64),
        )
        return self._function(
            _address(keys),
            _address(positions),
            positions.size,
            self._buckets,
            self._shift,
            self._overflow_keys,
            self._overflow_rows,
            self._overflow,
            self._vectors,
            self._dim,
            self._half,
            _address(out),
            _address(tiers),
            tier,
            _address(misses),
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
        _contiguous(counts, np.int64)
        self.library.recserve_count(
            _address(_contiguous(table_ids, np.int16)),
            _address(_contiguous(tiers, np.int8)),
            tiers.size,
            counts.shape[1],
            _address(counts),
        )

    def merge_rows(
        self,
        state_items: np.ndarray,
        state_counts: np.ndarray,
        starts: np.ndarray,
        sizes: np.ndarray,
        tails: np.ndarray,
        first: np.ndarray,
        ends: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's state tokens merged with its newer events ``tails[r, first[r]:ends[r]]``.

        Row ``r``'s state is ``state_items/state_counts[starts[r]:starts[r] + sizes[r]]``. Returns
        the rows' tokens (items, counts; row after row) and each row's number of tokens: what
        :func:`recserve.backends.store.user_tokens.merge_rows` computes with numpy.

        Raises:
            ValueError: a span outside its array (the loop reads and writes raw memory; the
                request checks come first, this keeps a caller's mistake from reaching it).
        """
        rows, width = tails.shape
        arrays = (state_items, state_counts, starts, sizes, tails, first, ends)
        for array in arrays:
            _contiguous(array, np.int64)
        capacity = max(0, int(sizes.sum() + ends.sum() - first.sum()))
        items, counts = np.empty(capacity, np.int64), np.empty(capacity, np.int64)
        lengths = np.empty(rows, np.int64)
        scratch = np.empty(8 * width + 2, np.int64)
        written = self.library.recserve_merge_rows(
            _address(state_items),
            _address(state_counts),
            min(state_items.size, state_counts.size),
            *(_address(a) for a in arrays[2:5]),
            width,
            _address(first),
            _address(ends),
            rows,
            _address(scratch),
            _address(items),
            _address(counts),
            _address(lengths),
        )
        if written < 0:
            raise ValueError("a state or tail span outside its array")
        return items[:written], counts[:written], lengths

    def place_tokens(
        self,
        items: np.ndarray,
        counts: np.ndarray,
        lengths: np.ndarray,
        rows: np.ndarray,
        left: bool,
        out_keys: np.ndarray,
        out_mask: np.ndarray,
        out_weights: np.ndarray,
    ) -> None:
        """Write merged tokens into a history, in place: what ``user_tokens.place_numpy`` does.

        Raises:
            ValueError: a row's tokens wider than the history, or a row outside it.
        """
        for array in (items, counts, lengths, rows, out_keys):
            _contiguous(array, np.int64)
        for array in (out_mask, out_weights):
            _contiguous(array, np.float32)
        history_rows, width = out_keys.shape
        if out_mask.shape != out_keys.shape or out_weights.shape != out_keys.shape:
            raise ValueError("the history's keys, mask and weights differ in shape")
        if items.size < int(lengths.sum()) or counts.size < items.size:
            raise ValueError("fewer tokens than the rows' lengths")
        done = self.library.recserve_place_tokens(
            *(_address(a) for a in (items, counts, lengths, rows)),
            rows.size,
            width,
            int(left),
            history_rows,
            *(_address(a) for a in (out_keys, out_mask, out_weights)),
        )
        if done < 0:
            raise ValueError("merged tokens wider than the history, or a row outside it")


@lru_cache(maxsize=1)
def load() -> Kernels | None:
    """The compiled kernels, or ``None`` where they were not built (or ``RECSERVE_STORE_KERNELS=numpy``)."""
    if os.environ.get("RECSERVE_STORE_KERNELS", "").lower() == "numpy":
        LOGGER.debug("store kernels: numpy (RECSERVE_STORE_KERNELS=numpy)")
        return None
    spec = importlib.util.find_spec(f"{__package__}._kernels")
    if spec is None or not spec.origin:
        LOGGER.debug("store kernels: the compiled extension is not built; the store uses its numpy path")
        return None
    # PyDLL: the loops run for microseconds and keep the GIL; a CDLL call would hand it to any
    # busy background thread (the L1 refresh, an update) and wait up to a switch interval for it
    kernels = Kernels(ctypes.PyDLL(spec.origin))
    LOGGER.debug("store kernels: compiled (%s)", os.path.basename(spec.origin))
    return kernels
