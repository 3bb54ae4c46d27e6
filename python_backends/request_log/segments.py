"""The Parquet sink: record batches gathered in memory, written as segment files, each atomically.

A segment is written under a hidden temporary name in its kind's folder (``<dir>/<kind>/``),
flushed to disk, then renamed to ``<time>-<pid>-<n>.parquet``: a reader that lists ``*.parquet``
never sees half a file, and a crash leaves at most a hidden ``.tmp`` file (never read; removed by
the next writer of that folder). Segments are compressed Parquet (``[logging] compression``:
snappy by default) that pyarrow, pandas and duckdb read as they are.

Segments rotate by size and by time: the sink keeps one kind's batches until they hold
``segment_bytes`` or the oldest is ``segment_seconds`` old, then writes them as one segment.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from recserve.backends.request_log.records import KINDS, SCHEMAS
from recserve.core.files import SCRATCH_SUFFIX, write_atomically

LOGGER = logging.getLogger(__name__)
SEGMENT_SUFFIX = ".parquet"
#: the columns of few distinct values, dictionary-encoded; the keys and scores are written plain
#: (dictionary-encoding hashed keys costs a third of the write and saves nothing)
DICTIONARY_COLUMNS = ["request_id", "variant", "traffic", "embedding_version", "dense_version"]


class ParquetSegments:
    """Record batches of each kind into rotated, atomically written Parquet segments under ``directory``.

    Not thread-safe: one writer thread calls it (:class:`~recserve.backends.request_log.writer.RecordWriter`).

    Args:
        directory: the log's folder; one sub-folder per record kind.
        segment_bytes: a kind's batches are written once they hold this many bytes.
        segment_seconds: ... or once the oldest of them is this old.
        compression: the segments' codec (``[logging] compression``).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        directory: Path,
        segment_bytes: int,
        segment_seconds: float,
        compression: str = "snappy",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self.compression = compression
        self.segment_bytes = segment_bytes
        self.segment_seconds = segment_seconds
        self.clock = clock
        self._pending: dict[str, list[pa.RecordBatch]] = {kind: [] for kind in KINDS}
        self._bytes = dict.fromkeys(KINDS, 0)
        self._since: dict[str, float | None] = dict.fromkeys(KINDS, None)
        self._count = 0
        self.segments_written = 0
        for kind in KINDS:
            folder = self.directory / kind
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.glob(f".*{SCRATCH_SUFFIX}"):  # a writer killed mid-segment
                stale.unlink(missing_ok=True)

    def add(self, kind: str, batch: pa.RecordBatch) -> int:
        """Keep ``batch``; write the kind's segment when it is full. Returns the rows written now."""
        if not self._pending[kind]:
            self._since[kind] = self.clock()
        self._pending[kind].append(batch)
        self._bytes[kind] += batch.nbytes
        if self._bytes[kind] >= self.segment_bytes:
            return self.flush(kind)
        return 0

    def pending_rows(self) -> int:
        """Rows kept in memory, not yet in a segment."""
        return sum(b.num_rows for batches in self._pending.values() for b in batches)

    def due(self) -> int:
        """Write every kind whose oldest batch is ``segment_seconds`` old. Returns the rows written."""
        now = self.clock()
        written = 0
        for kind, since in self._since.items():
            if since is not None and now - since >= self.segment_seconds:
                written += self.flush(kind)
        return written

    def flush(self, kind: str | None = None) -> int:
        """Write the batches of ``kind`` (None: of every kind) as one segment each. Returns the rows.

        Raises:
            OSError: the segment cannot be written (the batches are dropped: the caller counts them).
        """
        written = 0
        for name in KINDS if kind is None else (kind,):
            batches, self._pending[name] = self._pending[name], []
            self._bytes[name], self._since[name] = 0, None
            if batches:
                table = pa.Table.from_batches(batches, schema=SCHEMAS[name])
                self._write(name, table)
                written += table.num_rows
        return written

    def _write(self, kind: str, table: pa.Table) -> Path:
        self._count += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        name = f"{stamp}-{os.getpid()}-{self._count:06d}{SEGMENT_SUFFIX}"
        final = self.directory / kind / name
        write_atomically(
            final,
            lambda handle: pq.write_table(
                table, handle, compression=self.compression, use_dictionary=DICTIONARY_COLUMNS
            ),
            durable=True,
        )
        self.segments_written += 1
        return final
