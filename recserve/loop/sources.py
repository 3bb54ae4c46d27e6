"""Where the joiner reads: the log (Parquet segments or Redis streams) and feedback (JSON lines or streams).

Every source hands out what is new (:meth:`poll`), says where it stands after everything handed out
(:meth:`position`, JSON-able, saved in the joiner's checkpoint), starts again from such a position
(:meth:`restore`), and is told when what it handed out is durable (:meth:`acknowledge`: a stream
source acknowledges its entries to the consumer group then, never before).
"""

from __future__ import annotations

import calendar
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import pyarrow.parquet as pq

from recserve.backends.request_log.read import segment_paths
from recserve.backends.request_log.records import KINDS, SCHEMAS
from recserve.backends.request_log.streams import StreamGroup, entry_order, read_records
from recserve.core.feedback import FEEDBACK, FeedbackError, FeedbackEvent, parse_feedback, parse_feedback_line
from recserve.core.streams import stream_keys
from recserve.loop.tables import records

LOGGER = logging.getLogger(__name__)
#: what one poll reads at most: segment files, feedback bytes
SEGMENTS_PER_POLL = 16
FEEDBACK_BYTES_PER_POLL = 4 << 20
#: a log segment is written and renamed within this long of the stamp it is named for (generously)
SETTLE_S = 3600
STAMP = "%Y%m%dT%H%M%S"
#: an item handed out: ("features" | "scores", records) or ("feedback", events)
Item = tuple[str, list[Any]]


class Source(Protocol):
    """What the joiner reads from (see the module)."""

    refused: int  # lines, entries or segments that were not records or feedback (skipped)

    def poll(self) -> list[Item]:
        """What is new."""
        ...

    def position(self) -> dict[str, Any]:
        """Where the next poll starts."""
        ...

    def restore(self, position: dict[str, Any]) -> None:
        """Start from ``position``."""
        ...

    def acknowledge(self) -> None:
        """Everything handed out so far is durable."""
        ...


def _stamp(name: str) -> float | None:
    """The seconds since the epoch a segment's name starts with (None: not a segment's name)."""
    try:
        return float(calendar.timegm(time.strptime(name[:15], STAMP)))
    except ValueError:
        return None


