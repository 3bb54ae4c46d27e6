"""The local user-state database file: checked when opened, set aside when it cannot be used.

``user_states.sqlite`` is shared by the builder and every server process on a machine, and it may be
damaged (a full disk, a crash mid-write, a copy cut short, a file someone else put there). Opening
it runs SQLite's ``quick_check`` (linear in the file, well under a second for hundreds of MB) and
checks the ``states`` table's columns. A file that fails is renamed ``<name>.corrupt-<time>`` with
its ``-wal`` and ``-shm`` files and logged; the caller then creates an empty database, whose
states the builder writes again. All of this happens under an exclusive lock on ``<name>.lock``,
so two processes opening a damaged file at once set it aside once, and neither sets aside the
fresh file the other has just created.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from recserve.errors import shorten

LOGGER = logging.getLogger(__name__)

#: The ``states`` table: its columns, in order, as created.
STATE_COLUMNS = "user INTEGER PRIMARY KEY, seq INTEGER NOT NULL, expires REAL NOT NULL, value BLOB NOT NULL"
_COLUMN_NAMES = ["user", "seq", "expires", "value"]
#: The files SQLite keeps beside a database in WAL mode, moved aside with it.
_COMPANIONS = ("-wal", "-shm")


@contextmanager
def opening_lock(path: Path) -> Iterator[None]:
    """Hold the exclusive lock on ``<path>.lock`` (one process checks or replaces the file at a time)."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def corruption(path: Path) -> str | None:
    """Why the database at ``path`` cannot hold user states; None when it can (or does not exist yet).

    Raises:
        sqlite3.OperationalError: the file could not be opened or stayed locked (not a fault of its
            content: nothing is set aside for it).
    """
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(path, timeout=5.0, isolation_level=None)
        try:
            verdict = db.execute("PRAGMA quick_check(1)").fetchone()
            if verdict is None or verdict[0] != "ok":
                return f"SQLite's quick_check says {shorten(verdict and verdict[0], 160)}"
            columns = [row[1] for row in db.execute("PRAGMA table_info(states)")]
        finally:
            db.close()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "unable to open" in str(exc):
            raise
        return str(exc)  # e.g. a malformed schema
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        return str(exc)
    if columns and columns != _COLUMN_NAMES:
        return f"its table 'states' has the columns {shorten(columns, 160)}, not {_COLUMN_NAMES}"
    return None


def set_aside_if_corrupt(path: Path) -> Path | None:
    """Rename a database that cannot hold user states (with its companions) aside; where it went.

    Call with :func:`opening_lock` held. None when the file is usable or absent.
    """
    problem = corruption(path)
    if problem is None:
        return None
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    os.replace(path, aside)
    for suffix in _COMPANIONS:
        companion = path.with_name(path.name + suffix)
        if companion.exists():
            os.replace(companion, aside.with_name(aside.name + suffix))
    LOGGER.error(
        "user-state database %s cannot be used (%s): set aside as %s; an empty one replaces it and "
        "the builder writes users' states again as they come back",
        path.name,
        problem,
        aside.name,
    )
    return aside
