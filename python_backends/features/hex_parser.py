"""The compiled hex parser (``_hex.c``) behind :func:`recserve.core.values.parse_hex`'s signature.

``pip install`` compiles ``_hex.c`` into the optional extension ``recserve.backends.features._hex``
(plain C loaded with ctypes, like the store's kernels). Where it was not built, :func:`load` returns
``None`` and the transform keeps the numpy path, which gives the same results. A batch the compiled
loop refuses is parsed again by the numpy path, which raises the error naming the value.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

from recserve.backends.base.compiled import compiled_library
from recserve.core.values import HexParser, hex_bytes, parse_hex

_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64


@lru_cache(maxsize=1)
def load() -> HexParser | None:
    """The compiled parser, or ``None`` where the extension was not built."""
    library = compiled_library(__package__, "_hex", keep_gil=True)  # keeps the GIL (see store.kernels)
    if library is None:
        return None
    function = library.recserve_parse_hex
    function.argtypes = [_POINTER, _SIZE, _SIZE, _SIZE, _POINTER, _POINTER]
    function.restype = ctypes.c_int64

    def parse(values: np.ndarray, max_digits: int, input_name: str) -> tuple[np.ndarray, np.ndarray]:
        fixed = np.ascontiguousarray(hex_bytes(values, max_digits, input_name))
        out = np.empty(fixed.shape, dtype=np.uint64)
        empty = np.empty(fixed.shape, dtype=np.bool_)
        refused = function(
            fixed.ctypes.data,
            fixed.size,
            fixed.dtype.itemsize,
            max_digits,
            out.ctypes.data,
            empty.ctypes.data,
        )
        if refused >= 0:
            return parse_hex(values, max_digits, input_name)  # refuses, naming the value
        return out, empty

    return parse
