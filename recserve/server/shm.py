"""The Python backend's shared-memory regions of one tritonserver: named per server, removed after it.

The Python backend exchanges tensors with its stubs through regions in ``/dev/shm`` named
``<prefix><uuid>``. A server that exits cleanly removes them; one that is killed or aborts leaves
them behind (a few MB each). Every server recserve starts gets a prefix of its own
(``--backend-config=python,shm-region-prefix-name=...``), so the regions of a dead server are
known exactly and removing them never touches another server's.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

LOGGER = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX_STEM = "recserve_"
_SERIALS = itertools.count(1)


def region_prefix(pid: int | None = None) -> str:
    """A prefix no other live server of this host uses: this process's id and a serial number.

    The process id is unique among live processes and the serial among this process's servers; the
    trailing ``_`` keeps one prefix from being the start of another (``_1_`` vs ``_12_``).
    """
    return f"{PREFIX_STEM}{os.getpid() if pid is None else pid}_{next(_SERIALS)}_"


def backend_argument(prefix: str) -> str:
    """The tritonserver flag that names the Python backend's regions with ``prefix``."""
    return f"--backend-config=python,shm-region-prefix-name={prefix}"


def leftover_regions(prefix: str, shm_dir: Path = SHM_DIR) -> list[Path]:
    """The regions in ``shm_dir`` named with ``prefix`` (and only those).

    Raises:
        ValueError: ``prefix`` is not one of :func:`region_prefix`'s (it could match other files).
    """
    if not prefix.startswith(PREFIX_STEM) or not prefix.endswith("_") or len(prefix) <= len(PREFIX_STEM) + 2:
        raise ValueError(f"not a recserve region prefix: {prefix[:64]!r}")
    try:
        return sorted(p for p in shm_dir.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def remove_regions(prefix: str, shm_dir: Path = SHM_DIR) -> int:
    """Remove the regions named with ``prefix``; returns the bytes freed."""
    freed = 0
    for path in leftover_regions(prefix, shm_dir):
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError as exc:
            LOGGER.warning("could not remove shared-memory region %s: %s", path, exc)
            continue
        freed += size
    return freed
