"""Files replaced whole: a reader sees the old file or the new one, never a part of either."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

#: the suffix of a file being written (``.<name>.<pid>.tmp``): a writer killed mid-file leaves one,
#: which a folder's owner may remove at its start
SCRATCH_SUFFIX = ".tmp"


def write_atomically(path: Path, write: Callable[[BinaryIO], object], durable: bool = False) -> None:
    """Write ``path`` through ``write(handle)`` under a hidden name beside it, then rename it into place.

    Args:
        path: the file to replace (its folder must exist).
        write: writes the whole content to the open binary handle.
        durable: flush and fsync before the rename, so that after a crash the disk holds the old file
            or the whole new one (not an empty one): for files that record progress.

    The hidden name (``.<name>.<pid>.tmp``) carries the process id, so two processes replacing the
    same file never write into each other's. On failure it is removed and the error raised.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}{SCRATCH_SUFFIX}")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text_atomically(path: Path, text: str) -> None:
    """``text`` (UTF-8) as the whole of ``path``, replaced atomically (:func:`write_atomically`)."""
    write_atomically(path, lambda handle: handle.write(text.encode()))
