"""The joiner's tables: logged records in, training examples out, and its state as a snapshot.

The examples' schema (one row per example, Parquet segments of ``recserve join``):

| column | meaning |
| --- | --- |
| ``request_id``, ``row``, ``time``, ``variant`` | the served row (as logged) |
| ``label`` | 1: clicked, 0: not clicked within W |
| ``late`` | a positive for a click after W (the row was emitted before as a negative, or sampled out) |
| ``sample_rate`` | the rate the example was kept at: w for a negative, 1 for a positive |
| ``labelled_at`` | the click's time, or the window's end for a negative |
| ``keys``, ``dense``, ``embedding_version`` | the features as served |
| ``history``, ``history_lengths`` | the row's own history as served, and each sequence's length |
| ``score``, ``dense_version`` | the probability served and the dense version (null: its record never came) |
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from recserve.core.feedback import FeedbackEvent
from recserve.loop.join import Join, Key, Row

_TIME = pa.timestamp("us", tz="UTC")
EXAMPLES = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("row", pa.int32(), nullable=False),
        pa.field("time", _TIME, nullable=False),
        pa.field("variant", pa.string(), nullable=False),
        pa.field("label", pa.int8(), nullable=False),
        pa.field("late", pa.bool_(), nullable=False),
        pa.field("sample_rate", pa.float32(), nullable=False),
        pa.field("labelled_at", _TIME, nullable=False),
        pa.field("keys", pa.list_(pa.int64()), nullable=False),
        pa.field("dense", pa.list_(pa.float32()), nullable=False),
        pa.field("embedding_version", pa.list_(pa.int64()), nullable=False),
        pa.field("history", pa.list_(pa.int64())),
        pa.field("history_lengths", pa.list_(pa.int32())),
        pa.field("score", pa.float32()),
        pa.field("dense_version", pa.int64()),
    ]
)
#: the record columns a held row keeps (``time`` as seconds)
_RECORD = (
    "request_id", "row", "time", "variant", "traffic", "keys", "dense", "embedding_version", "history",
    "history_lengths",
)  # fmt: skip
ROWS = pa.schema(
    [
        pa.field("state", pa.string()),  # open or closed
        pa.field("outcome", pa.string()),
        pa.field("impressed", pa.bool_()),
        pa.field("score", pa.float64()),
        pa.field("dense_version", pa.int64()),
        pa.field("clicked_at", pa.float64()),  # a click waiting for the row's score (null: none)
        pa.field("wait_until", pa.float64()),
        pa.field("request_id", pa.string()),
        pa.field("row", pa.int32()),
        pa.field("time", pa.float64()),
        pa.field("variant", pa.string()),
        pa.field("traffic", pa.string()),
        pa.field("keys", pa.list_(pa.int64())),
        pa.field("dense", pa.list_(pa.float32())),
        pa.field("embedding_version", pa.list_(pa.int64())),
        pa.field("history", pa.list_(pa.int64())),
        pa.field("history_lengths", pa.list_(pa.int32())),
    ]
)
FEEDBACK_ROWS = pa.schema(
    [("request_id", pa.string()), ("row", pa.int32()), ("event", pa.string()), ("time", pa.float64()),
     ("item", pa.int64())]
)  # fmt: skip
SCORE_ROWS = pa.schema(
    [("request_id", pa.string()), ("row", pa.int32()), ("score", pa.float64()), ("dense_version", pa.int64()),
     ("time", pa.float64())]
)  # fmt: skip


def _seconds(column: pa.ChunkedArray) -> list[float]:
    return [v / 1e6 for v in pc.cast(column, pa.int64()).to_pylist()]


def records(table: pa.Table) -> list[dict[str, Any]]:
    """A logged table's rows as dicts, ``time`` in seconds since the epoch."""
    out = table.drop_columns(["time"]).to_pylist()
    for record, seconds in zip(out, _seconds(table["time"]), strict=True):
        record["time"] = seconds
    return out


def examples_table(examples: list[dict[str, Any]]) -> pa.Table:
    """Emitted examples (:meth:`Join.take`) as a table of :data:`EXAMPLES`."""
    columns = {}
    for name in EXAMPLES.names:
        if name in ("time", "labelled_at"):
            micros = [int(round(e[name] * 1e6)) for e in examples]
            columns[name] = pa.array(micros, pa.int64()).cast(_TIME)
        else:
            columns[name] = pa.array([e.get(name) for e in examples], EXAMPLES.field(name).type)
    return pa.Table.from_pydict(columns, schema=EXAMPLES)


