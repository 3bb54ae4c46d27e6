"""Users asking for a state rebuild: the lookup step writes them, the user-state builder takes them.

A request whose user has no usable state (none stored, an expired one, a value in another format,
or events missing between the state and the tail) is served from its tail alone, and its user is
queued here so that the builder writes a state from the events it holds. Two forms, beside the
event log:

- a file of JSON lines ``{"rebuild": <user>}`` next to the file log (``<event_path>.rebuild``),
  read forward from an offset as the event file is;
- a Redis set ``<event_stream>:rebuild`` (``SADD``; the builder takes members with ``SPOP``).

The lookup step never writes on its request path: :class:`RebuildQueue` collects users in memory
(a bounded set) and a daemon thread hands them to the sink every ``flush_s``. A failing sink loses
that round's users (counted); they are queued again by their next request.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

LOGGER = logging.getLogger(__name__)

REBUILD_FILE_SUFFIX = ".rebuild"
REBUILD_SET_SUFFIX = ":rebuild"


class RebuildSink(Protocol):
    """Where rebuild requests go and whence the builder takes them."""

    def add(self, users: Iterable[int]) -> None:
        """Queue ``users`` for a rebuild."""
        ...

    def take(self) -> np.ndarray:
        """The users queued since the last call (int64, each once)."""
        ...


class FileRebuilds:
    """Rebuild requests as JSON lines in a file beside the event log."""

    def __init__(self, path: Path, max_line_bytes: int = 256) -> None:
        self.path, self.offset, self.max_line_bytes = Path(path), 0, max_line_bytes
        self.refused = 0

    def add(self, users: Iterable[int]) -> None:
        """Append one line per user (one write)."""
        text = "".join(json.dumps({"rebuild": int(u)}) + "\n" for u in users)
        if text:
            with self.path.open("a") as fh:
                fh.write(text)

    def take(self, chunk_bytes: int = 1 << 20) -> np.ndarray:
        """The users of the whole lines appended since the last call; malformed lines are counted."""
        if not self.path.exists():
            return np.zeros(0, np.int64)
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read(chunk_bytes)
        end = data.rfind(b"\n")
        if end < 0:
            return np.zeros(0, np.int64)
        self.offset += end + 1
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
            LOGGER.warning("user rebuild requests lost (%d users): %s", len(users), type(exc).__name__)
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
