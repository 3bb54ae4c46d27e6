"""The request log: record schema, sampling, identity, queue and drop accounting, rotation, atomic segments,
the SDK's request ids and the access layer's variant headers."""

import dataclasses
import os
import re
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recserve.access import ProxyPorts, Upstream, envoy_config, validate, write_config
from recserve.backends.request_log.read import read_kind, read_log, segment_paths
from recserve.backends.request_log.records import FEATURES, SCHEMAS, SCORES, Identity, sampled
from recserve.backends.request_log.segments import ParquetSegments
from recserve.backends.request_log.step_log import (
    TAPPED_HISTORY,
    TAPPED_HISTORY_MASK,
    TAPPED_KEYS,
    FeatureLog,
    ScoreLog,
    open_writer,
)
from recserve.backends.request_log.writer import WRITER_NICE, Entry, RecordWriter
from recserve.clients.request_ids import part_ids, request_id_of
from recserve.core.names import (
    CANDIDATE_PREFIX,
    EMBEDDING_VERSION,
    SPARSE_EMBEDDINGS,
    SPARSE_KEYS,
    TARGET_KEY,
    TRAFFIC_HEADER,
    VARIANT_HEADER,
)
from recserve.core.sections.base import SpecError
from recserve.core.sections.logging import LOG_DIR_ENV, LOG_SAMPLE_RATE_ENV, LoggingSection
from recserve.core.sections.serving import AccessSection
from recserve.core.spec.parse import load_spec
from recserve.core.streams import stream_keys, stream_shard
from recserve.server.process import FORWARDED_HEADERS
from tests.triton_requests import Request
from tests.unit.helpers import two_behaviour_ctr_spec


def scores_batch(request_id: str, rows: int) -> pa.RecordBatch:
    return ScoreLog.records(
        Identity(request_id), 1_000, np.full(rows, 0.25, np.float32), np.ones(rows, np.int64)
    )


def test_sampling_is_decided_by_the_id_alone_at_about_the_rate():
    ids = [f"request-{i}" for i in range(20_000)]
    assert all(sampled(i, 1.0) for i in ids[:10]) and not any(sampled(i, 0.0) for i in ids[:10])
    share = np.mean([sampled(i, 0.1) for i in ids])
    assert 0.09 < share < 0.11
    assert [sampled(i, 0.1) for i in ids[:500]] == [sampled(i, 0.1) for i in ids[:500]]


def test_identity_reads_the_forwarded_headers_and_survives_junk():
    assert Identity.of("a", f'{{"{VARIANT_HEADER}": "canary", "{TRAFFIC_HEADER}": "shadow"}}') == Identity(
        "a", "canary", "shadow"
    )
    assert Identity.of("a", "not json") == Identity("a", "", "live")
    assert Identity.of("a", f'{{"{VARIANT_HEADER}": 3, "{TRAFFIC_HEADER}": "other"}}') == Identity("a")


def test_score_records_follow_the_schema():
    batch = scores_batch("r1", 3)
    assert batch.schema == SCHEMAS[SCORES]
    assert batch.column("row").to_pylist() == [0, 1, 2]
    assert {"request_id", "row", "score"} <= set(SCHEMAS[FEATURES].names) | set(SCHEMAS[SCORES].names)


