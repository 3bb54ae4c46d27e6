"""Where user states live: a local SQLite file (the embedded default) or the Redis Cluster tier.

Both write with a compare on the event sequence: a state replaces the stored one only when its
``seq`` is at least the stored one's, so a slow or restarted builder never puts an older state
over a newer one. Both keep a state for ``ttl_s`` after its last write, and delete a user's state
on request (erasure). Reads never raise: a user is ``found``, ``absent``, ``bad_value`` (a stored
value that is not a state this server accepts: refused, counted, logged at most once a minute) or,
for the whole call, ``error`` (Redis timed out, failed, or its breaker is open; the local file
could not be read). A local file that is corrupt when opened is set aside, never a failed start.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from recserve.backends.store.redis_tier import HALF_OPEN, CircuitBreaker, RedisTier, redis_keys
from recserve.backends.store.user_state.files import STATE_COLUMNS, opening_lock, set_aside_if_corrupt
from recserve.backends.store.user_state.state import StateFormatError, UserState, decode_states, seq_bytes
from recserve.core.sections.serving import StoreSection
from recserve.core.sections.user_state import UserStateSection

LOGGER = logging.getLogger(__name__)

FOUND, ABSENT, BAD_VALUE, ERROR = "found", "absent", "bad_value", "error"
#: Prefix of the states' Redis keys (the hash tag spreads users over the tier's slot groups).
STATE_PREFIX = "us:"
BAD_VALUE_LOG_INTERVAL_S = 60.0

#: Set KEYS[1] to ARGV[1] for ARGV[3] ms unless the stored state's seq (bytes 5..24) is newer than
#: ARGV[2]. Both are zero-padded digits, so comparing the strings compares the numbers.
_COMPARE_AND_SET = """
local stored = redis.call('GET', KEYS[1])
if stored and string.sub(stored, 1, 4) == 'RSU1' and string.sub(stored, 5, 24) > ARGV[2] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""


@dataclass(frozen=True)
class StateFetch:
    """The states of a batch's users (None where not found) and each user's outcome."""

    states: list[UserState | None]
    outcomes: list[str]  # FOUND, ABSENT, BAD_VALUE or ERROR, per user


class UserStates(Protocol):
    """What the builder and the lookup step need of a state store."""

    def fetch(self, users: np.ndarray, known: Sequence[UserState | None] = ()) -> StateFetch:
        """The stored states of ``users`` (int64).

        ``known``: per user, a state read earlier (or None); where the stored bytes are still
        that state's, it is returned as it is, not decoded again.
        """
        ...

    def put(self, user: int, state: UserState) -> bool:
        """Store ``state`` unless a newer one is stored; True when written."""
        ...

    def delete(self, user: int) -> bool:
        """Erase a user's state; True when there was one."""
        ...


class _Decoder:
    """Decodes stored values, counting and (at most once a minute) logging the refused ones."""

    def __init__(self, max_tokens: int, attributes: int = 0) -> None:
        self.max_tokens, self.attributes = max_tokens, attributes
        self.refused = 0
        self._logged_at = -BAD_VALUE_LOG_INTERVAL_S

    def __call__(
        self, users: np.ndarray, values: Sequence[object], known: Sequence[UserState | None] = ()
    ) -> StateFetch:
        states: list[UserState | None] = []
        outcomes = []
        known = known or [None] * len(values)
        todo: list[int] = []  # positions of the values to decode, decoded together below
        for value, before in zip(values, known, strict=True):
            if value is None:
                states.append(None)
                outcomes.append(ABSENT)
            elif before is not None and before.raw and isinstance(value, bytes) and value == before.raw:
                states.append(before)  # the same bytes: checked when first read
                outcomes.append(FOUND)
            else:
                todo.append(len(states))
                states.append(None)
                outcomes.append(FOUND)
        if todo:
            user_ids = users.tolist()
            for i, decoded in zip(
                todo, decode_states([values[i] for i in todo], self.max_tokens, self.attributes), strict=True
            ):
                if isinstance(decoded, StateFormatError):
                    outcomes[i] = BAD_VALUE
                    self._refuse(user_ids[i], decoded)
                else:
                    states[i] = decoded
        return StateFetch(states, outcomes)

    def _refuse(self, user: int, exc: ValueError) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= BAD_VALUE_LOG_INTERVAL_S:
            LOGGER.warning("user state of user %d refused (%d since start): %s", user, self.refused, exc)
            self._logged_at = now


