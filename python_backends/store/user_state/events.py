"""The append-only log of behaviour events the user-state builder consumes.

An event is ``(user, seq, item, ts)``: the user (an int64, or a string read as its
:func:`~recserve.core.user_state_wire.user_key`), the user's own event sequence number
(consecutive from 1), the item id (>= 0) and the event's wall time in seconds. With sequences
aligned to the items (a spec's ``positions``), an event also carries each of them by its feature's
name (``{"hist_cate_ids": 7}``: the item's category at that event), as an int64. Two forms:

- a file of JSON lines ``{"user": .., "seq": .., "item": .., "ts": ..}`` (the embedded default),
  read from a byte offset, whole lines only, so a writer may be appending while it is read;
- a Redis stream (``XADD`` with fields ``user``, ``seq``, ``item``, ``ts``), read with ``XREAD``.

The log is written by other systems: a line or entry that is not a well-formed event is skipped
and counted (``refused``), never fatal.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recserve.core.user_state_wire import user_key
from recserve.errors import shorten

LOGGER = logging.getLogger(__name__)
_FIELDS = ("user", "seq", "item", "ts")
_INT64 = (-(1 << 63), (1 << 63) - 1)
#: An event as a tuple: user, seq, item, ts and its attributes (the aligned sequences' values).
Event = tuple[int, int, int, float, tuple[int, ...]]


@dataclass(frozen=True)
class Events:
    """A batch of events as columns, in log order."""

    users: np.ndarray  # int64
    seqs: np.ndarray  # int64
    items: np.ndarray  # int64
    ts: np.ndarray  # float64, seconds since the epoch
    #: int64 [n, k]: each event's attributes, the aligned sequences' values (None: none)
    attributes: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.users.size)

    @classmethod
    def of(cls, rows: Iterable[tuple[int, int, int, float] | Event], attributes: int = 0) -> Events:
        """Events from ``(user, seq, item, ts)`` tuples, or with ``attributes`` columns their 5th."""
        table = list(rows)
        if not table:
            empty = np.zeros(0, np.int64)
            return cls(empty, empty, empty, np.zeros(0, np.float64), np.zeros((0, attributes), np.int64))
        users, seqs, items, ts = zip(*(r[:4] for r in table), strict=True)
        extra = [r[4] if len(r) > 4 else () for r in table]
        return cls(
            np.array(users, np.int64),
            np.array(seqs, np.int64),
            np.array(items, np.int64),
            np.array(ts, np.float64),
            np.array(extra, np.int64).reshape(len(table), attributes),
        )

    @property
    def attribute_rows(self) -> list[tuple[int, ...]]:
        """Each event's attributes as a tuple (empty tuples without)."""
        if self.attributes is None or not self.attributes.shape[1]:
            return [()] * len(self)
        return [tuple(row) for row in self.attributes.tolist()]

    def rows(self) -> list[tuple[int, int, int, float]]:
        """The events as ``(user, seq, item, ts)`` tuples."""
        return list(
            zip(self.users.tolist(), self.seqs.tolist(), self.items.tolist(), self.ts.tolist(), strict=True)
        )

    def fields(self, names: tuple[str, ...] = ()) -> list[dict[str, int | float]]:
        """Each event as the fields of its log entry (``names``: its attributes' names)."""
        values = self.attribute_rows
        return [
            {"user": u, "seq": s, "item": i, "ts": t, **dict(zip(names, a, strict=True))}
            for (u, s, i, t), a in zip(self.rows(), values, strict=True)
        ]


