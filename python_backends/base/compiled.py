"""The optional compiled extensions of the backends, loaded as plain C shared libraries.

``pip install`` compiles a few C files (the store's kernels, the feature transform's hex parser and
key loops, the request log's history columns) into optional extensions of their packages. They have
no Python API: each is loaded with ctypes, not imported, and where it could not be built (no C
compiler) its caller keeps a numpy path that gives the same results. :func:`compiled_library` finds
and loads one of them, or says that it was not built.
"""

from __future__ import annotations

import ctypes
import importlib.util


def compiled_library(package: str, name: str, keep_gil: bool) -> ctypes.CDLL | None:
    """The compiled extension ``name`` of ``package``, loaded with ctypes.

    Args:
        package: The import name of the package that holds the extension (a caller passes its
            ``__package__``).
        name: The extension's module name within ``package``, e.g. ``"_kernels"``.
        keep_gil: Whether the library's functions keep the interpreter lock while they run (a
            :class:`ctypes.PyDLL`, for loops of microseconds) or let go of it (a :class:`ctypes.CDLL`,
            so that other threads run during a long call).

    Returns:
        The loaded library, or ``None`` where the extension was not built.
    """
    spec = importlib.util.find_spec(f"{package}.{name}")
    if spec is None or not spec.origin:
        return None
    return ctypes.PyDLL(spec.origin) if keep_gil else ctypes.CDLL(spec.origin)