class LocalUserStates:
    """States in a SQLite file, shared by the builder's process and the servers' on one machine.

    The file is checked when opened (:func:`~recserve.backends.store.user_state.files.corruption`):
    a corrupt one, or one that is not a user-state database, is set aside beside it
    (``<name>.corrupt-<time>``; counted in ``set_aside``, logged) and an empty one takes its place,
    whose states the builder writes again as users come back. A corrupt file never stops a start.

    Args:
        path: the database file (created with its table when missing).
        ttl_s: how long a state lives after its last write.
        max_tokens: the most tokens a state read back may hold.
        clock: seconds since the epoch (processes share the file, so wall time).
        attributes: the attribute columns of a state read back (the spec's aligned sequences).
    """

    def __init__(
        self,
        path: Path,
        ttl_s: float,
        max_tokens: int,
        clock: Callable[[], float] = time.time,
        attributes: int = 0,
    ) -> None:
        self.path, self.ttl_s, self.clock = Path(path), ttl_s, clock
        self.errors = 0  # fetches that failed on the file (every user ``error``)
        self._decode = _Decoder(max_tokens, attributes)
        self._local = threading.local()
        with opening_lock(self.path):
            self.set_aside = int(set_aside_if_corrupt(self.path) is not None)
            with self._connection() as db:
                db.execute(f"CREATE TABLE IF NOT EXISTS states ({STATE_COLUMNS})")

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection (SQLite connections stay on the thread that made them)."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=5.0, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            self._local.db = db
        return db

    def fetch(self, users: np.ndarray, known: Sequence[UserState | None] = ()) -> StateFetch:
        """The states of ``users``; an expired state is absent (``known``: see :class:`UserStates`)."""
        users = np.asarray(users, np.int64).reshape(-1)
        wanted = [int(u) for u in users.tolist()]
        rows: dict[int, bytes] = {}
        try:
            for start in range(0, len(wanted), 500):  # SQLite's bound on parameters
                chunk = wanted[start : start + 500]
                marks = ",".join("?" * len(chunk))
                rows.update(
                    self._connection().execute(
                        f"SELECT user, value FROM states WHERE expires > ? AND user IN ({marks})",  # noqa: S608
                        (self.clock(), *chunk),
                    )
                )
        except sqlite3.DatabaseError as exc:  # a file damaged while served: the rows go without states
            self.errors += 1
            if self.errors == 1 or self.errors % 1000 == 0:
                LOGGER.warning(
                    "user states unreadable in %s (%d times): %s", self.path.name, self.errors, exc
                )
            return StateFetch([None] * users.size, [ERROR] * users.size)
        return self._decode(users, [rows.get(u) for u in wanted], known)

    def put(self, user: int, state: UserState) -> bool:
        """Store ``state`` unless the stored one (not expired) has a newer seq."""
        now = self.clock()
        cursor = self._connection().execute(
            "INSERT INTO states VALUES (?, ?, ?, ?) ON CONFLICT(user) DO UPDATE SET "
            "seq = excluded.seq, expires = excluded.expires, value = excluded.value "
            "WHERE excluded.seq >= states.seq OR states.expires <= ?",
            (int(user), state.seq, now + self.ttl_s, state.encode(), now),
        )
        return cursor.rowcount == 1

    def delete(self, user: int) -> bool:
        """Erase a user's state."""
        return self._connection().execute("DELETE FROM states WHERE user = ?", (int(user),)).rowcount == 1

    def close(self) -> None:
        """Close this thread's connection."""
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


