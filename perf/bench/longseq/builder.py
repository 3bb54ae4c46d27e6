"""The user-state builder beside the load: ``recserve user-state run`` in its own process, fed events.

The builder reads the event log of the served repository's local store: at the start every load
user's history (what the stored states were built from), which it takes in before the load begins
and then waits, paused (SIGSTOP), outside the phases measured with it. During such a phase it runs
and new events arrive for the load users at a fixed rate (:class:`EventFeed`); each event's lag to
the state that includes it is measured from outside, by reading the store the servers read.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from recserve.backends.store.user_state.events import Events, append_events
from recserve.backends.store.user_state.states import UserStates
from recserve.build.synthetic_users import LongUsers


class BuilderProcess:
    """``recserve user-state run`` on ``folder`` (its event log and local store), paused between phases."""

    def __init__(self, spec_file: Path, repository: Path, folder: Path, report: Path) -> None:
        self.report = report
        command = [
            sys.executable, "-m", "recserve.cli", "--spec", str(spec_file), "user-state", "run",
            "--repository", str(repository), "--folder", str(folder), "--json", str(report),
        ]  # fmt: skip
        self.log = (folder / "builder.log").open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_built(self, database: Path, users: int, ttl_s: float, timeout_s: float = 180.0) -> float:
        """Wait until the builder has written a state for each of ``users`` users; the seconds it took.

        A state written by the builder expires ``ttl_s`` after its write, so it is told apart from
        the ones stored before the builder started by its expiry (read from the local store's file).
        """
        started, since = time.monotonic(), time.time() + ttl_s
        with closing(sqlite3.connect(database, timeout=30)) as db:
            while time.monotonic() - started < timeout_s:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"the builder exited with {self.process.returncode}; see {self.log.name}"
                    )
                (written,) = db.execute("SELECT COUNT(*) FROM states WHERE expires >= ?", (since,)).fetchone()
                if written >= users:
                    break
                time.sleep(0.5)
        return time.monotonic() - started

    def pause(self) -> None:
        """Stop the builder's process where it is (it costs no CPU until :meth:`resume`)."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Let the paused builder run again."""
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Resume and stop the builder (SIGTERM: it writes its report)."""
        if self.process.poll() is None:
            self.resume()
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class EventFeed:
    """New events for the load users at ``rate`` per second, and each one's lag to its state.

    Each event is appended to the log with its wall time; the store is read every ``poll_s`` for
    the users with events not yet in a state, and an event's lag ends at the first read that finds
    a state including it.
    """

    def __init__(
        self, log: Path, users: LongUsers, states: UserStates, rate: float, seed: int, poll_s: float = 0.05
    ) -> None:
        self.log, self.users, self.states, self.rate, self.poll_s = log, users, states, rate, poll_s
        self.rng = np.random.default_rng(seed)
        self.next_seq = {int(u): int(n) + 1 for u, n in zip(users.users, users.rows.lengths, strict=True)}
        self.lags_s: list[float] = []
        self.unbuilt = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin feeding (in a thread)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self, settle_s: float = 1.0) -> None:
        """Stop feeding; events still waiting after ``settle_s`` more are counted as not built."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30 + settle_s)

    def _run(self) -> None:
        pending: dict[int, list[tuple[int, float]]] = {}  # user: [(seq, appended at)]
        interval, due = 1.0 / self.rate, time.time()
        last_poll = 0.0
        settle_until = None
        while True:
            now = time.time()
            if self._stop.is_set() and settle_until is None:
                settle_until = now + 1.0
            if settle_until is None and now >= due:
                index = int(self.rng.integers(len(self.users.rows)))
                user = int(self.users.users[index])
                events = self.users.events(index)
                item, seq = int(events[self.rng.integers(events.size)]), self.next_seq[user]
                self.next_seq[user] = seq + 1
                append_events(self.log, Events.of([(user, seq, item, now)]))
                pending.setdefault(user, []).append((seq, now))
                due += interval
            if now - last_poll >= self.poll_s and pending:
                last_poll = now
                self._collect(pending, time.time())
            if settle_until is not None and (now >= settle_until or not pending):
                self.unbuilt += sum(len(v) for v in pending.values())
                return
            time.sleep(min(0.005, max(due - time.time(), 0.0)))

    def _collect(self, pending: dict[int, list[tuple[int, float]]], now: float) -> None:
        users = np.asarray(sorted(pending), np.int64)
        fetched = self.states.fetch(users)
        for user, state in zip(users.tolist(), fetched.states, strict=True):
            if state is None:
                continue
            waiting = pending[user]
            self.lags_s += [now - at for seq, at in waiting if seq <= state.seq]
            rest = [(seq, at) for seq, at in waiting if seq > state.seq]
            if rest:
                pending[user] = rest
            else:
                del pending[user]

    def summary(self) -> dict[str, Any]:
        """Events fed, their lag p50/p99 (seconds) and how many were not in a state in time."""
        lags = np.asarray(self.lags_s)
        p50, p99 = (float(v) for v in np.percentile(lags, [50, 99])) if lags.size else (None, None)
        return {
            "events": int(lags.size) + self.unbuilt,
            "lag_p50_s": p50,
            "lag_p99_s": p99,
            "unbuilt": self.unbuilt,
        }
