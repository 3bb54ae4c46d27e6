"""The user-state builder: events in, states out, debounced per user, with its lag and rate measured.

It keeps each user's newest ``max_events`` events in memory (a restarted builder reads its log
again from the start). An event at or below the user's last sequence number is a replay and is
skipped. A user with new events is rebuilt once ``debounce_s`` has passed since the first of them,
so a burst of events costs one rebuild. The lag of an event is the time from its ``ts`` to the
write of the first state that includes it.

A write refused because a newer state is stored is normal while a restarted builder reads its log
again. Once the builder has read its log to the end, it looks at the users whose writes were
refused: a stored state that claims events beyond its user's newest in the log was not built from
the log (a value written into the store by something else). It is replaced by the state of the
user's events and counted, so no stored value can hold a user's state back until it expires.

A clustered state's groups were made in one key space (an item table version and a dense model).
:class:`Regrouping` tells the builder of a new one, and has it regroup its clustered users only when
their items' keys moved by more than ``[user_state] regroup_drift`` since their last grouping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from recserve.backends.store.user_state.events import Events
from recserve.backends.store.user_state.groups import Budget, KeySpace, build_state
from recserve.backends.store.user_state.state import CLUSTERED
from recserve.backends.store.user_state.states import UserStates

LOGGER = logging.getLogger(__name__)
_NONE = np.zeros(0, np.int64)


@dataclass
class _User:
    items: list[int] = field(default_factory=list)  # the newest events' items, oldest first
    attributes: list[tuple[int, ...]] = field(default_factory=list)  # theirs, with aligned sequences
    seq: int = 0  # the last event's sequence number
    pending_since: float | None = None  # monotonic time of the first event not in a state yet
    pending_ts: list[float] = field(default_factory=list)  # their event times
    mode: str = ""  # of the last state written


@dataclass
class BuilderReport:
    """What the builder did: rebuilds, writes refused as older, modes, the lag and the rate."""

    events: int = 0
    replayed: int = 0  # events at or below their user's last sequence number, skipped
    rebuilds: int = 0
    refused_writes: int = 0  # a newer state was stored already
    foreign_states: int = 0  # stored states beyond their user's newest event in the log, replaced
    modes: dict[str, int] = field(default_factory=dict)
    grouped_items: int = 0
    over_radius: int = 0
    lags_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0  # time spent rebuilding and writing
    rebuild_requests: int = 0  # users the servers asked to rebuild (no usable state, or a gap)
    unknown_requests: int = 0  # of them, users without events in this builder's window

    def lag_percentiles(self) -> tuple[float, float]:
        """Event to state lag, p50 and p99, in seconds (0 without events)."""
        if not self.lags_s:
            return 0.0, 0.0
        p50, p99 = np.percentile(np.asarray(self.lags_s), [50, 99])
        return float(p50), float(p99)

    def summary(self, elapsed_s: float) -> dict[str, float | int | dict[str, int]]:
        """The report as a flat document (``users_per_s`` over ``elapsed_s``)."""
        p50, p99 = self.lag_percentiles()
        return {
            "events": self.events,
            "replayed": self.replayed,
            "rebuilds": self.rebuilds,
            "refused_writes": self.refused_writes,
            "foreign_states": self.foreign_states,
            "modes": dict(self.modes),
            "grouped_items": self.grouped_items,
            "over_radius": self.over_radius,
            "lag_p50_s": p50,
            "lag_p99_s": p99,
            "users_per_s": self.rebuilds / elapsed_s if elapsed_s > 0 else 0.0,
            "rebuilds_per_busy_s": self.rebuilds / self.busy_s if self.busy_s > 0 else 0.0,
            "rebuild_requests": self.rebuild_requests,
            "unknown_requests": self.unknown_requests,
        }


class UserStateBuilder:
    """Builds and writes states from events.

    Args:
        states: where states are written.
        budget: the token budget.
        key_space: item ids to the attention's key space (used for clustered states).
        max_events: the window of newest events kept per user.
        debounce_s: a user is rebuilt this long after the first event not yet in a state.
        versions: ``(table version, dense version)`` the key space belongs to.
        clock: monotonic seconds (debounce); ``wall`` gives seconds since the epoch (lag).
    """

    def __init__(
        self,
        states: UserStates,
        budget: Budget,
        key_space: KeySpace,
        max_events: int,
        debounce_s: float,
        versions: tuple[int, int] = (0, 0),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.states, self.budget, self.key_space = states, budget, key_space
        self.max_events, self.debounce_s, self.versions = max_events, debounce_s, versions
        self.clock, self.wall = clock, wall
        self.users: dict[int, _User] = {}
        self.report = BuilderReport()
        self._refused: set[int] = set()  # users with a write refused since the last reclaim

    def ingest(self, events: Events) -> None:
        """Take events (any users, log order) into the users' windows; they wait for their rebuild."""
        now = self.clock()
        for (user_id, seq, item, ts), attributes in zip(events.rows(), events.attribute_rows, strict=True):
            user = self.users.setdefault(user_id, _User())
            self.report.events += 1
            if seq <= user.seq:
                self.report.replayed += 1
                continue
            user.seq = seq
            user.items.append(item)
            if attributes:
                user.attributes.append(attributes)
            if len(user.items) > 2 * self.max_events:  # trimmed now and then, not per event
                del user.items[: -self.max_events]
                del user.attributes[: -self.max_events]
            if user.pending_since is None:
                user.pending_since = now
            user.pending_ts.append(ts)

    def set_versions(self, versions: tuple[int, int], regroup: bool = True) -> int:
        """A new item table or dense model: clustered users are rebuilt in its key space; how many."""
        self.versions = versions
        if not regroup:
            return 0
        now, marked = self.clock(), 0
        for user in self.users.values():
            if user.mode == CLUSTERED and user.pending_since is None:
                user.pending_since, marked = now, marked + 1
        return marked

    def clustered_items(self) -> np.ndarray:
        """The distinct items in the windows of the users whose last state was clustered."""
        windows = [user.items[-self.max_events :] for user in self.users.values() if user.mode == CLUSTERED]
        return np.unique(np.concatenate([np.asarray(w, np.int64) for w in windows])) if windows else _NONE

    def request_rebuilds(self, users: np.ndarray) -> int:
        """Users a server found without a usable state: each known one is rebuilt (debounced); how many."""
        now, marked = self.clock(), 0
        for uid in np.asarray(users, np.int64).tolist():
            self.report.rebuild_requests += 1
            user = self.users.get(uid)
            if user is None or not user.items:
                self.report.unknown_requests += 1
                continue
            if user.pending_since is None:
                user.pending_since, marked = now, marked + 1
        return marked

    def flush(self, force: bool = False) -> int:
        """Rebuild and write every user whose debounce is over (every pending user with ``force``)."""
        now = self.clock()
        due = [
            (uid, user)
            for uid, user in self.users.items()
            if user.pending_since is not None and (force or now - user.pending_since >= self.debounce_s)
        ]
        started = time.perf_counter()
        for uid, user in due:
            self._rebuild(uid, user)
        self.report.busy_s += time.perf_counter() - started
        return len(due)

    def _rebuild(self, uid: int, user: _User) -> None:
        window = np.asarray(user.items[-self.max_events :], np.int64)
        attributes = np.asarray(user.attributes[-self.max_events :], np.int64) if user.attributes else None
        built = build_state(window, user.seq, self.budget, self.key_space, self.versions, attributes)
        written = self.states.put(uid, built.state)
        done = self.wall()
        report = self.report
        report.rebuilds += 1
        report.refused_writes += int(not written)
        if not written:
            self._refused.add(uid)
        report.modes[built.state.mode] = report.modes.get(built.state.mode, 0) + 1
        report.grouped_items += built.grouped_items
        report.over_radius += built.over_radius
        report.lags_s.extend(done - ts for ts in user.pending_ts)
        user.pending_since, user.pending_ts, user.mode = None, [], built.state.mode

    def reclaim(self) -> int:
        """Replace the stored states that claim events beyond their user's newest in the log; how many.

        Call it only with the log read to its end: then no state built from the log is newer than
        the newest event this builder has read for its user.
        """
        if not self._refused:
            return 0
        users = np.array(sorted(self._refused), np.int64)
        self._refused.clear()
        replaced = 0
        for uid, stored in zip(users.tolist(), self.states.fetch(users).states, strict=True):
            user = self.users.get(uid)
            if stored is None or user is None or stored.seq <= user.seq:
                continue
            LOGGER.warning(
                "user %d: the stored state claims event %d, beyond the newest in the log (%d); replaced",
                uid,
                stored.seq,
                user.seq,
            )
            self.states.delete(uid)
            self._rebuild(uid, user)
            self.report.foreign_states += 1
            replaced += 1
        return replaced

    def run(
        self,
        read: Callable[[], Events],
        stop: Callable[[], bool],
        poll_s: float = 0.01,
        sleep: Callable[[float], None] = time.sleep,
        rebuilds: Callable[[], np.ndarray] | None = None,
        tick: Callable[[], None] | None = None,
    ) -> BuilderReport:
        """Read, ingest and flush until ``stop()``; then write every pending user once more.

        ``rebuilds``, when given, returns the users the servers queued for a rebuild since its last call;
        ``tick``, when given, runs once per round (the command watches for a new key space there).
        """
        while not stop():
            if tick is not None:
                tick()
            events = read()
            self.ingest(events)
            if rebuilds is not None:
                self.request_rebuilds(rebuilds())
            self.flush()
            if not len(events):  # the log is read to its end
                self.reclaim()
                sleep(poll_s)
        self.ingest(read())
        self.flush(force=True)
        return self.report