class RedisUserStates:
    """States in the Redis Cluster of ``[store] redis_nodes``, one string per user.

    Reads are one ``MGET`` per master under ``deadline_s`` behind a circuit breaker, on a worker
    thread, as L3's are; a call still running past its deadline makes the next ones of the same
    calling thread ``error`` rather than queueing behind it (the request path and the step's
    refresher each have their own). Writes are a compare-and-set script on the user's key.
    """

    def __init__(
        self,
        client: Any,
        ttl_s: float,
        max_tokens: int,
        deadline_s: float,
        breaker: CircuitBreaker,
        prefix: str = STATE_PREFIX,
        attributes: int = 0,
    ) -> None:
        self.client, self.ttl_ms, self.deadline_s = client, max(1, int(ttl_s * 1000)), deadline_s
        self.breaker, self.prefix = breaker, prefix
        self.errors = 0
        self._decode = _Decoder(max_tokens, attributes)
        self._script = client.register_script(_COMPARE_AND_SET)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="recserve-user-state")
        self._calls = threading.local()  # each calling thread's call in flight (``inflight``)

    def _keys(self, users: np.ndarray) -> list[bytes]:
        return redis_keys(np.asarray(users, np.int64), self.prefix)

    def fetch(self, users: np.ndarray, known: Sequence[UserState | None] = ()) -> StateFetch:
        """The states of ``users``; every user ``error`` on timeout, failure or an open breaker.

        ``known``: see :class:`UserStates`.
        """
        users = np.asarray(users, np.int64).reshape(-1)
        failed = StateFetch([None] * users.size, [ERROR] * users.size)
        if users.size == 0:
            return StateFetch([], [])
        inflight: Future | None = getattr(self._calls, "inflight", None)
        if not self.breaker.allow() or (inflight is not None and not inflight.done()):
            self.errors += 1
            return failed
        if self.breaker.state == HALF_OPEN:  # the trial, off the request path: served without states
            keys = self._keys(users)
            self._calls.inflight = self._pool.submit(
                self.breaker.trial, lambda: self.client.mget_nonatomic(keys)
            )
            self.errors += 1
            return failed
        self._calls.inflight = inflight = self._pool.submit(self.client.mget_nonatomic, self._keys(users))
        try:
            values = inflight.result(timeout=self.deadline_s)
        except FutureTimeout:
            self.errors += 1
            self.breaker.failure()
            return failed
        except Exception as exc:  # any client error: the request is served without states
            self.errors += 1
            self.breaker.failure()
            LOGGER.warning("user state fetch failed: %s", type(exc).__name__)
            return failed
        self.breaker.success()
        if not isinstance(values, list) or len(values) != users.size:
            return StateFetch([None] * users.size, [BAD_VALUE] * users.size)
        return self._decode(users, values, known)

    def put(self, user: int, state: UserState) -> bool:
        """Store ``state`` unless a newer one is stored (one script call, atomic on the user's key)."""
        key = self._keys(np.array([user]))[0]
        written = self._script(keys=[key], args=[state.encode(), seq_bytes(state.seq), self.ttl_ms])
        return int(written) == 1

    def delete(self, user: int) -> bool:
        """Erase a user's state."""
        return int(self.client.delete(self._keys(np.array([user]))[0])) == 1

    def close(self) -> None:
        """Release the worker thread (the client belongs to the caller)."""
        self._pool.shutdown(wait=False)


def open_user_states(
    section: UserStateSection, store: StoreSection, folder: Path, attributes: int = 0
) -> UserStates:
    """The store ``[user_state] store`` names: its SQLite file (under ``folder`` when relative) or Redis.

    ``attributes``: the attribute columns of the states (the spec's sequences aligned to the items).

    Raises:
        L3ConnectError: ``redis`` with a ``[store]`` that reaches no usable cluster.
    """
    max_tokens = section.tokens
    if section.store == "redis":
        tier = RedisTier.connect(replace(store, redis_deadline_ms=section.deadline_ms))
        breaker = CircuitBreaker(store.breaker_failures, store.breaker_cooldown_s)
        return RedisUserStates(
            tier.client, section.ttl_s, max_tokens, section.deadline_ms / 1000, breaker, attributes=attributes
        )
    return LocalUserStates(folder / section.local_path, section.ttl_s, max_tokens, attributes=attributes)
