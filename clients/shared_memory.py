"""Requests through one system shared-memory region per client (same host only)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from recserve.clients.errors import (
    InvalidRequestError,
)
from recserve.core.names import PROBABILITY, WIRE_FORMS
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import NUMPY_DTYPES

LOGGER = logging.getLogger(__name__)

ALIGN = 64


class SharedMemoryIO:
    """One system shared-memory region holding a request's inputs and its output (same host only).

    The region is sized for the largest request the server takes (``rows``; the spec's
    ``max_batch_size`` by default), registered with the server once,
    and reused by every request of its client: tensors are copied into it instead of being
    serialised into the request message.
    """

    def __init__(self, client: Any, spec: ModelSpec, rows: int | None = None) -> None:
        from multiprocessing import shared_memory

        rows = rows or spec.model.max_batch_size
        group = spec.categorical
        per_row = {  # a BYTES element takes 4 bytes of length and its text
            group.name: sum(4 + group.raw_columns[i].max_bytes for i in group.wire_columns),
            **{
                c.name: c.max_length * (4 + c.max_bytes // c.max_length)  # one value per element
                for c in (group.raw_columns[i] for i in group.list_columns)
            },
        }
        # a ragged tensor holds at most the longest sequence or multi-hot list
        longest = max([spec.serving.sequence_buckets[-1], *(c.max_length for c in group.raw_columns)])
        tensors = {w.name: w for form in WIRE_FORMS for w in spec.wire_form(form).inputs}
        self.dtypes = {name: w.dtype for name, w in tensors.items()}
        for name, w in tensors.items():
            if w.dtype != "BYTES":
                width = longest if w.dims[0] == -1 else w.dims[0]
                per_row[name] = np.dtype(NUMPY_DTYPES[w.dtype]).itemsize * width
        self.offsets: dict[str, int] = {}
        size = 0
        for name, row_bytes in per_row.items():
            self.offsets[name] = size
            size += -(-rows * row_bytes // ALIGN) * ALIGN
        self.offsets[PROBABILITY] = size
        size += rows * 4
        self.capacity = {name: (self.offsets[name], rows * b) for name, b in per_row.items()}
        self.region = shared_memory.SharedMemory(create=True, size=size)
        self.name = f"recserve_{self.region.name}"
        self.client = client
        try:
            client.register_system_shared_memory(self.name, f"/{self.region.name}", size)
        except Exception:
            self.region.close()
            self.region.unlink()
            raise

    def _buffer(self) -> memoryview:
        """The region's memory; an error once the region is closed."""
        buf = self.region.buf
        if buf is None:
            raise RuntimeError(f"the shared-memory region {self.name} is closed")
        return buf

    def place(self, module: ModuleType, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        """Copy ``arrays`` (the tensors of one wire form) into the region; ``InferInput`` objects at them."""
        from tritonclient.utils import serialize_byte_tensor

        result = []
        for name, array in arrays.items():
            dtype = self.dtypes[name]
            offset, capacity = self.capacity[name]
            if dtype == "BYTES":
                data = serialize_byte_tensor(array).item()
                size = len(data)
            else:
                size = array.nbytes
            if size > capacity:
                raise InvalidRequestError(
                    f"input '{name}' of {size} bytes exceeds the shared-memory slot of {capacity}"
                )
            if dtype == "BYTES":
                self._buffer()[offset : offset + size] = data
            else:
                np.ndarray(array.shape, array.dtype, buffer=self._buffer(), offset=offset)[...] = array
            infer_input = module.InferInput(name, list(array.shape), dtype)
            infer_input.set_shared_memory(self.name, size, offset=offset)
            result.append(infer_input)
        return result

    def output(self, module: ModuleType, rows: int) -> Any:
        """The requested probabilities, written by the server into the region."""
        requested = module.InferRequestedOutput(PROBABILITY)
        requested.set_shared_memory(self.name, rows * 4, offset=self.offsets[PROBABILITY])
        return requested

    def probabilities(self, rows: int) -> np.ndarray:
        """The output of the last request, copied out of the region."""
        return np.frombuffer(self._buffer(), np.float32, count=rows, offset=self.offsets[PROBABILITY]).copy()

    def close(self) -> None:
        """Unregister and remove the region."""
        try:
            self.client.unregister_system_shared_memory(self.name)
        except Exception as exc:  # the server may be gone already; the region is ours to remove anyway
            LOGGER.debug("unregistering %s: %s", self.name, exc)
        self.region.close()
        self.region.unlink()
