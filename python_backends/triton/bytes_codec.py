"""Decoding of Triton BYTES tensors, a faster drop-in for the Python-backend stub's decoder.

On the wire (and in the stub's shared memory) a BYTES tensor is a sequence of elements, each a
4-byte little-endian length followed by that many bytes. The stub decodes it with a loop that
formats a ``struct`` pattern per element; :func:`decode_bytes_tensor` slices one ``bytes`` copy of
the buffer instead (timed by ``python -m recserve.perf.lab.microbench``; figures in docs/performance.md).
:mod:`recserve.backends.triton.adapter` installs it in the stub.
"""

from __future__ import annotations

import struct

import numpy as np

_LENGTH = struct.Struct("<I")


def decode_bytes_tensor(encoded: np.ndarray | bytes | bytearray | memoryview) -> np.ndarray:
    """Elements of a serialized BYTES tensor as a flat object array of ``bytes``.

    Raises:
        ValueError: the buffer ends inside an element.
    """
    buffer = encoded.tobytes() if isinstance(encoded, np.ndarray) else bytes(encoded)
    unpack, size = _LENGTH.unpack_from, len(buffer)
    elements: list[bytes] = []
    append = elements.append
    offset = 0
    while offset < size:
        if offset + 4 > size:
            raise ValueError(f"truncated BYTES tensor: a length prefix starts at byte {offset} of {size}")
        (length,) = unpack(buffer, offset)
        offset += 4
        if offset + length > size:
            raise ValueError(
                f"truncated BYTES tensor: an element of {length} bytes at byte {offset} of {size}"
            )
        append(buffer[offset : offset + length])
        offset += length
    result = np.empty(len(elements), dtype=np.object_)
    result[:] = elements
    return result
