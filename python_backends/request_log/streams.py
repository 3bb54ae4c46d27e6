"""The Redis Streams sink, and a consumer group reader of the loop's streams (records and events).

:class:`RedisStreams` is the second sink behind :class:`~recserve.backends.request_log.writer.RecordWriter`
(the first is :class:`~recserve.backends.request_log.segments.ParquetSegments`). It keeps the built
batches a short while (``stream_flush_ms``) and sends them in one pipeline: one stream entry per
kind and shard, holding that shard's rows as one Arrow IPC stream (fields ``kind``, ``rows``,
``arrow``), appended with ``XADD ... MAXLEN ~ stream_max_len``. A request's rows go to the shard of
its id (:func:`recserve.core.streams.stream_shard`), so no single stream (or slot) carries all.

:class:`StreamGroup` reads streams as one consumer of a consumer group: first the entries delivered
to it before and never acknowledged (a consumer that died and was started again under the same
name resumes with them), then new ones. It acknowledges only what its caller says is done.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from recserve.backends.request_log.records import SCHEMAS, conformed
from recserve.backends.store.redis_connect import connection_settings
from recserve.core.streams import stream_key, stream_shard

LOGGER = logging.getLogger(__name__)
#: a Redis call of the sink or a reader waits at most this long
SOCKET_TIMEOUT_S = 2.0


def cluster_client(store: Any, timeout_s: float = SOCKET_TIMEOUT_S) -> Any:
    """A Redis Cluster client of the ``[store]`` section's cluster (its nodes, credentials, TLS).

    Raises:
        ValueError: ``[store]`` names no Redis node.
    """
    from redis.cluster import ClusterNode, RedisCluster

    if not store.redis_nodes:
        raise ValueError("the loop's streams live on the [store] Redis Cluster: set [store] redis_nodes")
    nodes = [ClusterNode(host, int(port)) for host, _, port in (n.rpartition(":") for n in store.redis_nodes)]
    return RedisCluster(
        startup_nodes=nodes,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        require_full_coverage=False,
        **connection_settings(store),
    )


def encode_batches(batches: Sequence[pa.RecordBatch]) -> bytes:
    """Record batches of one schema as one Arrow IPC stream."""
    buffer = io.BytesIO()
    with pa.ipc.new_stream(buffer, batches[0].schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return buffer.getvalue()


def decode_table(data: bytes) -> pa.Table:
    """The table an entry's ``arrow`` field holds."""
    return pa.ipc.open_stream(data).read_all()


class RedisStreams:
    """Record batches sent to sharded Redis streams, a pipeline every ``flush_s`` at most.

    Not thread-safe: one writer thread calls it. The client is made on first use (and again after
    a failure), so a server starts while Redis is away and its records count as failed meanwhile.

    Args:
        connect: makes the Redis Cluster client.
        prefix: the streams' prefix (``<prefix>:<kind>:{<shard>}``).
        shards: streams per kind.
        max_len: entries kept per stream at most (approximately: ``MAXLEN ~``).
        flush_s: batches are sent once the oldest of them is this old.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        prefix: str,
        shards: int,
        max_len: int,
        flush_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connect = connect
        self.prefix = prefix
        self.shards = shards
        self.max_len = max_len
        self.flush_s = flush_s
        self.clock = clock
        self._client: Any = None
        self._pending: dict[tuple[str, int], list[pa.RecordBatch]] = {}
        self._since: float | None = None
        self.entries_written = 0

    def add(self, kind: str, batch: pa.RecordBatch) -> int:
        """Keep each request's records of ``batch`` for the shard of its request id. Returns 0."""
        if batch.num_rows == 0:
            return 0
        ids = batch.column(0).to_pylist()
        starts = [0, *(i for i in range(1, len(ids)) if ids[i] != ids[i - 1])]
        for start, end in zip(starts, [*starts[1:], len(ids)], strict=True):
            shard = stream_shard(str(ids[start]), self.shards)
            self._pending.setdefault((kind, shard), []).append(batch.slice(start, end - start))
        if self._since is None:
            self._since = self.clock()
        return 0

    def pending_rows(self) -> int:
        """Rows kept in memory, not yet sent."""
        return sum(b.num_rows for batches in self._pending.values() for b in batches)

    def due(self) -> int:
        """Send what is kept once the oldest batch is ``flush_s`` old. Returns the rows sent."""
        if self._since is not None and self.clock() - self._since >= self.flush_s:
            return self.flush()
        return 0

    def flush(self, kind: str | None = None) -> int:
        """Send the kept batches (of ``kind``; None: all) in one pipeline. Returns the rows sent.

        Raises:
            redis.RedisError: the pipeline failed (the batches are dropped: the caller counts them).
        """
        chosen = {key: b for key, b in self._pending.items() if kind is None or key[0] == kind}
        for key in chosen:
            del self._pending[key]
        if not self._pending:
            self._since = None
        if not chosen:
            return 0
        try:
            if self._client is None:
                self._client = self.connect()
            pipeline = self._client.pipeline(transaction=False)
            for (name, shard), batches in chosen.items():
                fields = {
                    "kind": name,
                    "rows": str(sum(b.num_rows for b in batches)),
                    "arrow": encode_batches(batches),
                }
                pipeline.xadd(
                    stream_key(self.prefix, name, shard), fields, maxlen=self.max_len, approximate=True
                )
            pipeline.execute()
        except BaseException:
            self._client = None  # connect again next time (a failover moves slots)
            raise
        self.entries_written += len(chosen)
        return sum(b.num_rows for batches in chosen.values() for b in batches)