def parse_event(fields: dict[Any, Any], attributes: tuple[str, ...] = ()) -> Event:
    """One event from its fields (str or bytes keys and values); ``attributes``: the names it carries.

    Raises:
        ValueError: a field is missing or not a number, a number is out of range, seq < 1 or
            item < 0, or the user is not an integer or a string.
    """
    named = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
    try:
        user = user_key(named["user"])
        seq, item, *values = (int(named[k]) for k in (*_FIELDS[1:3], *attributes))
        ts = float(named["ts"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"not an event ({type(exc).__name__}: {shorten(exc, 80)}): {shorten(fields)}"
        ) from None
    if not (1 <= seq <= _INT64[1] and 0 <= item <= _INT64[1]):
        raise ValueError(f"seq >= 1 or item >= 0 out of range: {shorten(fields)}")
    if any(not _INT64[0] <= v <= _INT64[1] for v in values):
        raise ValueError(f"an attribute beyond int64: {shorten(fields)}")
    if not np.isfinite(ts):
        raise ValueError(f"ts is not finite: {shorten(fields)}")
    return user, seq, item, ts, tuple(values)


class FileEventLog:
    """A JSON-lines event file, read forward from where the last read stopped.

    ``attributes``: the names of the attributes every event carries (the aligned sequences).
    """

    def __init__(self, path: Path, max_line_bytes: int = 4096, attributes: tuple[str, ...] = ()) -> None:
        self.path = Path(path)
        self.offset = 0
        self.refused = 0
        self.max_line_bytes = max_line_bytes
        self.attributes = attributes

    def read(self, chunk_bytes: int = 8 << 20) -> Events:
        """The events of the whole lines appended since the last read (at most ``chunk_bytes`` of them)."""
        if not self.path.exists():
            return Events.of((), len(self.attributes))
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read(chunk_bytes)
        end = data.rfind(b"\n")
        if end < 0:  # nothing, or a line still being written
            return Events.of((), len(self.attributes))
        self.offset += end + 1
        rows = []
        for line in data[:end].split(b"\n"):
            if not line.strip():
                continue
            try:
                if len(line) > self.max_line_bytes:
                    raise ValueError(f"a line of {len(line)} bytes")
                decoded = json.loads(line)
                if not isinstance(decoded, dict):
                    raise ValueError("not an object")
                rows.append(parse_event(decoded, self.attributes))
            except ValueError as exc:
                self._refuse(str(exc))
        return Events.of(rows, len(self.attributes))

    def _refuse(self, why: str) -> None:
        self.refused += 1
        if self.refused <= 3 or self.refused % 1000 == 0:
            LOGGER.warning(
                "event log %s: line refused (%d so far): %s", self.path, self.refused, shorten(why)
            )


def append_events(path: Path, events: Events, attributes: tuple[str, ...] = ()) -> None:
    """Append events to a JSON-lines file (one write per call); ``attributes``: their names."""
    text = "".join(json.dumps(entry) + "\n" for entry in events.fields(attributes))
    with Path(path).open("a") as fh:
        fh.write(text)


class RedisEventLog:
    """A Redis stream of events, read forward with ``XREAD`` from the last entry read.

    ``attributes``: the names of the attributes every event carries (the aligned sequences).
    """

    def __init__(
        self, client: Any, stream: str, start: str = "0-0", attributes: tuple[str, ...] = ()
    ) -> None:
        self.client, self.stream, self.last_id = client, stream, start
        self.refused = 0
        self.attributes = attributes

    def read(self, limit: int = 10_000, block_ms: int | None = None) -> Events:
        """Up to ``limit`` entries after the last one read."""
        reply = self.client.xread({self.stream: self.last_id}, count=limit, block=block_ms)
        rows = []
        for _, entries in reply or ():
            for entry_id, fields in entries:
                self.last_id = entry_id
                try:
                    rows.append(parse_event(fields, self.attributes))
                except ValueError as exc:
                    self.refused += 1
                    LOGGER.debug("event stream %s: entry refused: %s", self.stream, exc)
        return Events.of(rows, len(self.attributes))

    def append(self, events: Events) -> None:
        """``XADD`` each event (pipelined)."""
        pipe = self.client.pipeline()
        for entry in events.fields(self.attributes):
            pipe.xadd(self.stream, entry)
        pipe.execute()
