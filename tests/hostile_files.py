"""Hostile files for tests: real archives that claim far more than they hold, written in chunks."""

from __future__ import annotations

import io
import zipfile

import numpy as np


def npy_header(shape: tuple[int, ...], dtype: str) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": dtype, "fortran_order": False, "shape": shape})
    return out.getvalue()


def write_zero_member(archive: zipfile.ZipFile, name: str, shape: tuple[int, ...], dtype: str) -> None:
    """A real ``.npy`` member of zeros, compressed as it is written: nothing large is ever held."""
    total = int(np.prod(shape)) * np.dtype(dtype).itemsize
    chunk = bytes(1 << 22)
    with archive.open(name, "w", force_zip64=True) as member:
        member.write(npy_header(shape, dtype))
        for start in range(0, total, len(chunk)):
            member.write(chunk[: min(len(chunk), total - start)])
