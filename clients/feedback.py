"""Reporting feedback (impressions and clicks of served rows) for the loop's joiner, from the SDK.

Two sinks, the two sources ``recserve join`` reads (``[loop] feedback``):

* :class:`FeedbackFile`: JSON lines appended to a ``.jsonl`` file in ``[loop] feedback_directory``
  (one ``write`` per call, whole lines, so the joiner never reads half a line);
* :class:`FeedbackStream`: entries of the Redis streams ``<prefix>:feedback:{<shard>}`` on the
  ``[store]`` Redis Cluster, each event on the shard of its request id.

Example::

    with CTRClient(url, feedback=feedback_sink(spec)) as client:
        scores = client.score_candidates(user, items)
        client.report_feedback([(client.last_request_ids[0], 3, "click")])
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from recserve.core.feedback import FEEDBACK, FeedbackEvent, parse_feedback
from recserve.core.spec.model import ModelSpec
from recserve.core.streams import stream_key, stream_shard

#: a feedback stream keeps this many entries per shard at most (XADD MAXLEN ~)
FEEDBACK_MAX_LEN = 1_000_000
#: what a report may name for each event: the event itself, its fields, or a tuple
#: ``(request_id, row, event)`` or ``(request_id, row, event, time)``
FeedbackLike = FeedbackEvent | Mapping[str, Any] | Sequence[Any]


class FeedbackSink(Protocol):
    """Where :meth:`CTRClient.report_feedback` writes."""

    def write(self, events: Sequence[FeedbackEvent]) -> int:
        """Write the events; how many."""
        ...


def to_events(given: Iterable[FeedbackLike], now: float | None = None) -> list[FeedbackEvent]:
    """Checked events from what a caller passed (an event without a time gets ``now``).

    Raises:
        FeedbackError: an event does not follow the form (:mod:`recserve.core.feedback`).
    """
    moment = time.time() if now is None else now
    events = []
    for item in given:
        if isinstance(item, FeedbackEvent):
            raw: Mapping[str, Any] = {
                "request_id": item.request_id, "row": item.row, "event": item.event, "time": item.time
            }  # fmt: skip
        elif isinstance(item, Mapping):
            raw = item
        else:
            raw = dict(zip(("request_id", "row", "event", "time"), item, strict=False))
        events.append(parse_feedback(raw, moment))
    return events


class FeedbackFile:
    """Feedback appended as JSON lines to ``path`` (its folder made when missing)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, events: Sequence[FeedbackEvent]) -> int:
        """Append the events in one write."""
        if not events:
            return 0
        data = "".join(e.json_line() for e in events).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        return len(events)


class FeedbackStream:
    """Feedback as entries of the sharded streams ``<prefix>:feedback:{<shard>}`` (one pipeline per write).

    Args:
        client: a Redis Cluster client (``redis.cluster.RedisCluster``).
        prefix: ``[loop] feedback_prefix``.
        shards: ``[loop] feedback_streams``.
    """

    def __init__(self, client: Any, prefix: str, shards: int, max_len: int = FEEDBACK_MAX_LEN) -> None:
        self.client = client
        self.prefix = prefix
        self.shards = shards
        self.max_len = max_len

    def write(self, events: Sequence[FeedbackEvent]) -> int:
        """XADD every event to its request's shard."""
        if not events:
            return 0
        pipeline = self.client.pipeline(transaction=False)
        for event in events:
            key = stream_key(self.prefix, FEEDBACK, stream_shard(event.request_id, self.shards))
            pipeline.xadd(key, event.fields(), maxlen=self.max_len, approximate=True)
        pipeline.execute()
        return len(events)


def feedback_sink(spec: ModelSpec, base: Path | None = None, name: str | None = None) -> FeedbackSink:
    """The sink ``[loop]`` names: a file in ``feedback_directory`` (under ``base``), or the streams.

    Args:
        spec: the model's spec (``[loop]``, and ``[store]`` for the Redis Cluster).
        base: a relative ``feedback_directory`` lies under it (None: the working folder).
        name: the file's name (None: ``<pid>.jsonl``, one file per reporting process).
    """
    loop = spec.loop
    if loop.feedback == "redis":
        from redis.cluster import ClusterNode, RedisCluster

        store = spec.store
        password = os.environ.get(store.redis_password_env, "") if store.redis_password_env else ""
        nodes = [ClusterNode(h, int(p)) for h, _, p in (n.rpartition(":") for n in store.redis_nodes)]
        client = RedisCluster(
            startup_nodes=nodes,
            username=store.redis_username or None,
            password=password or None,
            ssl=store.redis_ssl,
            ssl_ca_certs=store.redis_ssl_ca_certs or None,
        )
        return FeedbackStream(client, loop.feedback_prefix, loop.feedback_streams)
    folder = Path(loop.feedback_directory)
    if base is not None and not folder.is_absolute():
        folder = base / folder
    return FeedbackFile(folder / (name or f"{os.getpid()}.jsonl"))
