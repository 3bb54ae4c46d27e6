"""Feedback events: what happened to a served row afterwards (shown, clicked), the loop's labels.

The documented form, one event per row and happening, as a JSON object (a line of a ``.jsonl``
file) or as the fields of a Redis stream entry::

    {"request_id": "9f3c...", "row": 3, "event": "click", "time": 1767225600.25}

* ``request_id``: the id the request was served under (``Scores.request_id``; a candidate list
  sent in parts has ``<id>.0``, ``<id>.1``, ...: name the part, as ``client.last_request_ids`` lists them);
* ``row``: the row's index in that request (a candidate's position in its part); or, instead,
  ``item``: the item's id as the request sent it (the target feature's int64 value): the joiner finds
  the request's row that scored that item;
* ``event``: ``impression`` (the row was shown) or ``click``;
* ``time``: when it happened, seconds since the epoch (UTC); optional: the time it was reported.

Feedback is written by other systems: :func:`parse_feedback` refuses anything else with a
:class:`FeedbackError` naming the field, and readers count such lines instead of stopping.
(The user state's *behaviour events*, :mod:`recserve.backends.store.user_state.events`, are the
user's history, another stream.)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from recserve.errors import shorten

IMPRESSION = "impression"
CLICK = "click"
FEEDBACK_KINDS = (IMPRESSION, CLICK)
#: the kind name of feedback in stream keys (``<prefix>:feedback:{<shard>}``)
FEEDBACK = "feedback"
#: the longest request id a client sends (printable ASCII)
MAX_REQUEST_ID = 128
MAX_ROW = 1 << 20


class FeedbackError(ValueError):
    """A feedback event that does not follow the documented form."""


@dataclass(frozen=True)
class FeedbackEvent:
    """One feedback event (see the module)."""

    request_id: str
    row: int  # -1: named by ``item``
    event: str
    time: float
    item: int | None = None  # the target item's id, when the event names the item, not the row

    def _where(self) -> dict[str, int]:
        return {"row": self.row} if self.item is None else {"item": self.item}

    def fields(self) -> dict[str, str]:
        """As a Redis stream entry's fields (and, as JSON, a line of a feedback file)."""
        where = {name: str(value) for name, value in self._where().items()}
        return {"request_id": self.request_id, **where, "event": self.event, "time": repr(self.time)}

    def json_line(self) -> str:
        """As one line of a feedback file (with its newline)."""
        record = {"request_id": self.request_id, **self._where(), "event": self.event, "time": self.time}
        return json.dumps(record, separators=(",", ":")) + "\n"


def _text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def parse_feedback(raw: Mapping[str, Any], now: float | None = None) -> FeedbackEvent:
    """The event in ``raw`` (a parsed JSON object, or a stream entry's fields: text or bytes).

    Args:
        raw: the event's fields.
        now: the time of an event without one (None: this moment).

    Raises:
        FeedbackError: a field is missing, of the wrong kind or out of range.
    """
    if not isinstance(raw, Mapping):
        raise FeedbackError(f"a feedback event is an object, got {shorten(raw)}")
    values = {_text(k): _text(v) for k, v in raw.items()}
    request_id = values.get("request_id")
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID:
        raise FeedbackError(
            f"request_id: a text of 1..{MAX_REQUEST_ID} characters, got {shorten(request_id)}"
        )
    if not request_id.isprintable() or not request_id.isascii():
        raise FeedbackError(f"request_id: printable ASCII, got {shorten(request_id)}")
    row, item = _integer(values.get("row")), _integer(values.get("item"))
    if (row is None) == (item is None):
        raise FeedbackError("an event names its row or its item (one of the two)")
    if row is not None:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < MAX_ROW:
            raise FeedbackError(f"row: an integer in 0..{MAX_ROW - 1}, got {shorten(row)}")
    elif isinstance(item, bool) or not isinstance(item, int) or not -(1 << 63) <= item < 1 << 63:
        raise FeedbackError(f"item: an int64 item id, got {shorten(item)}")
    event = values.get("event")
    if event not in FEEDBACK_KINDS:
        raise FeedbackError(f"event: one of {', '.join(FEEDBACK_KINDS)}, got {shorten(event)}")
    when = values.get("time")
    if when is None:
        when = time.time() if now is None else now
    try:
        seconds = float(when) if not isinstance(when, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise FeedbackError(f"time: seconds since the epoch, got {shorten(when)}")
    return FeedbackEvent(request_id, -1 if row is None else row, str(event), seconds, item)


def _integer(value: Any) -> Any:
    """An integer written as text (a stream entry's field) as an int; anything else as it is."""
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def parse_feedback_line(line: str | bytes, now: float | None = None) -> FeedbackEvent:
    """The event of one JSON line.

    Raises:
        FeedbackError: the line is not JSON or not an event.
    """
    try:
        raw = json.loads(line)
    except ValueError:
        raise FeedbackError(f"not a JSON line: {shorten(line)}") from None
    return parse_feedback(raw, now)