MARKS = pa.schema(
    [ROWS.field(n) for n in ("request_id", "row", "state", "outcome", "impressed", "score", "dense_version",
                             "clicked_at", "wait_until")]
)  # fmt: skip


def _held(join: Join, keys: Iterable[Key]) -> list[tuple[str, Key, Row]]:
    out = []
    for key in keys:
        if key in join.open:
            out.append(("open", key, join.open[key]))
        elif key in join.closed:
            out.append(("closed", key, join.closed[key]))
    return out


def rows_table(join: Join, keys: Iterable[Key]) -> pa.Table:
    """The held rows of ``keys`` whole: their records and their state."""
    rows = [
        {"state": state, "outcome": row.outcome, "impressed": row.impressed, "score": row.score,
         "dense_version": row.dense_version, "clicked_at": row.clicked_at, "wait_until": row.wait_until,
         **{n: row.record.get(n) for n in _RECORD}}
        for state, _, row in _held(join, keys)
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=ROWS)


def marks_table(join: Join, keys: Iterable[Key]) -> pa.Table:
    """The state of the held rows of ``keys`` (window, outcome, impression, score), without their records."""
    rows = [
        {"request_id": key[0], "row": key[1], "state": state, "outcome": row.outcome,
         "impressed": row.impressed, "score": row.score, "dense_version": row.dense_version,
         "clicked_at": row.clicked_at, "wait_until": row.wait_until}
        for state, key, row in _held(join, keys)
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=MARKS)


def waiting_tables(join: Join) -> dict[str, pa.Table]:
    """The feedback and the score records waiting for their rows."""
    feedback = [
        {"request_id": e.request_id, "row": e.row, "event": e.event, "time": e.time, "item": e.item}
        for events in join.waiting_feedback.values()
        for e in events
    ]
    scores = [
        {"request_id": k[0], "row": k[1], "score": s, "dense_version": v, "time": t}
        for k, (s, v, t) in join.waiting_scores.items()
    ]
    return {
        "feedback": pa.Table.from_pylist(feedback, schema=FEEDBACK_ROWS),
        "scores": pa.Table.from_pylist(scores, schema=SCORE_ROWS),
    }


def snapshot(join: Join) -> dict[str, pa.Table]:
    """The join's whole held state as tables (rows open and closed, feedback and scores waiting)."""
    return {"rows": rows_table(join, [*join.open, *join.closed]), **waiting_tables(join)}


def load_rows(join: Join, table: pa.Table) -> None:
    """Hold the rows of a :func:`rows_table` (a row held already is replaced; a column it lacks: null)."""
    for item in table.to_pylist():
        row = Row({n: item.get(n) for n in _RECORD}, item["score"], item["dense_version"], item["impressed"])
        row.outcome = item["outcome"]
        _waiting(row, item)
        key = (item["request_id"], item["row"])
        join.open.pop(key, None)
        join.closed.pop(key, None)
        (join.open if item["state"] == "open" else join.closed)[key] = row


def apply_marks(join: Join, table: pa.Table) -> None:
    """Set the state a :func:`marks_table` holds on the rows held (rows forgotten since are passed over)."""
    for item in table.to_pylist():
        key = (item["request_id"], item["row"])
        row = join.open.pop(key, None) or join.closed.pop(key, None)
        if row is None:
            continue
        row.outcome, row.impressed = item["outcome"], item["impressed"]
        row.score, row.dense_version = item["score"], item["dense_version"]
        _waiting(row, item)
        (join.open if item["state"] == "open" else join.closed)[key] = row


def _waiting(row: Row, item: dict[str, Any]) -> None:
    """A held row's click waiting for its score (state written before the wait existed: none)."""
    row.clicked_at, row.wait_until = item.get("clicked_at"), item.get("wait_until") or 0.0


def load_waiting(join: Join, tables: dict[str, pa.Table]) -> None:
    """Put the :func:`waiting_tables` back."""
    for item in tables["feedback"].to_pylist():
        event = FeedbackEvent(item["request_id"], item["row"], item["event"], item["time"], item["item"])
        join.waiting_feedback.setdefault((event.request_id, event.row), []).append(event)
    for item in tables["scores"].to_pylist():
        join.waiting_scores[(item["request_id"], item["row"])] = (
            item["score"], item["dense_version"], item["time"]
        )  # fmt: skip


def restore(join: Join, tables: dict[str, pa.Table], counts: dict[str, int]) -> None:
    """Put a :func:`snapshot` (and the counts saved with it) back into an empty ``join``."""
    load_rows(join, tables["rows"])
    load_waiting(join, tables)
    join.counts.update({k: int(v) for k, v in counts.items() if k in join.counts})
    join.reindex()