def test_feature_records_hold_the_served_keys_dense_values_and_each_history_once(spec, tmp_path):
    """The step taps its transform's keys into its outputs; the observer takes them out and logs them."""
    from recserve.backends.features.transform import FeatureTransform
    from recserve.build.synthetic import generate
    from recserve.clients import read_rows
    from recserve.clients.writers import write_tsv

    writer = RecordWriter(ParquetSegments(tmp_path / "log", 1 << 30, 3600.0), capacity=8)
    log = FeatureLog(spec, LoggingSection(enabled=True), writer)
    rows = read_rows(write_tsv(tmp_path / "rows.tsv", generate(spec, 4, seed=5), spec), spec)
    inputs = rows.to_inputs(spec)
    inputs[spec.sequences[0].name][2] = inputs[spec.sequences[0].name][0]  # row 2 shares row 0's history
    inputs[spec.sequence_length_input][2] = inputs[spec.sequence_length_input][0]
    features = FeatureTransform(spec).transform(inputs)
    outputs = {
        SPARSE_EMBEDDINGS: np.zeros((4, 2, 3), np.float32),
        EMBEDDING_VERSION: np.ones((1, len(spec.table_names)), np.int64),
        **log.tap(features),
    }
    log(Request("r"), inputs, outputs)
    assert set(outputs) == {SPARSE_EMBEDDINGS, EMBEDDING_VERSION}  # the tapped names are never sent
    writer.close()
    table = read_kind(tmp_path / "log", FEATURES).to_pydict()
    assert table["row"] == [0, 1, 2, 3]
    assert table["history_row"] == [0, 1, 0, 3] and table["history"][2] is None
    assert table["history"][0] is not None and len(table["history"][0]) == int(rows.lengths[0])
    assert table["keys"][1] == [*features[SPARSE_KEYS][1].tolist(), *features[TARGET_KEY][1].tolist()]


def test_requests_built_together_keep_their_own_rows_and_a_lists_history_is_on_its_users_first_row(
    spec, tmp_path
):
    writer = RecordWriter(ParquetSegments(tmp_path, 1 << 30, 3600.0), capacity=8)
    log = FeatureLog(spec, LoggingSection(enabled=True), writer)
    tables, keys = len(spec.table_names), len(spec.categorical.features) + len(spec.targets)
    served = {
        CANDIDATE_PREFIX + SPARSE_EMBEDDINGS: np.zeros((2, 3, 1)),
        EMBEDDING_VERSION: np.ones((1, tables)),
    }
    a_list = {  # two users, three candidates each; a history as wide as the bucket it was served in
        **served,
        TAPPED_KEYS: np.arange(6 * keys).reshape(6, keys),
        TAPPED_HISTORY: np.array([[7, 8, 0, 0], [7, 8, 9, 0]]),
        TAPPED_HISTORY_MASK: np.array([[1, 1, 0, 0], [1, 1, 1, 0]], np.float32),
    }
    rows = {  # rows of a narrower bucket, the first two with one history
        SPARSE_EMBEDDINGS: np.zeros((3, 1)),
        EMBEDDING_VERSION: np.full((1, tables), 2),
        TAPPED_KEYS: np.zeros((3, keys)),
        TAPPED_HISTORY: np.array([[5, 0], [5, 0], [5, 6]]),
        TAPPED_HISTORY_MASK: np.array([[1, 0], [1, 0], [1, 1]], np.float32),
    }
    log(Request("list"), {}, a_list)
    log(Request("rows"), {}, rows)
    assert TAPPED_KEYS not in a_list and TAPPED_HISTORY not in rows
    writer.close()
    table = read_kind(tmp_path, FEATURES).to_pydict()
    assert table["request_id"] == ["list"] * 6 + ["rows"] * 3
    assert table["row"] == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert table["history_row"] == [0, 0, 0, 3, 3, 3, 0, 0, 2]
    assert table["history"] == [[7, 8], None, None, [7, 8, 9], None, None, [5], None, [5, 6]]
    assert table["embedding_version"][0] == [1] * tables and table["embedding_version"][8] == [2] * tables
    assert table["keys"][5] == list(range(5 * keys, 6 * keys))