@dataclass(frozen=True)
class StreamEntry:
    """One entry read from a stream: its stream, id and fields (None: trimmed away before it was read)."""

    stream: str
    entry_id: str
    fields: dict[str, bytes] | None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``) as a tuple that sorts as Redis orders them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class StreamGroup:
    """One consumer of a consumer group over several streams (each read and acknowledged on its own).

    The group is created where missing (reading from the start of each stream). :meth:`read` returns
    first the entries delivered to this consumer earlier and never acknowledged (what it held when
    it died), then new entries. Nothing is acknowledged until :meth:`ack`.

    Args:
        client: a Redis Cluster client.
        streams: the stream keys.
        group: the consumer group's name.
        consumer: this consumer's name (the same after a restart, to resume its entries).
        count: entries read per stream and call at most.
    """

    def __init__(self, client: Any, streams: Iterable[str], group: str, consumer: str, count: int = 100):
        from redis.exceptions import ResponseError

        self.client = client
        self.streams = list(streams)
        self.group = group
        self.consumer = consumer
        self.count = count
        for stream in self.streams:
            try:
                client.xgroup_create(stream, group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        # streams whose earlier deliveries are read again first, and from which id
        self._backlog = dict.fromkeys(self.streams, "0")

    def read(self) -> list[StreamEntry]:
        """Entries of every stream: the consumer's unacknowledged ones first, then new ones.

        When a read fails (Redis away), the entries delivered by this call are pending for this
        consumer: the next call starts again from its unacknowledged entries (a caller skips those
        it has applied, by id).
        """
        entries: list[StreamEntry] = []
        try:
            for stream in self.streams:
                got = self._read(stream)
                for entry_id, fields in got:
                    values = None if fields is None else {_text(k): v for k, v in fields.items()}
                    entries.append(StreamEntry(stream, _text(entry_id), values))
        except Exception:
            # what this call delivered is pending for this consumer: the next call reads it again
            self._backlog = dict.fromkeys(self.streams, "0")
            raise
        return entries

    def _read(self, stream: str) -> list[Any]:
        start = self._backlog.get(stream)
        if start is not None:
            answer = self.client.xreadgroup(self.group, self.consumer, {stream: start}, count=self.count)
            got = answer[0][1] if answer else []
            if got:
                self._backlog[stream] = _text(got[-1][0])
                return list(got)
            del self._backlog[stream]  # the backlog is read: new entries from now on
        answer = self.client.xreadgroup(self.group, self.consumer, {stream: ">"}, count=self.count)
        return list(answer[0][1]) if answer else []

    def ack(self, done: dict[str, list[str]]) -> int:
        """Acknowledge entries (stream -> ids); the count acknowledged."""
        acknowledged = 0
        for stream, ids in done.items():
            if ids:
                acknowledged += int(self.client.xack(stream, self.group, *ids))
        return acknowledged


def read_records(entry: StreamEntry) -> tuple[str, pa.Table] | None:
    """The kind and rows of a records entry (None: trimmed away, or not a records entry)."""
    if entry.fields is None or "arrow" not in entry.fields:
        return None
    kind = _text(entry.fields.get("kind", b""))
    if kind not in SCHEMAS:
        return None
    return kind, conformed(decode_table(entry.fields["arrow"]), kind)