def key_drift(before: np.ndarray, after: np.ndarray) -> float:
    """How far a new key space moved items' keys: the median over items of ``|after - before| / |before|``."""
    if before.shape != after.shape or before.size == 0:
        return float("inf")
    moved = np.linalg.norm(after - before, axis=1)
    return float(np.median(moved / np.maximum(np.linalg.norm(before, axis=1), 1e-12)))


class Regrouping:
    """Regroups the builder's clustered users when a new key space moved their items' keys enough.

    The reference is a sample of the clustered users' items with their keys at the last grouping;
    a new version's drift (:func:`key_drift`) is measured against it, so small changes that add up
    regroup too. Without a reference (no clustered user yet) a new version regroups.

    Args:
        key_space: item ids to key vectors, in the key space served now.
        limit: ``[user_state] regroup_drift``: regroup above this drift (0: on any change).
        sample: the most items in the reference.
    """

    def __init__(self, key_space: KeySpace, limit: float, sample: int = 4096, seed: int = 0) -> None:
        self.key_space, self.limit, self.sample = key_space, limit, sample
        self.rng = np.random.default_rng(seed)
        self.items = _NONE
        self.keys = np.zeros((0, 0))

    def check(self, builder: UserStateBuilder, versions: tuple[int, int]) -> float | None:
        """Give ``builder`` the served ``versions``; the drift when they are new (None: unchanged)."""
        if versions == builder.versions:
            if self.items.size == 0:
                self.take_reference(builder)
            return None
        drift = (
            key_drift(self.keys, np.asarray(self.key_space(self.items))) if self.items.size else float("inf")
        )
        regroup = drift > self.limit
        marked = builder.set_versions(versions, regroup)
        LOGGER.info(
            "key space %s: drift %.4f against the last grouping; %s",
            versions,
            drift,
            f"{marked} clustered users regrouped" if regroup else f"under {self.limit}: not regrouped",
        )
        if regroup:
            self.take_reference(builder)
        return drift

    def take_reference(self, builder: UserStateBuilder) -> None:
        """Sample the clustered users' items and keep their keys as the reference."""
        items = builder.clustered_items()
        if items.size > self.sample:
            items = np.sort(self.rng.choice(items, self.sample, replace=False))
        self.items = items
        self.keys = np.asarray(self.key_space(items)) if items.size else np.zeros((0, 0))
