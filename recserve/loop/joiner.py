"""``recserve join`` as a process: read, join, and commit examples and progress together.

Every ``commit_seconds`` the joiner commits: the examples emitted since the last commit go to one
new segment ``<examples>/examples-<seq>.parquet`` (written under a hidden name, fsynced, renamed),
then its state (the rows it holds, feedback waiting for its row) goes to ``<examples>/.state/``,
and last ``checkpoint.json`` names that ``seq``, the sources' positions and the counts (written
the same way: its rename is the commit). Only then are stream entries acknowledged.

Killed (``kill -9``) at any point and started again, it loads the last checkpoint, deletes the
segments written after it (their examples are emitted again from the restored state and the
inputs read again from the saved positions), and goes on: no example is lost, none is emitted twice.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from recserve.core.feedback import FEEDBACK
from recserve.core.files import SCRATCH_SUFFIX, write_atomically
from recserve.loop.join import Join
from recserve.loop.sources import Source
from recserve.loop.tables import (
    apply_marks,
    examples_table,
    load_rows,
    load_waiting,
    marks_table,
    rows_table,
    waiting_tables,
)

LOGGER = logging.getLogger(__name__)
STATE = ".state"
CHECKPOINT = "checkpoint.json"
SEGMENT = re.compile(r"examples-(\d{10})\.parquet")
#: the state a commit writes: the rows taken in since the last commit (whole), the changed state of
#: rows held before, and the feedback and scores waiting for their rows (whole, small)
ROWS_FILE, MARKS_FILE = "rows", "marks"
WAITING_FILES = ("feedback", "scores")
#: how long the joiner sleeps when nothing came
IDLE_S = 0.1
#: the joiner's outputs and state record its progress: each is written whole and synced before it counts
_durably = partial(write_atomically, durable=True)


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def example_segments(folder: Path) -> list[Path]:
    """The committed and uncommitted example segments of ``folder``, in order."""
    return sorted(p for p in Path(folder).glob("examples-*.parquet") if SEGMENT.fullmatch(p.name))


def committed_segments(folder: Path, after: int = 0) -> list[tuple[int, Path]]:
    """The segments the joiner's last checkpoint committed, numbered after ``after``, in order.

    A segment written but not committed yet (the joiner may be killed before its checkpoint and
    write those examples again) is left out: a reader following the joiner reads each example once.
    """
    path = Path(folder) / STATE / CHECKPOINT
    committed = int(json.loads(path.read_text())["seq"]) if path.exists() else 0
    out = []
    for segment in example_segments(folder):
        seq = int(SEGMENT.fullmatch(segment.name).group(1))  # type: ignore[union-attr]
        if after < seq <= committed:
            out.append((seq, segment))
    return out


def read_examples(folder: Path) -> pa.Table:
    """Every example in ``folder``'s segments, in the order they were emitted."""
    from recserve.loop.tables import EXAMPLES

    paths = example_segments(folder)
    if not paths:
        return EXAMPLES.empty_table()
    return pa.concat_tables([pq.read_table(p, schema=EXAMPLES) for p in paths])


