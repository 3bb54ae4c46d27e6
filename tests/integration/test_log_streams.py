"""The Redis Streams sink on a real Redis Cluster: sharded, capped, read by a consumer group that resumes;
the joiner reading the log and the feedback from streams.

The step's writer thread sends records of many requests (each to the stream of its id's shard),
a consumer of a group reads part of them and dies without acknowledging; started again under the
same name it gets those entries again, then the rest, and nothing it acknowledged comes back.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from recserve.backends.request_log.records import FEATURES, SCHEMAS, SCORES, Identity
from recserve.backends.request_log.step_log import ScoreLog, open_writer
from recserve.backends.request_log.streams import RedisStreams, StreamGroup, cluster_client, read_records
from recserve.backends.request_log.writer import Entry
from recserve.clients.feedback import FeedbackStream
from recserve.core.feedback import FeedbackEvent
from recserve.core.sections.logging import LoggingSection
from recserve.core.streams import stream_keys, stream_shard
from recserve.loop.join import Join
from recserve.loop.joiner import Joiner, read_examples
from recserve.loop.sources import feedback_streams, log_streams
from recserve.perf.harness.redis_cluster import RedisCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RedisCluster(tmp_path_factory.mktemp("redis"), replicas=0) as running:
        yield running


def scores(request_id: str, rows: int) -> pa.RecordBatch:
    return ScoreLog.records(
        Identity(request_id), 1_000, np.arange(rows, dtype=np.float32) / rows, np.ones(rows, np.int64)
    )


def test_records_go_to_their_shard_and_a_consumer_that_dies_resumes(cluster):
    settings = LoggingSection(
        enabled=True, sink="redis", streams=3, stream_prefix="rs:test", stream_flush_ms=20
    )
    store = cluster.store_section()
    writer = open_writer(settings, store=store)
    ids = [f"request-{i}" for i in range(60)]
    for request_id in ids:
        writer.offer(Entry(SCORES, 4, lambda _, r=request_id: scores(r, 4)))
    writer.close()
    assert writer.counts() == {"written": 240, "dropped": 0, "failed": 0, "unidentified": 0}

    client = cluster_client(store)
    keys = stream_keys("rs:test", SCORES, 3)
    assert client.xlen(stream_keys("rs:test", FEATURES, 3)[0]) == 0
    per_shard: dict[str, set[str]] = {key: set() for key in keys}
    for key in keys:
        for _, fields in client.xrange(key):
            kind, table = read_records_of(key, fields)
            assert kind == SCORES
            per_shard[key].update(table["request_id"].to_pylist())
    for request_id in ids:  # each request's rows in the stream of its shard, and only there
        home = keys[stream_shard(request_id, 3)]
        assert [key for key, seen in per_shard.items() if request_id in seen] == [home]

    first = StreamGroup(client, keys, "joiner", "joiner-0", count=1)
    held = first.read()  # one entry of each stream, never acknowledged: the consumer dies
    assert len(held) == 3
    again = StreamGroup(cluster_client(store), keys, "joiner", "joiner-0", count=100)
    resumed = again.read()  # what it held, first
    assert [(e.stream, e.entry_id) for e in resumed] == [(e.stream, e.entry_id) for e in held]
    seen = {(e.stream, e.entry_id) for e in resumed}
    while batch := again.read():
        seen |= {(e.stream, e.entry_id) for e in batch}
    rows = 0
    done: dict[str, list[str]] = {}
    for stream, entry_id in seen:
        done.setdefault(stream, []).append(entry_id)
    total_entries = sum(client.xlen(key) for key in keys)
    assert len(seen) == total_entries
    for key in keys:
        for _, fields in client.xrange(key):
            rows += read_records_of(key, fields)[1].num_rows
    assert rows == 240
    assert again.ack(done) == total_entries
    after = StreamGroup(cluster_client(store), keys, "joiner", "joiner-0")
    assert after.read() == []  # acknowledged entries never come back


def test_a_stream_is_capped_and_records_sent_while_redis_is_away_count_as_failed(cluster):
    settings = LoggingSection(
        enabled=True, sink="redis", streams=1, stream_prefix="rs:cap", stream_max_len=10, stream_flush_ms=1
    )
    sink = RedisStreams(lambda: cluster_client(cluster.store_section()), "rs:cap", 1, 10, 0.001)
    for i in range(300):
        sink.add(SCORES, scores(f"r{i}", 1))
        assert sink.flush() == 1
    length = cluster_client(cluster.store_section()).xlen(stream_keys("rs:cap", SCORES, 1)[0])
    assert 10 <= length < 300  # MAXLEN ~: trimmed by whole nodes, never below the cap
    away = cluster.store_section(redis_nodes=("127.0.0.1:1",))
    writer = open_writer(settings, store=away)
    writer.offer(Entry(SCORES, 3, lambda _: scores("lost", 3)))
    writer.close()
    assert writer.counts() == {"written": 0, "dropped": 0, "failed": 3, "unidentified": 0}


def read_records_of(stream, fields):
    from recserve.backends.request_log.streams import StreamEntry

    got = read_records(StreamEntry(stream, "0-0", {k.decode(): v for k, v in fields.items()}))
    assert got is not None
    return got


def features_batch(request_id: str, rows: int, t: float) -> pa.RecordBatch:
    schema = SCHEMAS[FEATURES]
    columns = {
        "request_id": [request_id] * rows, "row": list(range(rows)), "variant": [""] * rows,
        "traffic": ["live"] * rows,
        "keys": [[r, 1] for r in range(rows)], "dense": [[0.5]] * rows, "embedding_version": [[1]] * rows,
        "history_row": [-1] * rows, "history": [None] * rows, "history_lengths": [None] * rows,
    }  # fmt: skip
    columns["time"] = pa.array([int(t * 1e6)] * rows, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    return pa.RecordBatch.from_pydict({name: columns[name] for name in schema.names}, schema=schema)


def test_the_joiner_reads_the_log_and_feedback_streams_and_resumes_its_group(cluster, tmp_path):
    settings = LoggingSection(enabled=True, sink="redis", streams=2, stream_prefix="rs:j", stream_flush_ms=1)
    store = cluster.store_section()
    writer = open_writer(settings, store=store)
    for k in range(4):
        writer.offer(Entry(FEATURES, 3, lambda _, k=k: features_batch(f"q{k}", 3, 1000.0)))
        writer.offer(Entry(SCORES, 3, lambda _, k=k: scores(f"q{k}", 3)))
    writer.close()
    client = cluster_client(store)
    feedback = FeedbackStream(client, "rs:jf", 2)
    feedback.write([FeedbackEvent("q1", 2, "click", 1001.0), FeedbackEvent("q3", 0, "click", 1002.0)])
    now = [1005.0]

    def joiner():
        made = Joiner(
            Join(10.0, 10.0),
            log_streams(cluster_client(store), "rs:j", 2, "c"),
            feedback_streams(cluster_client(store), "rs:jf", 2, "c"),
            tmp_path / "examples",
            1.0,
            lambda: now[0],
        )
        made.recover()
        return made

    first = joiner()
    first.step()
    first.commit()
    feedback.write([FeedbackEvent("q0", 1, "click", 1003.0)])
    first.step()  # read, never committed: the joiner dies
    second = joiner()
    now[0] = 1011.0
    second.step()
    second.commit()
    got = sorted(
        (e["request_id"], e["row"], e["label"]) for e in read_examples(tmp_path / "examples").to_pylist()
    )
    clicked = {("q1", 2), ("q3", 0), ("q0", 1)}
    assert got == sorted((f"q{k}", r, int((f"q{k}", r) in clicked)) for k in range(4) for r in range(3))
    assert next(iter(read_examples(tmp_path / "examples").to_pylist()))["score"] is not None
    assert all(client.xpending(key, "join")["pending"] == 0 for key in stream_keys("rs:j", FEATURES, 2))
