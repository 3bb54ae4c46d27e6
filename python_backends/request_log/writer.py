"""The step's side of the log: a bounded in-memory queue and one background writer thread.

A step hands each logged request over with :meth:`RecordWriter.offer` and never waits: when the
queue is full the request's records are dropped and counted, never the request. The writer thread
wakes at most every ``LINGER_S``, takes every request queued, builds their records together (the
part that costs: columns, once for all of them) and hands them to the sink (:class:`Sink`:
Parquet segments, :class:`~recserve.backends.request_log.segments.ParquetSegments`, or Redis
Streams, :class:`~recserve.backends.request_log.streams.RedisStreams`). Every record ends in
one outcome of ``recserve_log_records_total{outcome}``: ``written`` (in a segment on disk),
``dropped`` (the queue was full), ``failed`` (building or writing failed), ``unidentified`` (the
request had no id, so its records could never be joined: not logged).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from recserve.backends.base.metrics import MetricSample

LOGGER = logging.getLogger(__name__)

OUTCOMES = ("written", "dropped", "failed", "unidentified")
RECORDS_METRIC = "recserve_log_records_total"
RECORDS_HELP = "Logged records (rows) by outcome: written, dropped (queue full), failed, unidentified (no id)"
DEPTH_METRIC = "recserve_log_queue_depth"
DEPTH_HELP = "Requests waiting in the log's queue for its writer"
#: how often the writer wakes to close segments that are due by time
POLL_S = 0.2
#: how long the writer lets requests gather once one is queued: their records are built together
#: (at 300 requests a second, about 60 a build: a third less of the writer's time a request than 15)
LINGER_S = 0.2
#: requests built together at most
GATHER = 256
#: the writer thread's nice value (Linux, where a thread has its own): the lowest CPU priority, so
#: that its bursts (a build, a segment's encoding) give way to the step's request threads and the
#: dense step's intra-op threads instead of delaying them (docs/design/loop.md, "Logging's latency")
WRITER_NICE = 19


class Sink(Protocol):
    """Where the writer thread hands built batches; a Kafka or NATS sink would be one more of these.

    ``add`` keeps a batch (the records of one request or more, each request's rows consecutive)
    and may write; ``due`` writes what has waited long enough; ``flush`` writes everything kept.
    Each returns the rows it wrote; on failure it raises, having dropped what it tried to write
    (``pending_rows`` no longer counts them), so the writer counts them as failed.
    """

    def add(self, kind: str, batch: pa.RecordBatch) -> int:
        """Keep records of ``kind`` (one request's or more: each request's rows consecutive)."""
        ...

    def due(self) -> int:
        """Write what is due by time."""
        ...

    def flush(self, kind: str | None = None) -> int:
        """Write everything kept (of ``kind``)."""
        ...

    def pending_rows(self) -> int:
        """Rows kept, not yet written."""
        ...


@dataclass(frozen=True)
class Entry:
    """One request's records, built on the writer thread.

    ``build`` makes the records of several requests at once from their ``part``s (what each
    request's observer copied), in order; the writer builds the entries queued together that share
    ``build`` in one call.
    """

    kind: str
    rows: int
    build: Callable[[Sequence[Any]], pa.RecordBatch]
    part: Any = None


class RecordWriter:
    """A bounded queue of :class:`Entry` and the thread that writes them to ``sink``.

    Args:
        sink: where the built batches go.
        capacity: entries (requests) waiting at most; past it :meth:`offer` drops.
    """

    def __init__(self, sink: Sink, capacity: int) -> None:
        self.sink = sink
        self._queue: queue.Queue[Entry | None] = queue.Queue(maxsize=capacity)
        self._counts = dict.fromkeys(OUTCOMES, 0)
        self._lock = threading.Lock()
        self._pending_rows = 0  # handed to the sink, not yet in a segment
        self._closing = threading.Event()  # set by close: stop letting requests gather
        self._thread = threading.Thread(target=self._run, name="recserve-request-log", daemon=True)
        self._thread.start()

    def count(self, outcome: str, rows: int) -> None:
        """Add ``rows`` records to ``outcome``."""
        with self._lock:
            self._counts[outcome] += rows

    def offer(self, entry: Entry) -> bool:
        """Queue ``entry`` without waiting; False (and counted as dropped) when the queue is full."""
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self.count("dropped", entry.rows)
            return False
        return True

    def counts(self) -> dict[str, int]:
        """Records by outcome so far."""
        with self._lock:
            return dict(self._counts)

    def samples(self) -> list[MetricSample]:
        """``recserve_log_records_total{outcome}`` (every outcome declared) and the queue depth."""
        counts = self.counts()
        return [
            *(
                MetricSample(RECORDS_METRIC, "counter", RECORDS_HELP, (("outcome", o),), float(n))
                for o, n in counts.items()
            ),
            MetricSample(DEPTH_METRIC, "gauge", DEPTH_HELP, (), float(self._queue.qsize())),
        ]

    def _run(self) -> None:
        if sys.platform.startswith("linux"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
            except OSError:  # a sandbox that forbids it: the writer runs at the step's priority
                LOGGER.warning("the request log's writer could not lower its CPU priority")
        while True:
            try:
                first = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                self._write(self.sink.due)
                continue
            if first is not None:
                self._closing.wait(LINGER_S)  # let the requests in flight join it
            entries, stop = self._gathered(first)
            start = 0
            for end in range(1, len(entries) + 1):  # runs of entries built by one call
                if end == len(entries) or entries[end].build is not entries[start].build:
                    self._add(entries[start:end])
                    start = end
            self._write(self.sink.flush if stop else self.sink.due)
            if stop:
                return

    def _gathered(self, first: Entry | None) -> tuple[list[Entry], bool]:
        """``first`` and the entries queued after it (up to :data:`GATHER`); whether to stop after them."""
        entries: list[Entry] = []
        entry: Entry | None = first
        while entry is not None:
            entries.append(entry)
            if len(entries) == GATHER:
                return entries, False
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                return entries, False
        return entries, True

    def _add(self, entries: Sequence[Entry]) -> None:
        """Build ``entries``' records in one call and hand them to the sink; a failure costs its own."""
        try:
            batch = entries[0].build([e.part for e in entries])
        except Exception:
            if len(entries) > 1:  # built one by one: only the entry that cannot be built is lost
                for entry in entries:
                    self._add([entry])
                return
            LOGGER.exception("a logged request's records could not be built")
            self.count("failed", entries[0].rows)
            return
        self._pending_rows += batch.num_rows
        self._write(lambda: self.sink.add(entries[0].kind, batch))

    def _write(self, step: Callable[[], int]) -> None:
        """Run a sink step; what it wrote counts as written, what a failure lost as failed."""
        try:
            written = step()
        except Exception:
            LOGGER.exception("a log segment could not be written")
            lost = self._pending_rows - self.sink.pending_rows()  # the batches the failed write held
            self._pending_rows -= lost
            self.count("failed", lost)
            return
        self._pending_rows -= written
        self.count("written", written)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued and kept, then stop the thread."""
        if not self._thread.is_alive():
            return
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout_s)
