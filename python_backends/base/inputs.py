"""One request input fetched and checked against the dtype and 2-D shape a step expects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from recserve.core.spec.types import NUMPY_DTYPES
from recserve.errors import InvalidInput


def dtype_name(array: Any) -> str:
    """The numpy name of the dtype of a numpy array or a torch tensor (``float32``, ``int64``, ...)."""
    return str(array.dtype).removeprefix("torch.")


def require(
    inputs: Mapping[str, np.ndarray], name: str, dtype: str, rows: int | None, width: int | None
) -> np.ndarray:
    """Fetch one input and check its dtype and 2-D shape ``[rows, width]`` (None: any).

    The input may be a numpy array or a torch tensor (a device step's, handed over through DLPack).
    """
    if name not in inputs or inputs[name] is None:
        raise InvalidInput(name, "is required but missing")
    array = inputs[name]
    expected = np.dtype(NUMPY_DTYPES[dtype])
    if isinstance(array, np.ndarray):
        if array.dtype != expected and not (expected == np.dtype(object) and array.dtype.kind in "SO"):
            raise InvalidInput(name, f"has dtype {array.dtype}, expected {dtype}")
    elif dtype_name(array) != expected.name:
        raise InvalidInput(name, f"has dtype {dtype_name(array)}, expected {dtype}")
    if array.ndim != 2:
        raise InvalidInput(name, f"has shape {list(array.shape)}, expected [batch, ...] with 2 dims")
    if rows is not None and array.shape[0] != rows:
        raise InvalidInput(name, f"has {array.shape[0]} rows, other inputs have {rows}")
    if width is not None and array.shape[1] != width:
        raise InvalidInput(name, f"has shape {list(array.shape)}, expected [{array.shape[0]}, {width}]")
    return array
