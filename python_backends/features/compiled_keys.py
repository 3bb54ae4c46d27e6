"""The compiled key loops (``_keys.c``) behind the transform's numpy key paths.

``pip install`` compiles ``_keys.c`` into the optional extension ``recserve.backends.features._keys``
(plain C loaded with ctypes, like the hex parser and the store's kernels; it keeps the interpreter
lock, the loops run for microseconds). Where it was not built, :func:`load` returns ``None`` and
the callers keep their numpy paths, which give the same keys bit for bit. ``RECSERVE_KEY_LOOPS=numpy``
forces the numpy paths. Each loop returns ``None`` where it does not apply or a request is one the
numpy path refuses: the caller then runs its numpy path, which raises the error naming the value.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import Any

import numpy as np

from recserve.backends.base.compiled import compiled_library

_POINTER, _SIZE, _INT, _KEY = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint64
_SIGNATURES = {
    "recserve_keys": ([_POINTER, _SIZE, _POINTER, _SIZE, _POINTER], None),
    "recserve_categorical_keys": (
        [_POINTER, _POINTER, _SIZE, _SIZE, _POINTER, _POINTER, _POINTER, _POINTER],
        None,
    ),
    "recserve_item_keys": ([_POINTER, _SIZE, _KEY, _SIZE, _POINTER], _SIZE),
    "recserve_history_keys": (
        [_POINTER, _SIZE, _SIZE, _POINTER, _SIZE, _SIZE, _INT, _KEY, _SIZE, _POINTER, _POINTER],
        _SIZE,
    ),
}


class KeyLoops:
    """The compiled loops of one loaded library; every array argument is converted and checked here."""

    def __init__(self, library: ctypes.CDLL) -> None:
        for name, (arguments, result) in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, result
        self._library = library

    def keys(self, values: np.ndarray, salts: np.ndarray) -> np.ndarray | None:
        """``keys_for(values, salts)`` for ``uint64`` values and one salt, or one per value of the last axis.

        None: ``salts`` broadcasts another way (or ``values`` is a scalar).
        """
        salts = np.ascontiguousarray(salts, dtype=np.uint64)
        if values.ndim == 0 or salts.ndim > values.ndim or salts.size not in (1, values.shape[-1]):
            return None
        if salts.ndim and salts.shape[-1] != salts.size:  # salts along another axis
            return None
        values = np.ascontiguousarray(values, dtype=np.uint64)
        out = np.empty(values.shape, np.int64)
        self._library.recserve_keys(
            values.ctypes.data, values.size, salts.ctypes.data, salts.size, out.ctypes.data
        )
        return out

    def categorical_keys(
        self, salts: np.ndarray, identity: np.ndarray, missing: np.ndarray
    ) -> CategoricalKeys:
        """The categorical keys' loop bound to the columns' salts, identity flags and missing keys."""
        return CategoricalKeys(self._library.recserve_categorical_keys, salts, identity, missing)

    def item_keys(self, items: np.ndarray, salt: int, missing: int) -> np.ndarray | None:
        """Keys of ``int64`` item ids (-1: absent, ``missing``); None when an id is below -1."""
        items = np.ascontiguousarray(items, dtype=np.int64)
        out = np.empty(items.shape, np.int64)
        refused = self._library.recserve_item_keys(
            items.ctypes.data, items.size, salt, missing, out.ctypes.data
        )
        return None if refused >= 0 else out

    def history_keys(
        self,
        items: np.ndarray,
        lengths: np.ndarray,
        bucket: int,
        max_length: int,
        left: bool,
        salt: int,
        missing: int,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """A sequence's keys and mask ``[H, bucket]``; None for a request the checks refuse."""
        items = np.ascontiguousarray(items, dtype=np.int64)
        lengths = np.ascontiguousarray(lengths, dtype=np.int32)
        keys = np.empty((items.shape[0], bucket), np.int64)
        mask = np.empty((items.shape[0], bucket), np.float32)
        refused = self._library.recserve_history_keys(
            items.ctypes.data,
            items.shape[0],
            items.shape[1],
            lengths.ctypes.data,
            bucket,
            max_length,
            int(left),
            salt,
            missing,
            keys.ctypes.data,
            mask.ctypes.data,
        )
        return None if refused else (keys, mask)


class CategoricalKeys:
    """Keys ``[B, F]`` of picked categorical values and their absent mask (``recserve_categorical_keys``).

    The columns' constants are converted, and their addresses taken, once: a call converts only the
    request's two arrays.
    """

    def __init__(self, function: Any, salts: np.ndarray, identity: np.ndarray, missing: np.ndarray) -> None:
        self._function = function
        self._constants = (  # alive as long as the addresses are used
            np.ascontiguousarray(salts, dtype=np.uint64),
            np.ascontiguousarray(identity, dtype=np.uint8),
            np.ascontiguousarray(missing, dtype=np.int64),
        )
        self._addresses = [c.ctypes.data for c in self._constants]

    def __call__(self, values: np.ndarray, absent: np.ndarray) -> np.ndarray:
        """The keys of ``values`` (``uint64`` ``[B, F]``) where ``absent`` (bool ``[B, F]``) is False."""
        values = np.ascontiguousarray(values, dtype=np.uint64)
        absent = np.ascontiguousarray(absent, dtype=np.bool_)
        out = np.empty(values.shape, np.int64)
        pointers = (values.ctypes.data, absent.ctypes.data)
        self._function(*pointers, *values.shape, *self._addresses, out.ctypes.data)
        return out


@lru_cache(maxsize=1)
def load() -> KeyLoops | None:
    """The compiled loops, or ``None`` where the extension was not built or the numpy path is forced."""
    if os.environ.get("RECSERVE_KEY_LOOPS") == "numpy":
        return None
    library = compiled_library(__package__, "_keys", keep_gil=True)  # keeps the GIL (see store.kernels)
    return None if library is None else KeyLoops(library)
