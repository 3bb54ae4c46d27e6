"""The join's rules (windows, late positives, duplicates, out of order, unknown ids, down-sampling),
the feedback files' reader, and the joiner's commit and recovery on files."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recserve.backends.request_log.records import FEATURES, SCHEMAS, SCORES, Identity
from recserve.backends.request_log.segments import ParquetSegments
from recserve.backends.request_log.step_log import ScoreLog
from recserve.clients.feedback import FeedbackFile
from recserve.core.feedback import FeedbackEvent
from recserve.core.sections.base import SpecError
from recserve.core.sections.loop import LoopSection
from recserve.loop.join import Join, kept_negative
from recserve.loop.joiner import Joiner, example_segments, read_examples
from recserve.loop.metrics import join_samples, text
from recserve.loop.sources import FeedbackFiles, LogSegments
from recserve.loop.tables import EXAMPLES, examples_table, restore, snapshot

W, LATE = 10.0, 100.0


def features(request_id, rows, t, traffic="live"):
    return [
        {
            "request_id": request_id, "row": r, "time": t, "variant": "", "traffic": traffic, "keys": [r, 7],
            "dense": [0.5], "embedding_version": [1], "history_row": 0, "history": [3, 4] if r == 0 else None,
        }
        for r in range(rows)
    ]  # fmt: skip


def click(request_id, row, t, event="click"):
    return FeedbackEvent(request_id, row, event, t)


def labels(examples):
    return [(e["request_id"], e["row"], e["label"], e["late"]) for e in examples]


def test_a_click_within_the_window_is_a_positive_at_once_and_the_rest_close_as_negatives():
    join = Join(W, LATE)
    join.add_features(features("a", 3, 100.0))
    join.add_scores([{"request_id": "a", "row": 1, "score": 0.4, "dense_version": 2, "time": 100.0}])
    join.add_feedback([click("a", 1, 105.0)])
    first = join.take()
    assert labels(first) == [("a", 1, 1, False)]
    assert first[0]["score"] == 0.4 and first[0]["history"] == [3, 4]  # the request's history, resolved
    join.advance(109.9)
    assert join.take() == []
    join.advance(110.0)
    closed = join.take()
    assert labels(closed) == [("a", 0, 0, False), ("a", 2, 0, False)]
    assert closed[0]["labelled_at"] == 110.0 and closed[0]["score"] is None
    assert join.counts["positives"] == 1 and join.counts["negatives"] == 2


def test_a_click_after_the_window_re_emits_the_row_as_a_late_positive_until_the_late_horizon():
    join = Join(W, LATE)
    join.add_features(features("a", 2, 100.0))
    join.advance(111.0)
    join.add_feedback([click("a", 0, 150.0), click("a", 0, 151.0), click("a", 1, 100.0 + W + LATE + 1)])
    assert labels(join.take()) == [("a", 0, 0, False), ("a", 1, 0, False), ("a", 0, 1, True)]
    assert join.counts["late_positives"] == 1 and join.counts["duplicate_feedback"] == 1
    assert join.counts["unknown_feedback"] == 1  # past the late horizon
    # an open row clicked after W (not closed yet): the negative first, then the late positive
    join.add_features(features("b", 1, 200.0))
    join.add_feedback([click("b", 0, 200.0 + W + 5)])
    assert labels(join.take()) == [("b", 0, 0, False), ("b", 0, 1, True)]
    join.advance(200.0 + W + LATE)
    assert not join.closed and not join.open


def test_duplicates_out_of_order_unknown_and_shadow_are_counted_never_fatal():
    join = Join(W, LATE)
    join.add_feedback([click("a", 0, 101.0), click("ghost", 4, 101.0)])  # before their rows
    join.add_features(features("a", 1, 100.0))
    join.add_features(features("a", 1, 100.0))  # logged twice
    join.add_features(features("s", 2, 100.0, traffic="shadow"))
    join.add_feedback([click("s", 0, 101.0), click("a", 0, 102.0), click("a", 0, 103.0, "impression")])
    assert labels(join.take()) == [("a", 0, 1, False)]
    join.advance(100.0 + W + LATE + 2)
    assert join.take() == []
    counts = join.counts
    assert counts["out_of_order"] == 1 and counts["duplicate_records"] == 1 and counts["shadow_rows"] == 2
    assert counts["duplicate_feedback"] == 1 and counts["late_impressions"] == 1
    assert counts["unknown_feedback"] == 2  # the ghost, and the shadow row's click
    assert not join.waiting_feedback


def test_negatives_are_down_sampled_at_the_recorded_rate_the_same_on_every_run():
    join = Join(W, LATE, negative_rate=0.25)
    join.add_features(features("r", 4000, 100.0))
    join.add_feedback([click("r", r, 101.0) for r in range(0, 4000, 10)])
    join.advance(200.0)
    out = join.take()
    negatives = [e for e in out if e["label"] == 0]
    assert len([e for e in out if e["label"] == 1]) == 400  # every positive kept, at rate 1
    assert {e["sample_rate"] for e in out if e["label"] == 1} == {1.0}
    assert 0.22 < len(negatives) / 3600 < 0.28 and {e["sample_rate"] for e in negatives} == {0.25}
    assert join.counts["negatives"] + join.counts["negatives_sampled_out"] == 3600
    again = [r for r in range(4000) if r % 10 and kept_negative("r", r, 0.25)]
    assert [e["row"] for e in negatives] == again


def test_with_impressions_required_an_unshown_row_makes_no_example():
    join = Join(W, LATE, require_impression=True)
    join.add_features(features("a", 3, 100.0))
    join.add_feedback([click("a", 0, 101.0, "impression"), click("a", 1, 102.0)])
    join.advance(111.0)
    assert labels(join.take()) == [("a", 1, 1, False), ("a", 0, 0, False)]
    assert join.counts["unshown"] == 1


def test_a_restored_snapshot_joins_on_exactly_as_the_original():
    def fed(join):
        join.add_features(features("a", 5, 100.0))
        join.add_feedback([click("a", 1, 101.0), click("b", 0, 102.0)])
        join.add_scores([{"request_id": "c", "row": 0, "score": 0.5, "dense_version": 1, "time": 100.0}])
        join.advance(105.0)
        return join

    original = fed(Join(W, LATE, 0.5))
    original.take()
    copy = Join(W, LATE, 0.5)
    restore(copy, snapshot(original), original.counts)
    for join in (original, copy):
        join.add_features(features("b", 1, 100.5))
        join.add_feedback([click("a", 2, 150.0)])
        join.advance(300.0)
    assert labels(copy.take()) == labels(original.take()) and copy.counts == original.counts
    assert examples_table(original.emitted).schema == EXAMPLES


def test_feedback_naming_the_item_finds_the_row_that_scored_it_even_before_the_row_came():
    def by_item(request_id, item, t):
        return FeedbackEvent(request_id, -1, "click", t, item)

    join = Join(W, LATE, item_key=lambda item: item - 100 if item >= 0 else 1 / 0, target_slot=0)
    join.add_feedback([by_item("b", 101, 101.0)])  # before b's rows
    join.add_features(features("a", 3, 100.0))  # keys [row, 7]: the "target key" is the row
    join.add_feedback([by_item("a", 102, 101.0), by_item("a", 109, 101.0), by_item("a", -5, 101.0)])
    assert labels(join.take()) == [("a", 2, 1, False)]
    copy = Join(W, LATE, item_key=join.item_key, target_slot=0)
    restore(copy, snapshot(join), join.counts)  # the item index comes back with the rows
    copy.add_features(features("b", 2, 100.0))
    assert labels(copy.take()) == [("b", 1, 1, False)] and copy.counts["out_of_order"] == 1
    copy.advance(100.0 + W + LATE + 1)
    assert copy.counts["unknown_feedback"] == 2 and not copy.by_item  # item 109, and the refused id


def test_feedback_files_are_read_whole_lines_only_and_bad_lines_are_counted(tmp_path):
    folder = tmp_path / "feedback"
    FeedbackFile(folder / "a.jsonl").write([click("r", 0, 1.0)])
    with open(folder / "a.jsonl", "a") as handle:
        handle.write('{"request_id": "r", "row": 9, "event": "nope"}\n{"request_id": "r", "ro')
    source = FeedbackFiles(folder)
    assert source.poll() == [("feedback", [click("r", 0, 1.0)])] and source.refused == 1
    with open(folder / "a.jsonl", "a") as handle:
        handle.write('w": 1, "event": "click", "time": 2.0}\n')
    again = FeedbackFiles(folder)
    again.restore(json.loads(json.dumps(source.position())))
    assert again.poll() == [("feedback", [click("r", 1, 2.0)])]


def log_request(sink, request_id, rows, t, scores=True):
    """One request's two record kinds (or its features alone), as the steps log them, each in a segment."""
    records = features(request_id, rows, 0.0)
    columns = {name: [r.get(name) for r in records] for name in SCHEMAS[FEATURES].names if name != "time"}
    columns["time"] = pa.array([int(t * 1e6)] * rows, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    sink.add(FEATURES, pa.RecordBatch.from_pydict(columns, schema=SCHEMAS[FEATURES]))
    if scores:
        served = np.full(rows, 0.5, np.float32)
        sink.add(
            SCORES, ScoreLog.records(Identity(request_id), int(t * 1e6), served, np.ones(rows, np.int64))
        )
    sink.flush()


def make_joiner(tmp_path, now, score_wait_s=0.0):
    made = Joiner(
        Join(W, LATE, score_wait_s=score_wait_s),
        LogSegments(tmp_path / "log"),
        FeedbackFiles(tmp_path / "feedback"),
        tmp_path / "examples",
        1.0,
        lambda: now[0],
    )
    made.recover()
    return made


def test_a_joiner_started_again_goes_on_from_its_last_commit(tmp_path):
    now = [1000.0]
    sink = ParquetSegments(tmp_path / "log", 1 << 30, 3600.0)
    feedback = FeedbackFile(tmp_path / "feedback" / "f.jsonl")
    first = make_joiner(tmp_path, now)
    log_request(sink, "a", 4, 1000.0)
    feedback.write([click("a", 1, 1001.0)])
    first.step()
    first.commit()  # a/1's positive; a/0, a/2, a/3 held open in the state
    log_request(sink, "b", 2, 1002.0)  # read by the first joiner, never committed: it dies
    first.step()
    second = make_joiner(tmp_path, now)  # from the checkpoint: a's rows held, b's not read yet
    feedback.write([click("b", 0, 1003.0)])
    now[0] = 1013.0
    second.step()
    second.commit()
    feedback.write([click("a", 2, 1020.0)])  # late
    second.step()
    second.commit()
    got = labels(read_examples(tmp_path / "examples").to_pylist())
    assert sorted(got) == sorted(
        [("a", 1, 1, False), ("a", 0, 0, False), ("a", 2, 0, False), ("a", 3, 0, False), ("b", 0, 1, False),
         ("b", 1, 0, False), ("a", 2, 1, True)]
    )  # fmt: skip
    assert len(example_segments(tmp_path / "examples")) == 3
    assert not list((tmp_path / "examples").rglob(".*.tmp"))


def test_a_segment_written_after_the_last_checkpoint_is_removed_and_its_examples_come_again(tmp_path):
    now = [1000.0]
    out = tmp_path / "examples"
    sink = ParquetSegments(tmp_path / "log", 1 << 30, 3600.0)
    first = make_joiner(tmp_path, now)
    log_request(sink, "a", 3, 1000.0)
    first.step()
    first.commit()
    checkpoint = (out / ".state" / "checkpoint.json").read_bytes()
    state_files = {p.name: p.read_bytes() for p in (out / ".state").glob("*.parquet")}
    now[0] = 1011.0
    first.step()
    first.commit()  # three negatives in segment 2 ...
    assert len(example_segments(out)) == 1
    # ... but the process dies before its checkpoint lands: put the earlier one back
    (out / ".state" / "checkpoint.json").write_bytes(checkpoint)
    for name, data in state_files.items():
        (out / ".state" / name).write_bytes(data)
    second = make_joiner(tmp_path, now)
    assert example_segments(out) == []  # the uncommitted segment is gone
    second.step()
    second.commit()
    assert sorted(labels(read_examples(out).to_pylist())) == [("a", r, 0, False) for r in range(3)]
    assert pq.read_table(example_segments(out)[0]).schema == EXAMPLES


def test_the_joiner_declares_every_series_from_the_start_and_counts_into_them(tmp_path):
    now = [1000.0]
    joiner = make_joiner(tmp_path, now)
    first = text(join_samples(joiner))
    assert 'recserve_join_total{count="late_positives"} 0' in first
    assert first.count("# TYPE recserve_join_total counter") == 1
    sink = ParquetSegments(tmp_path / "log", 1 << 30, 3600.0)
    log_request(sink, "a", 2, 1000.0)
    joiner.step()
    joiner.commit()
    found = text(join_samples(joiner))
    assert (
        'recserve_join_total{count="rows"} 2' in found and 'recserve_join_held_rows{state="open"} 2' in found
    )
    assert "recserve_join_checkpoint 1" in found


def held(join):
    rows = {("open", k): (r.outcome, r.impressed, r.score) for k, r in join.open.items()}
    return rows | {("closed", k): (r.outcome, r.impressed, r.score) for k, r in join.closed.items()}


def test_each_commit_writes_what_changed_and_forgotten_rows_leave_with_their_files(tmp_path):
    now = [1000.0]
    sink = ParquetSegments(tmp_path / "log", 1 << 30, 3600.0)
    feedback = FeedbackFile(tmp_path / "feedback" / "f.jsonl")
    joiner = make_joiner(tmp_path, now)
    state = tmp_path / "examples" / ".state"
    log_request(sink, "a", 3, 1000.0)  # features and scores
    joiner.step()
    joiner.commit()
    feedback.write([click("a", 1, 1001.0)])
    joiner.step()
    joiner.commit()  # a/1's state changed: a mark, not the row again
    now[0] = 1011.0
    joiner.step()
    joiner.commit()  # a's windows closed
    assert sorted(p.name.split("-")[1] for p in state.glob("*.parquet")) == [
        "feedback.parquet", "marks.parquet", "marks.parquet", "rows.parquet", "scores.parquet"
    ]  # fmt: skip
    again = make_joiner(tmp_path, now)
    assert held(again.join) == held(joiner.join) and len(again.join.closed) == 3
    now[0] = 1000.0 + W + LATE
    log_request(sink, "b", 2, 1105.0)  # open until 1115
    joiner.step()
    joiner.commit()  # a's rows are forgotten: their files go
    assert sorted(p.name for p in state.glob("*rows.parquet")) == ["0000000004-rows.parquet"]
    assert not list(state.glob("*marks.parquet"))
    last = make_joiner(tmp_path, now)
    assert held(last.join) == held(joiner.join) and set(last.join.open) == {("b", 0), ("b", 1)}


def test_the_log_position_keeps_only_the_segments_of_the_last_hour(tmp_path):
    folder = tmp_path / "log" / "scores"
    folder.mkdir(parents=True)
    table = pa.Table.from_batches(
        [ScoreLog.records(Identity("r"), 0, np.ones(1, np.float32), np.ones(1, np.int64))]
    )
    for name in ("20260101T100000-1-000001", "20260101T103000-1-000002", "20260101T120000-1-000003"):
        pq.write_table(table, folder / f"{name}.parquet")
    source = LogSegments(tmp_path / "log")
    assert len(source.poll()) == 3
    position = json.loads(json.dumps(source.position()))
    assert position["scores"] == {"before": "20260101T110000", "done": ["20260101T120000-1-000003.parquet"]}
    again = LogSegments(tmp_path / "log")
    again.restore(position)
    assert again.poll() == []  # the older ones were read: never again
    pq.write_table(table, folder / "20260101T115959-2-000001.parquet")  # within the hour: still read
    assert len(again.poll()) == 1


def score(request_id, row, value=0.4, t=100.0):
    return {"request_id": request_id, "row": row, "score": value, "dense_version": 2, "time": t}


def test_a_click_waits_a_bounded_time_for_its_rows_score_record():
    join = Join(W, LATE, score_wait_s=2.0)
    join.advance(100.0)
    join.add_features(features("a", 4, 100.0))
    join.add_feedback([click("a", 0, 100.5), click("a", 1, 101.0)])
    assert join.take() == []  # no score yet: both wait
    join.add_scores([score("a", 0)])
    came = join.take()
    assert (
        labels(came) == [("a", 0, 1, False)] and came[0]["score"] == 0.4 and came[0]["labelled_at"] == 100.5
    )
    join.add_feedback([click("a", 1, 101.5)])  # a second click while it waits
    join.advance(102.9)
    assert join.take() == []
    join.advance(103.0)  # a/1's wait is over (from its click at 101.0): emitted without its score
    late = join.take()
    assert (
        labels(late) == [("a", 1, 1, False)] and late[0]["score"] is None and late[0]["labelled_at"] == 101.0
    )
    join.add_scores([score("a", 1)])
    join.advance(109.5)
    join.add_feedback([click("a", 2, 109.5)])  # the window ends while it waits: still a positive
    join.advance(110.0)
    assert labels(join.take()) == [("a", 3, 0, False)]
    join.advance(111.5)
    assert labels(join.take()) == [("a", 2, 1, False)]
    counts = join.counts
    assert counts["examples_without_score"] == 3 and counts["late_scores"] == 1  # a/1, a/2, a/3
    assert counts["duplicate_feedback"] == 1 and counts["positives"] == 3 and counts["negatives"] == 1


def test_without_a_wait_a_click_closes_its_row_at_once_and_a_restored_wait_goes_on():
    assert LoopSection().score_wait_seconds == 2.0
    with pytest.raises(SpecError, match="score_wait_seconds"):
        LoopSection(score_wait_seconds=-1.0).check()
    join = Join(W, LATE)
    join.add_features(features("a", 1, 100.0))
    join.add_feedback([click("a", 0, 101.0)])
    assert labels(join.take()) == [("a", 0, 1, False)] and join.counts["examples_without_score"] == 1
    waiting = Join(W, LATE, score_wait_s=5.0)
    waiting.advance(100.0)
    waiting.add_features(features("b", 2, 100.0))
    waiting.add_feedback([click("b", 0, 101.0), click("b", 1, 101.0)])
    copy = Join(W, LATE, score_wait_s=5.0)
    restore(copy, snapshot(waiting), waiting.counts)
    copy.now = waiting.now
    for join in (waiting, copy):
        join.add_scores([score("b", 0)])
        join.advance(106.0)
    assert labels(copy.take()) == labels(waiting.take()) == [("b", 0, 1, False), ("b", 1, 1, False)]
    assert copy.counts == waiting.counts and copy.counts["examples_without_score"] == 1


def test_a_joiner_killed_while_a_click_waits_emits_it_once_after_its_restart(tmp_path):
    now = [1000.0]
    sink = ParquetSegments(tmp_path / "log", 1 << 30, 3600.0)
    feedback = FeedbackFile(tmp_path / "feedback" / "f.jsonl")
    first = make_joiner(tmp_path, now, score_wait_s=3.0)
    log_request(sink, "a", 2, 1000.0, scores=False)
    feedback.write([click("a", 1, 1000.5)])
    first.step()
    first.commit()  # a/1 waits for its score, in the state
    assert first.join.open[("a", 1)].clicked_at == 1000.5
    second = make_joiner(tmp_path, now, score_wait_s=3.0)  # the first one dies
    assert second.join.open[("a", 1)].wait_until == 1003.5
    sink.add(
        SCORES,
        ScoreLog.records(Identity("a"), int(1000e6), np.full(2, 0.5, np.float32), np.ones(2, np.int64)),
    )
    sink.flush()
    now[0] = 1011.0
    second.step()
    second.commit()
    got = read_examples(tmp_path / "examples").to_pylist()
    assert sorted(labels(got)) == [("a", 0, 0, False), ("a", 1, 1, False)]
    assert all(e["score"] == 0.5 for e in got) and second.join.counts["examples_without_score"] == 0


def test_a_row_whose_closing_mark_was_dropped_with_its_file_does_not_come_back_open(tmp_path):
    """Rows first held in one state file close at different commits; the early mark's file goes first."""
    now = [1000.0]
    sink = ParquetSegments(tmp_path / "log", 1 << 30, 3600.0)
    joiner = make_joiner(tmp_path, now)
    log_request(sink, "a", 2, 1000.0)
    log_request(sink, "b", 2, 1050.0)
    joiner.step()
    joiner.commit()  # one rows file holds a's rows and b's, kept until b's are past the late horizon
    now[0] = 1011.0
    joiner.step()
    joiner.commit()  # a's windows closed: negatives, and a marks file of a's rows alone
    now[0] = 1061.0
    joiner.step()
    joiner.commit()  # b's
    now[0] = 1000.0 + W + LATE + 1.0
    log_request(sink, "c", 1, now[0])
    joiner.step()
    joiner.commit()  # a's marks file is past the horizon and goes; the rows file stays for b
    assert [kind for _, kind, _ in joiner.live] == ["rows", "marks", "rows"]
    again = make_joiner(tmp_path, now)  # started again: a's rows must not come back open
    assert held(again.join) == held(joiner.join)
    now[0] += W
    again.step()
    again.commit()
    emitted = labels(read_examples(tmp_path / "examples").to_pylist())
    assert sorted(emitted) == [
        ("a", 0, 0, False), ("a", 1, 0, False), ("b", 0, 0, False), ("b", 1, 0, False), ("c", 0, 0, False)
    ]  # fmt: skip