class LogSegments:
    """The Parquet log's finished segments (``<directory>/<kind>/*.parquet``), each read once.

    The position names the segments read, and a watermark: a segment is named for the time it was
    written (``<YYYYmmddTHHMMSS>-<pid>-<n>``) and appears as it is, so once a segment
    :data:`SETTLE_S` newer has been read, every older one has been, and the position keeps only
    the names since (it does not grow with the log).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.done: dict[str, set[str]] = {kind: set() for kind in KINDS}
        self.before = dict.fromkeys(KINDS, "")  # segments named before this stamp were all read
        self.refused = 0

    def poll(self) -> list[Item]:
        """What is new (see :class:`Source`)."""
        items: list[Item] = []
        budget = SEGMENTS_PER_POLL
        for kind in KINDS:
            for path in segment_paths(self.directory, kind):
                if path.name in self.done[kind] or path.name < self.before[kind] or budget == 0:
                    continue
                budget -= 1
                try:
                    table = pq.read_table(path, schema=SCHEMAS[kind])
                except Exception:  # not a segment of this schema: skipped, counted
                    LOGGER.exception("log segment %s could not be read", path)
                    self.refused += 1
                else:
                    items.append((kind, records(table)))
                self.done[kind].add(path.name)
        return items

    def position(self) -> dict[str, Any]:
        """Where the next poll starts."""
        for kind in KINDS:
            stamps = [_stamp(name) for name in self.done[kind]]
            newest = max((t for t in stamps if t is not None), default=None)
            if newest is not None:
                settled = time.strftime(STAMP, time.gmtime(newest - SETTLE_S))
                self.before[kind] = max(self.before[kind], settled)
                self.done[kind] = {n for n in self.done[kind] if n >= self.before[kind]}
        return {kind: {"before": self.before[kind], "done": sorted(self.done[kind])} for kind in KINDS}

    def restore(self, position: dict[str, Any]) -> None:
        """Start from ``position``."""
        self.before = {kind: str(position.get(kind, {}).get("before", "")) for kind in KINDS}
        self.done = {kind: set(position.get(kind, {}).get("done", ())) for kind in KINDS}

    def acknowledge(self) -> None:
        """Everything handed out so far is durable."""
        return None


class FeedbackFiles:
    """Feedback JSON lines in ``<directory>/*.jsonl``, read from a byte offset per file, whole lines only."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.offsets: dict[str, int] = {}
        self.refused = 0

    def poll(self) -> list[Item]:
        """What is new (see :class:`Source`)."""
        events: list[FeedbackEvent] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            start = self.offsets.get(path.name, 0)
            with open(path, "rb") as handle:
                handle.seek(start)
                data = handle.read(FEEDBACK_BYTES_PER_POLL)
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            for line in data[:end].splitlines():
                if not line.strip():
                    continue
                try:
                    events.append(parse_feedback_line(line))
                except FeedbackError as exc:
                    self.refused += 1
                    LOGGER.warning("%s: feedback line refused: %s", path.name, exc)
            self.offsets[path.name] = start + end
        return [(FEEDBACK, events)] if events else []

    def position(self) -> dict[str, Any]:
        """Where the next poll starts."""
        return dict(self.offsets)

    def restore(self, position: dict[str, Any]) -> None:
        """Start from ``position``."""
        self.offsets = {str(k): int(v) for k, v in position.items()}

    def acknowledge(self) -> None:
        """Everything handed out so far is durable."""
        return None


class Streams:
    """Sharded Redis streams read as one consumer of a group; entries acknowledged after the commit.

    The position is the last entry id applied per stream: after a restart, the consumer's
    unacknowledged entries come again (:class:`StreamGroup`), and those at or before the position
    (applied and committed, killed before the acknowledgement) are acknowledged, not applied twice.
    ``trimmed`` counts entries the stream's length cap removed before they were read (``refused``
    counts them too).
    """

    def __init__(self, group: StreamGroup, feedback: bool) -> None:
        self.group = group
        self.feedback = feedback
        self.last: dict[str, str] = {}
        self.unacknowledged: dict[str, list[str]] = {}
        self.refused = 0
        self.trimmed = 0

    def poll(self) -> list[Item]:
        """What is new (see :class:`Source`)."""
        items: list[Item] = []
        events: list[FeedbackEvent] = []
        for entry in self.group.read():
            self.unacknowledged.setdefault(entry.stream, []).append(entry.entry_id)
            seen = self.last.get(entry.stream)
            if seen is not None and entry_order(entry.entry_id) <= entry_order(seen):
                continue  # applied before the last commit
            self.last[entry.stream] = entry.entry_id
            if entry.fields is None:  # trimmed by the length cap before it was read
                self.trimmed += 1
                self.refused += 1
            elif self.feedback:
                try:
                    events.append(parse_feedback(entry.fields))
                except FeedbackError as exc:
                    self.refused += 1
                    LOGGER.warning("%s %s: feedback entry refused: %s", entry.stream, entry.entry_id, exc)
            else:
                try:
                    got = read_records(entry)
                except Exception:  # not the log's schema: skipped, counted
                    LOGGER.exception("%s %s: records entry refused", entry.stream, entry.entry_id)
                    got = None
                if got is None:
                    self.refused += 1
                else:
                    items.append((got[0], records(got[1])))
        if events:
            items.append((FEEDBACK, events))
        return items

    def position(self) -> dict[str, Any]:
        """Where the next poll starts."""
        return dict(self.last)

    def restore(self, position: dict[str, Any]) -> None:
        """Start from ``position``."""
        self.last = {str(k): str(v) for k, v in position.items()}

    def acknowledge(self) -> None:
        """Everything handed out so far is durable."""
        done, self.unacknowledged = self.unacknowledged, {}
        self.group.ack(done)


def log_streams(client: Any, prefix: str, shards: int, consumer: str) -> Streams:
    """The log's streams (features and scores of every shard), read by ``consumer`` of group ``join``."""
    keys = [key for kind in KINDS for key in stream_keys(prefix, kind, shards)]
    return Streams(StreamGroup(client, keys, "join", consumer), feedback=False)


def feedback_streams(client: Any, prefix: str, shards: int, consumer: str) -> Streams:
    """The feedback streams of every shard, read by ``consumer`` of group ``join``."""
    return Streams(
        StreamGroup(client, stream_keys(prefix, FEEDBACK, shards), "join", consumer), feedback=True
    )