def logged_histories(spec, folder, history, mask) -> dict:
    """The features records of one row-layout request whose tapped history and mask are these."""
    writer = RecordWriter(ParquetSegments(folder, 1 << 30, 3600.0), capacity=8)
    rows, keys = len(history), len(spec.categorical.features) + len(spec.targets)
    outputs = {
        SPARSE_EMBEDDINGS: np.zeros((rows, 1)),
        EMBEDDING_VERSION: np.ones((1, len(spec.table_names))),
        TAPPED_KEYS: np.zeros((rows, keys)),
        TAPPED_HISTORY: np.array(history),
        TAPPED_HISTORY_MASK: np.array(mask, np.float32),
    }
    FeatureLog(spec, LoggingSection(enabled=True), writer)(Request("r"), {}, outputs)
    writer.close()
    return read_kind(folder, FEATURES).to_pydict()


def test_histories_with_the_same_keys_in_another_order_are_written_apart(spec, tmp_path):
    """The history digest is order-blind (a sum): each match is checked, so none is merged wrongly."""
    history = [[1, 2, 0], [2, 1, 0], [1, 2, 0], [0, 1, 2]]
    table = logged_histories(spec, tmp_path, history, [[1, 1, 0], [1, 1, 0], [1, 1, 0], [0, 1, 1]])
    assert table["history_row"] == [0, 1, 0, 0]  # the last: the same valid keys, in other places
    assert table["history"] == [[1, 2], [2, 1], None, None]


def test_each_behaviours_length_is_logged_and_histories_split_otherwise_are_written_apart(tmp_path):
    """Two attention groups (views, carts): the same keys in turn, split otherwise, are other histories."""
    history = [[1, 2, 3, 0], [1, 0, 2, 3], [1, 2, 3, 0]]  # views, then carts
    mask = [[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 0]]
    table = logged_histories(two_behaviour_ctr_spec(), tmp_path, history, mask)
    assert table["history"] == [[1, 2, 3], [1, 2, 3], None] and table["history_row"] == [0, 1, 0]
    assert table["history_lengths"] == [[2, 1], [1, 2], None]


