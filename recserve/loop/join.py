"""The join: logged rows paired with their feedback by request id and row, within a window W.

Plain Python, no I/O: :class:`Join` is fed the logged records (``features`` and ``scores``, see
:mod:`recserve.backends.request_log.records`) and feedback events (:mod:`recserve.core.feedback`)
in whatever order they arrive, and told the time (:meth:`Join.advance`). It emits training
examples (:meth:`Join.take`):

* a click within W of the row being served makes a **positive** at once when the row's score record
  is in; without it, the row waits for its score at most ``score_wait_s`` (of the join's clock,
  from when the click met its row), then is emitted without (counted ``examples_without_score``);
* a row whose window closes unclicked makes a **negative**, kept at the rate w
  (``negative_rate``, decided by a hash of request id and row, so the same on a replay); each
  example records its rate (``sample_rate``: w for a negative, 1 for a positive);
* a closed row is kept ``late_seconds`` more: a click in that time re-emits it as a positive
  (``late = true``, counted ``late_positives``); the learner sees both (the negative, then the
  positive);
* with ``require_impression``, a row that closes without an impression was not shown: no example
  (counted ``unshown``); a click counts as an impression.

Feedback may name the item instead of the row (``item``: the target's id): the join finds the row of
that request whose target key is the item's (``item_key`` makes the key as the step's transform
does, ``target_slot`` says where the target's key sits among a record's ``keys``).

Nothing is fatal, everything odd is counted (:data:`COUNTS`): feedback for a row not (yet) logged is
held until its own time + W + late (``out_of_order`` once its row comes, else ``unknown``); a
second click or impression of a row is ``duplicate_feedback``; a record logged twice is
``duplicate_records``; shadow traffic (``traffic = "shadow"``) is never an impression
(``shadow_rows``, its feedback ends ``unknown``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from recserve.core.feedback import CLICK, IMPRESSION, FeedbackEvent

#: What the join counts (each a Prometheus counter ``recserve_join_<name>_total`` of the joiner).
COUNTS = (
    "rows",  # logged live rows taken in
    "positives",
    "negatives",
    "negatives_sampled_out",  # closed unclicked, not kept at the rate w
    "late_positives",
    "unshown",  # closed without an impression (require_impression)
    "shadow_rows",
    "duplicate_records",
    "duplicate_feedback",
    "out_of_order",  # feedback that came before its row's record
    "unknown_feedback",  # feedback whose row never came (or had gone: too late)
    "late_impressions",  # an impression after the row's window closed
    "late_scores",  # a score record after its row's window closed
    "unknown_scores",  # a score record whose features never came
    "examples_without_score",  # emitted with no score record: none came in time (the wait, or W)
    "malformed_records",  # a features record not of the spec's shape (never held, never trained)
)
Key = tuple[str, int]


def kept_negative(request_id: str, row: int, rate: float) -> bool:
    """Whether the negative of (``request_id``, ``row``) is kept at ``rate``: the same answer on every run."""
    if rate >= 1.0:
        return True
    digest = hashlib.blake2b(f"{request_id}\x00{row}".encode(), digest_size=8, person=b"rs-negative").digest()
    return int.from_bytes(digest, "big") < rate * 2.0**64


@dataclass
class Row:
    """A logged row the join holds: its features record (``record``), its score, what happened to it."""

    record: dict[str, Any]  # the features columns (``time`` in seconds since the epoch)
    score: float | None = None
    dense_version: int | None = None
    impressed: bool = False
    # open: "" ; closed: "positive", "negative", "sampled_out" or "unshown"
    outcome: str = ""
    # a click waiting for the row's score record: the click's time, and the join's time it waits until
    clicked_at: float | None = None
    wait_until: float = 0.0

    @property
    def time(self) -> float:
        """When the row was served (seconds since the epoch)."""
        return float(self.record["time"])


@dataclass
class Join:
    """The join's state and its rules (see the module).

    Args:
        window_s: W, seconds.
        late_s: how long a closed row is kept for late clicks.
        negative_rate: w, the share of negatives kept.
        require_impression: only rows with an impression (or a click) make examples.
        item_key: an item id's target key (None: feedback naming an item is unknown).
        target_slot: the index of the (first) target's key in a record's ``keys``.
        score_wait_s: how long a clicked row waits for its score record at most (0: not at all).
        problem: what is wrong with a features record, its history resolved ("": nothing); one that
            is not of the spec's shape is counted and dropped (None: every record is taken).
    """

    window_s: float
    late_s: float
    negative_rate: float = 1.0
    require_impression: bool = False
    item_key: Callable[[int], int] | None = None
    target_slot: int = -1
    score_wait_s: float = 0.0
    problem: Callable[[dict[str, Any]], str] | None = None
    by_item: dict[tuple[str, int], int] = field(default_factory=dict)  # (request id, target key) -> row
    open: dict[Key, Row] = field(default_factory=dict)
    closed: dict[Key, Row] = field(default_factory=dict)
    waiting_feedback: dict[Key, list[FeedbackEvent]] = field(default_factory=dict)
    waiting_scores: dict[Key, tuple[float, int, float]] = field(default_factory=dict)  # score, version, time
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    emitted: list[dict[str, Any]] = field(default_factory=list)
    # since the last commit: rows taken in, and rows held before whose state changed (what a commit writes)
    new_keys: set[Key] = field(default_factory=set)
    changed_keys: set[Key] = field(default_factory=set)
    now: float = 0.0  # the time of the last advance

    # ---- input ---------------------------------------------------------------------------
    def add_features(self, records: list[dict[str, Any]]) -> None:
        """Take ``features`` records in (``time``: seconds); a row's history is taken from its request."""
        carriers = {(r["request_id"], r["row"]): r for r in records if r.get("history") is not None}
        for record in records:
            key = (str(record["request_id"]), int(record["row"]))
            if record.get("traffic") == "shadow":
                self.counts["shadow_rows"] += 1
                continue
            if key in self.open or key in self.closed:
                self.counts["duplicate_records"] += 1
                continue
            record = dict(record)
            history_row = int(record.pop("history_row", -1))
            if history_row >= 0 and record.get("history") is None:
                carrier = carriers.get((key[0], history_row), {})
                record["history"] = carrier.get("history")
                record["history_lengths"] = carrier.get("history_lengths")
            if self.problem is not None and self.problem(record):
                self.counts["malformed_records"] += 1
                continue
            row = Row(record)
            self.counts["rows"] += 1
            self.open[key] = row
            self.new_keys.add(key)
            self._index(key, row)
            score = self.waiting_scores.pop(key, None)
            if score is not None:
                row.score, row.dense_version = score[0], score[1]
            for event in self.waiting_feedback.pop(key, []):
                self.counts["out_of_order"] += 1
                self._feedback(key, event)
        for request_id in dict.fromkeys(str(r["request_id"]) for r in records):
            for event in self.waiting_feedback.pop((request_id, -1), []):  # named by item, before its row
                found = self._item_row(event)
                if found is None:
                    self.waiting_feedback.setdefault((request_id, -1), []).append(event)
                else:
                    self.counts["out_of_order"] += 1
                    self._feedback((request_id, found), replace(event, row=found, item=None))

    def _item_row(self, event: FeedbackEvent) -> int | None:
        """The row of the event's request that scored its item (None: not known, yet)."""
        if event.item is None or self.item_key is None:
            return None
        try:
            key = self.item_key(event.item)
        except Exception:  # an id the transform refuses: no row ever has it (ends unknown)
            return None
        return self.by_item.get((event.request_id, key))

    def _index(self, key: Key, row: Row) -> None:
        keys = row.record.get("keys") or []
        if self.item_key is not None and -len(keys) <= self.target_slot < len(keys):
            self.by_item.setdefault((key[0], int(keys[self.target_slot])), key[1])

    def reindex(self) -> None:
        """Rebuild the item index from the rows held (after a restore)."""
        self.by_item.clear()
        for held in (self.open, self.closed):
            for key, row in held.items():
                self._index(key, row)

    def add_scores(self, records: list[dict[str, Any]]) -> None:
        """Take ``scores`` records in (``time`` in seconds)."""
        for record in records:
            key = (str(record["request_id"]), int(record["row"]))
            if record.get("traffic") == "shadow":
                continue
            row = self.open.get(key)
            if row is not None:
                if row.score is not None:
                    self.counts["duplicate_records"] += 1
                row.score, row.dense_version = float(record["score"]), int(record["dense_version"])
                self._changed(key)
                if row.clicked_at is not None:  # its click waited for it
                    self._positive(key, row, row.clicked_at)
            elif key in self.closed:
                self.counts["late_scores"] += 1
            else:
                self.waiting_scores[key] = (
                    float(record["score"]), int(record["dense_version"]), float(record["time"])
                )  # fmt: skip

    def add_feedback(self, events: list[FeedbackEvent]) -> None:
        """Take feedback events in, in arrival order."""
        for event in events:
            row = self._item_row(event)
            if row is not None:
                event = replace(event, row=row, item=None)
            key = (event.request_id, event.row)
            if key in self.open or key in self.closed:
                self._feedback(key, event)
            else:
                self.waiting_feedback.setdefault(key, []).append(event)

    def _changed(self, key: Key) -> None:
        if key not in self.new_keys:
            self.changed_keys.add(key)

    def _feedback(self, key: Key, event: FeedbackEvent) -> None:
        self._changed(key)
        row = self.open.get(key)
        if row is not None and row.clicked_at is not None:  # clicked, waiting for its score
            self.counts["late_impressions" if event.event == IMPRESSION else "duplicate_feedback"] += 1
            return
        if row is not None and event.event == CLICK and event.time > row.time + self.window_s:
            self._close(key, row, row.time + self.window_s)  # clicked after W: the window had closed
            row = None
        if row is not None:
            if event.event == IMPRESSION:
                if row.impressed:
                    self.counts["duplicate_feedback"] += 1
                row.impressed = True
                return
            row.impressed = True
            if row.score is None and self.score_wait_s > 0:
                row.clicked_at, row.wait_until = event.time, max(self.now, event.time) + self.score_wait_s
                return
            self._positive(key, row, event.time)
            return
        row = self.closed[key]
        if event.event == IMPRESSION:
            self.counts["late_impressions"] += 1
        elif row.outcome == "positive":
            self.counts["duplicate_feedback"] += 1
        elif event.time > row.time + self.window_s + self.late_s:
            self.counts["unknown_feedback"] += 1  # past the late horizon
        else:
            self.counts["late_positives"] += 1
            self._emit(row, 1, True, event.time)
            row.outcome = "positive"

    def _positive(self, key: Key, row: Row, clicked_at: float) -> None:
        self._changed(key)
        self.counts["positives"] += 1
        self._emit(row, 1, False, clicked_at)
        row.outcome, row.clicked_at = "positive", None
        self.closed[key] = self.open.pop(key)

    # ---- time ----------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Close the windows that ended by ``now``; forget rows and waiting feedback past the late horizon.

        A clicked row waiting for its score is emitted once its wait ended (whatever W), not before.
        """
        self.now = max(self.now, now)
        for key, row in list(self.open.items()):
            if row.clicked_at is not None:
                if row.wait_until <= now:
                    self._positive(key, row, row.clicked_at)
            elif row.time + self.window_s <= now:
                self._close(key, row, row.time + self.window_s)
        self.forget(now)
        horizon = self.window_s + self.late_s
        for key, events in list(self.waiting_feedback.items()):
            if all(e.time + horizon <= now for e in events):
                self.counts["unknown_feedback"] += len(events)
                del self.waiting_feedback[key]
        for key, (_, _, served) in list(self.waiting_scores.items()):
            if served + horizon <= now:
                self.counts["unknown_scores"] += 1
                del self.waiting_scores[key]

    def forget(self, now: float, restored: bool = False) -> None:
        """Forget the closed rows past the late horizon at ``now`` (nothing is emitted or counted).

        ``restored`` (state loaded after a restart): the open ones past it too. A row open at a
        checkpoint is never past its window (the commit's advance closed those), so one past the
        horizon is a row whose closing mark was in a state file since dropped, as past the horizon
        itself: it was closed, and emitted, before.
        """
        horizon = self.window_s + self.late_s
        held = {**self.closed, **self.open} if restored else self.closed
        for key, row in list(held.items()):
            if row.time + horizon <= now:
                (self.closed if key in self.closed else self.open).pop(key)
                self.new_keys.discard(key)
                self.changed_keys.discard(key)
                keys = row.record.get("keys") or []
                if -len(keys) <= self.target_slot < len(keys):
                    self.by_item.pop((key[0], int(keys[self.target_slot])), None)

    def _close(self, key: Key, row: Row, at: float) -> None:
        self._changed(key)
        del self.open[key]
        self.closed[key] = row
        if self.require_impression and not row.impressed:
            row.outcome = "unshown"
            self.counts["unshown"] += 1
        elif kept_negative(key[0], key[1], self.negative_rate):
            row.outcome = "negative"
            self.counts["negatives"] += 1
            self._emit(row, 0, False, at)
        else:
            row.outcome = "sampled_out"
            self.counts["negatives_sampled_out"] += 1

    # ---- output --------------------------------------------------------------------------
    def _emit(self, row: Row, label: int, late: bool, at: float) -> None:
        if row.score is None:
            self.counts["examples_without_score"] += 1
        self.emitted.append(
            {
                **row.record,
                "label": label,
                "late": late,
                "sample_rate": 1.0 if label else self.negative_rate,
                "labelled_at": at,
                "score": row.score,
                "dense_version": row.dense_version,
            }
        )

    def take(self) -> list[dict[str, Any]]:
        """The examples emitted since the last call, in order."""
        out, self.emitted = self.emitted, []
        return out