class Joiner:
    """The long-running joiner: sources in, :class:`Join` in the middle, committed segments out.

    Args:
        join: the join (its rules: window, late horizon, rate w).
        log: the logged records' source.
        feedback: the feedback's source.
        output: the examples' folder (its state in ``.state/``).
        commit_s: how often it commits.
        clock: seconds since the epoch (the rows' times are the servers' clocks).
    """

    def __init__(
        self,
        join: Join,
        log: Source,
        feedback: Source,
        output: Path,
        commit_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.join = join
        self.log = log
        self.feedback = feedback
        self.output = Path(output)
        self.state = self.output / STATE
        self.commit_s = commit_s
        self.clock = clock
        self.seq = 0
        self.examples_written = 0
        self._dirty = False
        #: the state files the last checkpoint names: (commit, kind, its newest row's time)
        self.live: list[tuple[int, str, float]] = []
        self.state.mkdir(parents=True, exist_ok=True)

    # ---- recovery ------------------------------------------------------------------------
    def recover(self) -> int:
        """Start from the last checkpoint (none: from the start); the segments deleted as uncommitted."""
        checkpoint = self.state / CHECKPOINT
        if checkpoint.exists():
            saved = json.loads(checkpoint.read_text())
            self.seq = int(saved["seq"])
            self.log.restore(saved["log"])
            self.feedback.restore(saved["feedback"])
            self.examples_written = int(saved.get("examples", 0))
            self.log.refused = int(saved.get("refused", {}).get("log", 0))
            self.feedback.refused = int(saved.get("refused", {}).get("feedback", 0))
            self.live = [(int(seq), str(kind), float(until)) for seq, kind, until in saved["state"]]
            for seq, kind, _ in sorted(self.live, key=lambda e: (e[0], e[1] != ROWS_FILE)):
                table = pq.read_table(self.state / f"{seq:010d}-{kind}.parquet")
                (load_rows if kind == ROWS_FILE else apply_marks)(self.join, table)
            waiting = {n: pq.read_table(self.state / f"{self.seq:010d}-{n}.parquet") for n in WAITING_FILES}
            load_waiting(self.join, waiting)
            self.join.counts.update(
                {k: int(v) for k, v in saved.get("counts", {}).items() if k in self.join.counts}
            )
            self.join.now = float(saved.get("now", 0.0))
            # rows a kept file still holds, forgotten before the commit (closed, their mark dropped too)
            self.join.forget(self.join.now, restored=True)
            self.join.reindex()
            self.join.new_keys.clear()
            self.join.changed_keys.clear()
        self._remove_unreferenced()
        dropped = 0
        for path in example_segments(self.output):
            if int(SEGMENT.fullmatch(path.name).group(1)) > self.seq:  # type: ignore[union-attr]
                path.unlink()  # written, never committed: its examples come again
                dropped += 1
        for stale in (*self.output.glob(f".*{SCRATCH_SUFFIX}"), *self.state.glob(f".*{SCRATCH_SUFFIX}")):
            stale.unlink(missing_ok=True)
        if dropped:
            LOGGER.info("removed %d uncommitted example segment(s) after checkpoint %d", dropped, self.seq)
        return self.seq

    def _remove_unreferenced(self) -> None:
        """Delete the state files the checkpoint does not name (forgotten, or of an uncommitted commit)."""
        keep = {f"{seq:010d}-{kind}.parquet" for seq, kind, _ in self.live}
        keep |= {f"{self.seq:010d}-{name}.parquet" for name in WAITING_FILES}
        for path in self.state.glob("*.parquet"):
            if path.name not in keep:
                path.unlink(missing_ok=True)

    # ---- work ----------------------------------------------------------------------------
    def step(self) -> bool:
        """Read what is new from both sources, join it, close the windows due. Whether anything came.

        A source that cannot be read (Redis away) is logged and tried again at the next step.
        """
        came = False
        before = (dict(self.join.counts), self.log.refused, self.feedback.refused)
        for source in (self.log, self.feedback):
            try:
                items = source.poll()
            except Exception as exc:  # nothing was handed out: the same entries come next time
                LOGGER.warning("%s could not be read (%s); trying again", type(source).__name__, exc)
                items = []
            for kind, batch in items:
                came = True
                if kind == FEEDBACK:
                    self.join.add_feedback(batch)
                elif kind == "features":
                    self.join.add_features(batch)
                else:
                    self.join.add_scores(batch)
        self.join.advance(self.clock())
        after = (self.join.counts, self.log.refused, self.feedback.refused)
        self._dirty = self._dirty or came or bool(self.join.emitted) or after != before
        return came

    def commit(self) -> None:
        """Write the new examples, the state and the checkpoint (its rename commits); then acknowledge.

        A failure here (a full disk) is raised: the examples taken are no longer held, so the process
        must stop, and started again it emits them from the last checkpoint.
        """
        if not self._dirty:  # nothing applied since the last commit: what was handed out is committed
            self.log.acknowledge()
            self.feedback.acknowledge()
            return
        seq = self.seq + 1
        examples = self.join.take()
        if examples:
            table = examples_table(examples)
            _durably(
                self.output / f"examples-{seq:010d}.parquet",
                lambda h: pq.write_table(table, h, compression="zstd"),
            )
        join, horizon = self.join, self.join.window_s + self.join.late_s
        written: list[tuple[int, str, float]] = []
        for kind, keys, table_of in (
            (ROWS_FILE, join.new_keys, rows_table),
            (MARKS_FILE, join.changed_keys, marks_table),
        ):
            held = [k for k in keys if k in join.open or k in join.closed]
            if held:
                table = table_of(join, held)
                _durably(self.state / f"{seq:010d}-{kind}.parquet", partial(pq.write_table, table))
                until = max((join.open.get(k) or join.closed[k]).time for k in held)
                written.append((seq, kind, until))
        for name, table in waiting_tables(join).items():
            _durably(self.state / f"{seq:010d}-{name}.parquet", partial(pq.write_table, table))
        # a file whose newest row is past the late horizon holds only forgotten rows: no longer needed
        live = [entry for entry in self.live if entry[2] + horizon > join.now] + written
        written_total = self.examples_written + len(examples)
        saved = {
            "seq": seq,
            "log": self.log.position(),
            "feedback": self.feedback.position(),
            "examples": written_total,
            "counts": self.join.counts,
            "refused": {"log": self.log.refused, "feedback": self.feedback.refused},
            "state": live,
            "now": join.now,
        }
        _sync_folder(self.output)
        _durably(self.state / CHECKPOINT, lambda h: h.write(json.dumps(saved).encode()))
        _sync_folder(self.state)
        self.seq, self.examples_written, self._dirty, self.live = seq, written_total, False, live
        join.new_keys.clear()
        join.changed_keys.clear()
        self.log.acknowledge()
        self.feedback.acknowledge()
        self._remove_unreferenced()

    def run(self, stop: threading.Event, for_s: float | None = None) -> None:
        """Join until ``stop`` is set (or ``for_s`` elapsed), committing every ``commit_s`` and at the end."""
        self.recover()
        started = last = time.monotonic()
        while not stop.is_set() and (for_s is None or time.monotonic() - started < for_s):
            came = self.step()
            if time.monotonic() - last >= self.commit_s:
                self.commit()
                last = time.monotonic()
            if not came:
                stop.wait(IDLE_S)
        self.step()
        self.commit()