def test_a_full_queue_drops_and_counts_never_blocks(tmp_path):
    sink = ParquetSegments(tmp_path, 1 << 30, 3600.0)
    release = threading.Event()
    writer = RecordWriter(sink, capacity=2)
    writer.offer(Entry(SCORES, 1, lambda _: (release.wait(10), scores_batch("held", 1))[1]))
    offered = [writer.offer(Entry(SCORES, 5, lambda _, i=i: scores_batch(f"r{i}", 5))) for i in range(6)]
    assert offered.count(False) >= 3
    release.set()
    writer.close()
    counts = writer.counts()
    assert counts["dropped"] == 5 * offered.count(False)
    assert counts["written"] + counts["dropped"] == 1 + 30
    assert {s.labels for s in writer.samples() if s.name == "recserve_log_records_total"} == {
        (("outcome", o),) for o in ("written", "dropped", "failed", "unidentified")
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_writer_thread_runs_at_the_lowest_cpu_priority_and_the_step_keeps_its_own(tmp_path):
    seen = []

    def build(_):  # runs on the writer thread
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return scores_batch("ok", 2)

    writer = RecordWriter(ParquetSegments(tmp_path, 1 << 30, 3600.0), capacity=8)
    writer.offer(Entry(SCORES, 2, build))
    writer.close()
    assert seen == [WRITER_NICE] and writer.counts()["written"] == 2
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < WRITER_NICE


def test_a_record_that_cannot_be_built_or_written_is_counted_as_failed(tmp_path):
    writer = RecordWriter(ParquetSegments(tmp_path, 1 << 30, 3600.0), capacity=8)
    writer.offer(Entry(SCORES, 4, lambda _: 1 / 0))
    writer.offer(Entry(SCORES, 2, lambda _: scores_batch("ok", 2)))

    def build(names):  # built together, the gathered requests fail together: then one by one
        return pa.concat_batches([scores_batch(n, 3) if n != "bad" else 1 / 0 for n in names])

    for name in ("a", "bad", "b"):
        writer.offer(Entry(SCORES, 3, build, name))
    writer.close()
    assert writer.counts() == {"written": 8, "dropped": 0, "failed": 7, "unidentified": 0}


def test_requests_without_an_id_or_not_sampled_are_not_logged(tmp_path):
    writer = RecordWriter(ParquetSegments(tmp_path, 1 << 30, 3600.0), capacity=8)
    log = ScoreLog(LoggingSection(enabled=True, sample_rate=0.0), writer)
    outputs = {"probability": np.zeros((3, 1), np.float32), "dense_version": np.ones((3, 1), np.int64)}
    log(Request(""), {}, outputs)
    log(Request("x"), {}, outputs)
    writer.close()
    assert writer.counts()["unidentified"] == 3 and writer.counts()["written"] == 0


def test_segments_rotate_by_size_and_by_time(tmp_path):
    now = [0.0]
    sink = ParquetSegments(tmp_path, segment_bytes=scores_batch("a", 100).nbytes * 2, segment_seconds=5.0,
                           clock=lambda: now[0])  # fmt: skip
    assert sink.add(SCORES, scores_batch("a", 100)) == 0
    assert sink.add(SCORES, scores_batch("b", 100)) == 200  # full: one segment
    assert sink.add(SCORES, scores_batch("c", 10)) == 0
    now[0] = 4.9
    assert sink.due() == 0
    now[0] = 5.0
    assert sink.due() == 10  # old enough: its own segment
    assert len(segment_paths(tmp_path, SCORES)) == 2
    assert read_kind(tmp_path, SCORES).num_rows == 210


@pytest.mark.parametrize("codec", ["snappy", "zstd", "none"])
def test_segments_are_written_with_the_specs_codec(tmp_path, codec):
    spec = load_spec("tiny")
    settings = dataclasses.replace(spec.logging, enabled=True, directory=str(tmp_path), compression=codec)
    writer = open_writer(settings)
    writer.offer(Entry(SCORES, 10, lambda parts: scores_batch("a", 10)))
    writer.close()
    (path,) = segment_paths(tmp_path, SCORES)
    written = pq.ParquetFile(path).metadata.row_group(0).column(0).compression
    assert written == {"none": "UNCOMPRESSED"}.get(codec, codec.upper())
    assert read_kind(tmp_path, SCORES).num_rows == 10


def test_a_segment_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    sink = ParquetSegments(tmp_path, 1 << 30, 3600.0)
    sink.add(SCORES, scores_batch("a", 10))

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OSError):
        sink.flush()
    assert segment_paths(tmp_path, SCORES) == [] and not any((tmp_path / SCORES).iterdir())
    (tmp_path / SCORES / ".left-by-a-killed-writer.parquet.tmp").write_bytes(b"PAR1")
    ParquetSegments(tmp_path, 1 << 30, 3600.0)  # the next writer clears it
    assert not any((tmp_path / SCORES).iterdir())


def test_read_log_joins_features_and_scores_by_request_and_row(tmp_path, spec):
    """Also across a segment written before ``history_lengths`` was (its lengths read as null)."""
    sink = ParquetSegments(tmp_path, 1 << 30, 3600.0)
    sink.add(SCORES, scores_batch("r", 2))
    sink.flush()
    columns = {
        "request_id": ["r", "r", "other"], "row": [1, 0, 0], "time": [0, 0, 0], "variant": [""] * 3,
        "traffic": ["live"] * 3, "keys": [[1], [2], [3]], "dense": [[0.5]] * 3,
        "embedding_version": [[1]] * 3, "history_row": [-1] * 3, "history": [None] * 3,
    }  # fmt: skip
    earlier = pa.schema([f for f in SCHEMAS[FEATURES] if f.name != "history_lengths"])
    (tmp_path / FEATURES).mkdir(exist_ok=True)
    pq.write_table(pa.table(columns, schema=earlier), tmp_path / FEATURES / "0-1-000001.parquet")
    joined = read_log(tmp_path).to_pydict()
    assert joined["request_id"] == ["r", "r"] and joined["row"] == [0, 1] and joined["keys"] == [[2], [1]]
    assert joined["score"] == [0.25, 0.25] and joined["history_lengths"] == [None, None]


