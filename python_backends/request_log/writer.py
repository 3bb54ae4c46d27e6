"""The step's side of the log: a bounded in-memory queue and one background writer thread.

A step hands each logged request over with :meth:`RecordWriter.offer` and never waits: when the
queue is full the request's records are dropped and counted, never the request. The writer thread
builds the records (the part that costs: columns, keys) and hands them to the sink (:class:`Sink`:
Parquet segments, :class:`~recserve.backends.request_log.segments.ParquetSegments`, or Redis
Streams, :class:`~recserve.backends.request_log.streams.RedisStreams`). Every record ends in
one outcome of ``recserve_log_records_total{outcome}``: ``written`` (in a segment on disk),
``dropped`` (the queue was full), ``failed`` (building or writing failed), ``unidentified`` (the
request had no id, so its records could never be joined: not logged).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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


class Sink(Protocol):
    """Where the writer thread hands built batches; a Kafka or NATS sink would be one more of these.

    ``add`` keeps a batch and may write; ``due`` writes what has waited long enough; ``flush`` writes
    everything kept. Each returns the rows it wrote; on failure it raises, having dropped what it
    tried to write (``pending_rows`` no longer counts them), so the writer counts them as failed.
    """

    def add(self, kind: str, batch: pa.RecordBatch) -> int:
        """Keep one request's records of ``kind``."""
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
    """One request's records, built on the writer thread."""

    kind: str
    rows: int
    build: Callable[[], pa.RecordBatch]


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
        while True:
            try:
                entry = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                self._write(self.sink.due)
                continue
            if entry is None:
                self._write(self.sink.flush)
                return
            try:
                batch = entry.build()
            except Exception:  # a record that cannot be built costs itself only
                LOGGER.exception("a logged request's records could not be built")
                self.count("failed", entry.rows)
                continue
            self._pending_rows += batch.num_rows
            self._write(lambda e=entry, b=batch: self.sink.add(e.kind, b))  # type: ignore[misc]
            self._write(self.sink.due)

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
        self._queue.put(None)
        self._thread.join(timeout_s)
