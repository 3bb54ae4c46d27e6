"""Feedback events: the documented form checked field by field, the SDK's sinks, the [loop] section."""

import asyncio
import json

import pytest

from recserve.clients import AsyncCTRClient
from recserve.clients.feedback import FeedbackFile, to_events
from recserve.core.feedback import FeedbackError, FeedbackEvent, parse_feedback, parse_feedback_line
from recserve.core.sections.base import SpecError
from recserve.core.sections.loop import LoopSection
from recserve.core.spec.parse import load_spec, parse_spec


def test_the_feedback_form_is_checked_field_by_field():
    event = parse_feedback({"request_id": "r1", "row": "3", "event": "click", "time": "12.5"})
    assert event == FeedbackEvent("r1", 3, "click", 12.5)
    assert parse_feedback_line(event.json_line()) == event
    assert parse_feedback({"request_id": "r", "row": 0, "event": "impression"}, now=7.0).time == 7.0
    by_item = parse_feedback({"request_id": "r", "item": "-12", "event": "click", "time": 1})
    assert by_item == FeedbackEvent("r", -1, "click", 1.0, -12)
    assert parse_feedback_line(by_item.json_line()) == by_item == parse_feedback(by_item.fields())
    for bad, field in [
        ({"row": 0, "event": "click"}, "request_id"),
        ({"request_id": "r", "row": -1, "event": "click"}, "row"),
        ({"request_id": "r", "row": True, "event": "click"}, "row"),
        ({"request_id": "r", "row": 0, "event": "view"}, "event"),
        ({"request_id": "r", "event": "click"}, "row or its item"),
        ({"request_id": "r", "row": 1, "item": 2, "event": "click"}, "row or its item"),
        ({"request_id": "r", "item": 1 << 64, "event": "click"}, "item"),
        ({"request_id": "r", "row": 0, "event": "click", "time": "nan"}, "time"),
        ({"request_id": "r\n", "row": 0, "event": "click"}, "request_id"),
    ]:
        with pytest.raises(FeedbackError, match=field):
            parse_feedback(bad)
    with pytest.raises(FeedbackError, match="JSON"):
        parse_feedback_line("{")
    assert to_events([("r", 2, "click")], now=5.0) == [FeedbackEvent("r", 2, "click", 5.0)]
    with pytest.raises(SpecError, match="negative_rate"):
        LoopSection(negative_rate=0.0).check()
    with pytest.raises(SpecError, match="feedback"):
        LoopSection(feedback="kafka").check()


def test_a_feedback_file_gets_whole_json_lines(tmp_path):
    sink = FeedbackFile(tmp_path / "feedback" / "a.jsonl")
    assert (
        sink.write(to_events([("r", 0, "impression", 1.0), {"request_id": "r", "row": 0, "event": "click"}]))
        == 2
    )
    lines = (tmp_path / "feedback" / "a.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["impression", "click"]


def test_the_loop_section_in_a_spec():
    doc = dict(load_spec("ctr").source)
    doc["loop"] = {"window_seconds": 60.0, "negative_rate": 0.1, "feedback": "redis"}
    loop = parse_spec(doc).loop
    assert loop.window_seconds == 60.0 and loop.negative_rate == 0.1 and loop.feedback == "redis"
    doc["loop"] = {"window": 60}
    with pytest.raises(SpecError, match="window"):
        parse_spec(doc)


def test_the_async_client_reports_feedback_on_a_worker_thread(tmp_path):
    sink = FeedbackFile(tmp_path / "a.jsonl")
    client = AsyncCTRClient("127.0.0.1:1", feedback=sink)
    assert asyncio.run(client.report_feedback([("r", 1, "click", 3.0)])) == 1
    assert parse_feedback_line((tmp_path / "a.jsonl").read_text()) == FeedbackEvent("r", 1, "click", 3.0)
    with pytest.raises(ValueError, match="feedback sink"):
        asyncio.run(AsyncCTRClient("127.0.0.1:1").report_feedback([("r", 1, "click")]))
