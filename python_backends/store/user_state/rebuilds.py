"""Users asking for a state rebuild: the lookup step writes them, the user-state builder takes them.

A request whose user has no usable state (none stored, an expired one, a value in another format,
or events missing between the state and the tail) is served from its tail alone, and its user is
queued here so that the builder writes a state from the events it holds. Two forms, beside the
event log:

- a file of JSON lines ``{"rebuild": <user>}`` next to the file log (``<event_path>.rebuild``),
  read forward from an offset and emptied whenever the builder has read it all, so it holds only
  the requests not yet taken (at most :data:`MAX_REBUILD_FILE_BYTES`);
- a Redis set ``<event_stream>:rebuild`` (``SADD``; the builder takes members with ``SPOP``).

The lookup step never writes on its request path: :class:`RebuildQueue` collects users in memory
(a bounded set) and a daemon thread hands them to the sink every ``flush_s``. A failing sink loses
that round's users (counted); they are queued again by their next request.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

LOGGER = logging.getLogger(__name__)

REBUILD_FILE_SUFFIX = ".rebuild"
REBUILD_SET_SUFFIX = ":rebuild"
#: The most bytes the rebuild file holds (about 600,000 pending users) while no builder takes them.
MAX_REBUILD_FILE_BYTES = 16 << 20
#: Seconds between two warnings about rebuild requests a sink refused.
LOST_LOG_INTERVAL_S = 60.0


class RebuildSink(Protocol):
    """Where rebuild requests go and whence the builder takes them."""

    def add(self, users: Iterable[int]) -> None:
        """Queue ``users`` for a rebuild."""
        ...

    def take(self) -> np.ndarray:
        """The users queued since the last call (int64, each once)."""
        ...


class RebuildsFull(OSError):
    """The rebuild file holds its most bytes: the builder is not taking them; these users are not queued."""


class FileRebuilds:
    """Rebuild requests as JSON lines in a file beside the event log, bounded in size.

    Writers (every server's lookup step) and the taker (the builder) hold an exclusive ``flock`` on
    the file for each append or take. A take that reads to the end of the file truncates it, so the
    file holds only the requests not yet taken; while no builder takes them it grows to at most
    ``max_bytes``, after which appends are refused (:class:`RebuildsFull`; the users are queued
    again by their next request).

    Args:
        path: the file.
        max_line_bytes: the longest line taken (a longer one is counted in ``refused``).
        max_bytes: the most bytes the file may hold.
    """

    def __init__(
        self, path: Path, max_line_bytes: int = 256, max_bytes: int = MAX_REBUILD_FILE_BYTES
    ) -> None:
        self.path, self.offset, self.max_line_bytes = Path(path), 0, max_line_bytes
        self.max_bytes = max_bytes
        self.refused = 0
        self.truncated = 0  # times a take emptied the file

    def add(self, users: Iterable[int]) -> None:
        """Append one line per user (one write, under the file's lock).

        Raises:
            RebuildsFull: the file would grow over ``max_bytes`` (nothing is written).
        """
        text = "".join(json.dumps({"rebuild": int(u)}) + "\n" for u in users).encode()
        if not text:
            return
        with self.path.open("ab") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            size = os.fstat(fh.fileno()).st_size
            if size + len(text) > self.max_bytes:
                raise RebuildsFull(f"{self.path.name} holds {size:,} bytes, at most {self.max_bytes:,}")
            fh.write(text)
            fh.flush()

    def take(self, chunk_bytes: int = 1 << 20) -> np.ndarray:
        """The users of the whole lines appended since the last call; malformed lines are counted.

        When this call has read every line, the file is emptied (under its lock, so no append is lost).
        """
        try:
            fh = self.path.open("r+b")
        except FileNotFoundError:
            return np.zeros(0, np.int64)
        with fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            size = os.fstat(fh.fileno()).st_size
            if self.offset > size:  # emptied by another taker: start again
                self.offset = 0
            fh.seek(self.offset)
            data = fh.read(chunk_bytes)
            end = data.rfind(b"\n")
            if end < 0:
                return np.zeros(0, np.int64)
            self.offset += end + 1
            if self.offset == size:
                fh.truncate(0)
                self.offset = 0
                self.truncated += 1
        users = []
        for line in data[:end].split(b"\n"):
            try:
                if len(line) > self.max_line_bytes:
                    raise ValueError("too long")
                user = json.loads(line)["rebuild"]
                if not isinstance(user, int) or isinstance(user, bool) or not -(1 << 63) <= user < 1 << 63:
                    raise ValueError("not an int64")
                users.append(user)
            except (ValueError, KeyError, TypeError):
                self.refused += 1
        return np.unique(np.asarray(users, np.int64))


class RedisRebuilds:
    """Rebuild requests as members of a Redis set."""

    def __init__(self, client: Any, key: str) -> None:
        self.client, self.key = client, key

    def add(self, users: Iterable[int]) -> None:
        """``SADD`` the users."""
        members = [int(u) for u in users]
        if members:
            self.client.sadd(self.key, *members)

    def take(self, limit: int = 10_000) -> np.ndarray:
        """``SPOP`` up to ``limit`` users."""
        popped = self.client.spop(self.key, limit) or []
        return np.unique(np.asarray([int(u) for u in popped], np.int64))


class RebuildQueue:
    """Users to rebuild, collected on the request path and handed to ``sink`` off it.

    Args:
        sink: where the users go.
        flush_s: how often the daemon thread hands them over.
        capacity: the most users held between flushes (more are dropped and counted).
    """

    def __init__(self, sink: RebuildSink, flush_s: float = 0.2, capacity: int = 100_000) -> None:
        self.sink, self.flush_s, self.capacity = sink, flush_s, capacity
        self.queued = self.dropped = self.failed = 0
        self._users: set[int] = set()
        self._lost_logged_at = -LOST_LOG_INTERVAL_S
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="recserve-user-rebuilds", daemon=True)
        self._thread.start()

    def add(self, users: np.ndarray) -> None:
        """Queue ``users`` (cheap: a set update under a lock)."""
        with self._lock:
            room = self.capacity - len(self._users)
            fresh = [u for u in np.unique(users).tolist() if u not in self._users]
            self._users.update(fresh[: max(room, 0)])
            self.queued += min(len(fresh), max(room, 0))
            self.dropped += max(len(fresh) - max(room, 0), 0)

    def flush(self) -> int:
        """Hand the queued users to the sink now; how many."""
        with self._lock:
            users, self._users = self._users, set()
        if not users:
            return 0
        try:
            self.sink.add(sorted(users))
        except Exception as exc:  # a sink outage must not reach requests; next requests queue again
            self.failed += len(users)
            now = time.monotonic()
            if now - self._lost_logged_at >= LOST_LOG_INTERVAL_S:
                self._lost_logged_at = now
                LOGGER.warning(
                    "user rebuild requests lost (%d users; %d since start): %s",
                    len(users),
                    self.failed,
                    exc if isinstance(exc, RebuildsFull) else type(exc).__name__,
                )
            return 0
        return len(users)

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()

    def close(self) -> None:
        """Stop the thread after a last flush."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()