def test_logging_settings_from_the_spec_and_the_serve_flags():
    with pytest.raises(SpecError, match="sample_rate"):
        LoggingSection(sample_rate=1.5).check()
    with pytest.raises(SpecError, match="sink"):
        LoggingSection(sink="kafka").check()
    with pytest.raises(SpecError, match="compression"):
        LoggingSection(compression="brotli").check()
    assert LoggingSection().from_environment({}) == LoggingSection()
    on = LoggingSection().from_environment({LOG_DIR_ENV: "/logs", LOG_SAMPLE_RATE_ENV: "0.25"})
    assert on.enabled and on.directory == "/logs" and on.sample_rate == 0.25
    with pytest.raises(SpecError, match=LOG_SAMPLE_RATE_ENV):
        LoggingSection().from_environment({LOG_DIR_ENV: "/logs", LOG_SAMPLE_RATE_ENV: "lots"})
    LoggingSection(sink="redis").check()
    for bad in ({"streams": 0}, {"stream_prefix": "a{b}"}, {"stream_max_len": 0}, {"stream_flush_ms": 0.0}):
        with pytest.raises(SpecError, match=next(iter(bad))):
            LoggingSection(sink="redis", **bad).check()


def test_a_request_id_has_one_stream_shard_and_ids_spread_over_them():
    ids = [f"request-{i}" for i in range(4000)]
    shards = [stream_shard(i, 4) for i in ids]
    assert shards == [stream_shard(i, 4) for i in ids] and {stream_shard(i, 1) for i in ids} == {0}
    assert all(900 < shards.count(s) < 1100 for s in range(4))
    assert stream_keys("rs:log", "scores", 2) == ["rs:log:scores:{0}", "rs:log:scores:{1}"]


def test_request_ids_are_the_callers_or_new_ones():
    assert request_id_of("mine-1") == "mine-1"
    made = request_id_of(None)
    assert len(made) == 32 and made != request_id_of(None)
    for bad in ("", "x" * 129, "tab\there", "é"):
        with pytest.raises(ValueError, match="request_id"):
            request_id_of(bad)
    assert part_ids("list", 1) == ["list"] and part_ids("list", 3) == ["list.0", "list.1", "list.2"]


def test_the_access_layer_names_the_variant_and_marks_shadow_copies(tmp_path):
    access = dataclasses.replace(AccessSection(), weights={"stable": 90, "canary": 10}, shadow_fraction=0.05)
    upstreams = {"stable": [Upstream(7001, 7000)], "canary": [Upstream(7101, 7100)]}
    config = envoy_config(access, upstreams, ProxyPorts(18001, 18000, 19901))
    assert "OK" in validate(write_config(config, tmp_path / "envoy.json"))
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    action = manager["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
    for entry in action["weighted_clusters"]["clusters"]:
        headers = {h["header"]["key"]: h["header"]["value"] for h in entry["request_headers_to_add"]}
        assert headers == {VARIANT_HEADER: entry["name"].split("_")[0], TRAFFIC_HEADER: "live"}
        assert {h["append_action"] for h in entry["request_headers_to_add"]} == {"OVERWRITE_IF_EXISTS_OR_ADD"}
    (mirror,) = action["request_mirror_policies"]
    marked = {
        m["append"]["header"]["key"]: m["append"]["header"]["value"]
        for m in mirror["request_headers_mutations"]
    }
    assert marked == {VARIANT_HEADER: access.shadow_variant, TRAFFIC_HEADER: "shadow"}
    assert re.search(FORWARDED_HEADERS, VARIANT_HEADER) and re.search(FORWARDED_HEADERS, TRAFFIC_HEADER)
    assert not re.search(FORWARDED_HEADERS, "recserve-admin-key") and not re.search(
        FORWARDED_HEADERS, "x-" + VARIANT_HEADER
    )
