"""L3: embedding rows in a Redis Cluster, behind a per-call deadline and a circuit breaker.

Each row is one Redis string: key ``<prefix>{<key mod 64>}:<key>``, value the float32 bytes of the
vector. The hash tag spreads keys over 64 slot groups, so a batch is a few pipelined ``MGET`` per
master (redis-py's ``mget_nonatomic``). A lookup never fails because of L3: on a timeout, an error
or while the breaker is open, the keys are reported as not found (the store serves their defaults)
and a counter goes up.

Redis is untrusted storage: anyone who can write to it can put anything under a key. A value that
is not the float32 row of its key's width (too short, too long, empty, not bytes) or holds NaN, Inf
or a value over 1e6 in magnitude is refused for that key alone (``bad_value``): the key gets its
default row, the other keys of the batch are served. ``MGET`` answers nil for a key holding another
type (a hash, a list), so such a key reads as absent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from recserve.backends.base.metrics import MetricSample
from recserve.backends.store.redis_connect import (
    L3ConnectError,
    auth_reason,
    connection_settings,
    host_port,
    refused_credentials,
    refused_error,
    timed_out,
)
from recserve.backends.store.redis_values import decode_rows, describe_value
from recserve.errors import shorten

LOGGER = logging.getLogger(__name__)

KEY_PREFIX = "rs:"
SLOT_GROUPS = 64
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
#: Reasons L3 does not serve: the ``reason`` label of ``recserve_store_l3_errors_total``. Each counts
#: one call not served, except ``bad_value``, which counts one key whose value was refused.
L3_TIMEOUT, L3_ERROR, L3_BREAKER_OPEN, L3_BUSY = "timeout", "error", "breaker_open", "busy"
L3_BAD_VALUE = "bad_value"
L3_ERROR_REASONS = (L3_TIMEOUT, L3_ERROR, L3_BREAKER_OPEN, L3_BUSY, L3_BAD_VALUE)
#: Seconds between two warnings about refused values (each says how many were refused since the last).
BAD_VALUE_LOG_INTERVAL_S = 60.0


class CircuitBreaker:
    """Stops calling a failing dependency: opens after ``failures`` in a row, retries after ``cooldown_s``."""

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.state = CLOSED
        self.consecutive = 0
        self.opened_at = 0.0
        self.opened_total = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """May a call go out now?

        After the cooldown, one trial call goes out.
        """
        with self._lock:
            if self.state == OPEN and self.clock() - self.opened_at >= self.cooldown_s:
                self.state = HALF_OPEN
                return True
            return self.state == CLOSED

    def success(self) -> None:
        """A call succeeded: close."""
        with self._lock:
            self.state, self.consecutive = CLOSED, 0

    def trial(self, call: Callable[[], object]) -> None:
        """Make the half-open breaker's trial call: close if it returns, open again if it raises.

        Run on a worker, off the request path and without a call deadline: after an idle cooldown
        the process and its connections are cold (a reconnect, a slot-map read), which on a slow
        machine outlasts a tight deadline every time and would keep the breaker open for good.
        """
        try:
            call()
        except Exception as exc:  # the dependency is still away
            self.failure()
            LOGGER.info("trial call failed: %s", type(exc).__name__)
        else:
            self.success()

    def failure(self) -> None:
        """A call failed: open after enough failures in a row, or at once after a failed trial."""
        with self._lock:
            self.consecutive += 1
            if self.state == HALF_OPEN or self.consecutive >= self.failures:
                if self.state != OPEN:
                    self.opened_total += 1
                self.state, self.opened_at = OPEN, self.clock()


def redis_keys(keys: np.ndarray, prefix: str = KEY_PREFIX) -> list[bytes]:
    """Redis key names of embedding keys, built as one byte matrix: ``<prefix>{NN}<8 key bytes>!``.

    ``{NN}`` (``key mod 64``, two digits) is the hash tag; the trailing ``!`` keeps key bytes that
    end in zero from being cut off by numpy's fixed-width byte strings.
    """
    keys = np.asarray(keys, np.int64).reshape(-1)
    head = prefix.encode()
    width = len(head) + 4 + 8 + 1
    raw = np.empty((keys.size, width), np.uint8)
    raw[:, : len(head)] = np.frombuffer(head, np.uint8)
    group = np.mod(keys, SLOT_GROUPS)
    at = len(head)
    raw[:, at] = ord("{")
    raw[:, at + 1] = ord("0") + group // 10
    raw[:, at + 2] = ord("0") + group % 10
    raw[:, at + 3] = ord("}")
    raw[:, at + 4 : at + 12] = keys.astype(">i8").view(np.uint8).reshape(-1, 8)
    raw[:, -1] = ord("!")
    return raw.view(f"S{width}").reshape(-1).tolist()


class RedisTier:
    """L3 over a Redis Cluster client (``redis.cluster.RedisCluster`` or anything with ``mget_nonatomic``)."""

    def __init__(
        self, client: Any, deadline_s: float, breaker: CircuitBreaker, prefix: str = KEY_PREFIX
    ) -> None:
        self.client = client
        self.deadline_s = deadline_s
        self.breaker = breaker
        self.prefix = prefix
        self.errors = dict.fromkeys(L3_ERROR_REASONS, 0)  # every reason, counted or not, is exported
        self.calls = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recserve-l3")
        self._inflight: Future | None = None  # the call or slot-map refresh running on the worker
        self._refresh: Future | None = None  # the last slot-map refresh
        self._refresh_topology = False  # after a failure: re-read the cluster's slot map first (failover)
        self._unlogged_bad = 0  # refused values since the last warning
        self._bad_logged_at = -BAD_VALUE_LOG_INTERVAL_S

    @classmethod
    def connect(cls, options: Any, environ: Mapping[str, str] | None = None) -> RedisTier:
        """A tier for ``StoreSection`` (``redis_nodes``, ``redis_deadline_ms``, breaker, credentials, TLS).

        Args:
            options: the ``[store]`` section.
            environ: where ``redis_password_env`` is looked up (default: this process's environment).

        Raises:
            L3ConnectError: the password's variable is not set, the cluster refused the credentials, or
                no node answered.
        """
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.exceptions import AuthenticationError, RedisClusterException, ResponseError
        from redis.retry import Retry

        deadline = options.redis_deadline_ms / 1000.0
        nodes = [ClusterNode(*host_port(node)) for node in options.redis_nodes]
        for attempt in range(STARTUP_ATTEMPTS):
            try:
                client = RedisCluster(
                    startup_nodes=nodes,
                    socket_timeout=max(deadline, 0.05),
                    # a connection is made once (at load, or after a node came back), on the worker
                    # thread whose calls the deadline bounds anyway: a busy machine's slow connect
                    # fails no load
                    socket_connect_timeout=max(deadline, CONNECT_TIMEOUT_S),
                    require_full_coverage=False,
                    retry=Retry(NoBackoff(), 1),
                    **connection_settings(options, environ),
                )
                break
            except (AuthenticationError, RedisClusterException, ResponseError) as exc:
                if refused_credentials(exc):
                    raise refused_error(options, exc) from None
                if attempt + 1 < STARTUP_ATTEMPTS and timed_out(exc):
                    # the first answers (the slot map) come under the deadline too: on a busy
                    # machine they can be late, once, without the cluster being away
                    LOGGER.info("the Redis Cluster answered late (%s); connecting again", shorten(exc, 120))
                    time.sleep(STARTUP_BACKOFF_S * 2**attempt)
                    continue
                raise L3ConnectError(
                    f"no node of the Redis Cluster at {','.join(options.redis_nodes)} answered: "
                    f"{auth_reason(exc)[:200]}"
                ) from None
        return cls(client, deadline, CircuitBreaker(options.breaker_failures, options.breaker_cooldown_s))

    def fetch(
        self, keys: np.ndarray, dim: int, widths: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Vectors ``[n, dim]`` and a found mask; all not found on timeout, error or open breaker.

        Args:
            keys: embedding keys (int64).
            dim: the width of the returned vectors (the store's widest table).
            widths: each key's row width in floats (its table's width); None: every row is ``dim``
                wide; a width of 0 accepts any whole number of floats up to ``dim``. A value of
                another length, not bytes, or holding NaN, Inf or a value over 1e6 is refused: its
                key is not found, and ``bad_value`` counts it.
        """
        vectors = np.zeros((keys.size, dim), np.float32)
        found = np.zeros(keys.size, bool)
        if keys.size == 0:
            return vectors, found
        if not self.breaker.allow():
            self.errors[L3_BREAKER_OPEN] += 1
            return vectors, found
        if self.breaker.state == HALF_OPEN:  # the trial, off the request path: these keys get defaults
            names = redis_keys(keys, self.prefix)
            self._inflight = self._pool.submit(self.breaker.trial, lambda: self._reconnect(names))
            self.errors[L3_BREAKER_OPEN] += 1
            return vectors, found
        if self._inflight is not None and not self._inflight.done():
            self.errors[L3_BUSY] += 1  # a call stuck past its deadline, or the slot-map refresh: do not queue
            self.breaker.failure()
            self._refresh_topology = self._refresh_topology or self._inflight is not self._refresh
            return vectors, found
        if self._refresh_topology:
            # after a failure, re-read the slot map (a master may have failed over) before the next
            # call, on the worker and outside any call's deadline: a slow refresh on a loaded machine
            # must not time every call out. This batch's keys get defaults, as in any failure.
            self._refresh_topology = False
            self._inflight = self._refresh = self._pool.submit(self.client.nodes_manager.initialize)
            self.errors[L3_BUSY] += 1
            self.breaker.failure()
            return vectors, found
        self.calls += 1
        self._inflight = self._pool.submit(self.client.mget_nonatomic, redis_keys(keys, self.prefix))
        try:
            values = self._inflight.result(timeout=self.deadline_s)
        except FutureTimeout:
            self.errors[L3_TIMEOUT] += 1
            self.breaker.failure()
            self._refresh_topology = True
            return vectors, found
        except Exception as exc:  # any client error means "not served by L3"
            self.errors[L3_ERROR] += 1
            self.breaker.failure()
            self._refresh_topology = True
            LOGGER.warning("L3 lookup failed: %s", type(exc).__name__)
            return vectors, found
        self.breaker.success()
        found[:], refused = decode_rows(values, vectors, widths)
        if refused.size:
            self._count_refused(keys, values, refused)
        return vectors, found

    def _reconnect(self, names: list[bytes]) -> None:
        """The trial call: read the slot map again (the masters may have moved), then the keys."""
        self.calls += 1
        self.client.nodes_manager.initialize()
        self.client.mget_nonatomic(names)
        self._refresh_topology = False

    def _count_refused(self, keys: np.ndarray, values: list, refused: np.ndarray) -> None:
        """Count refused values (``bad_value``); warn at most once a minute, naming one of them."""
        self.errors[L3_BAD_VALUE] += int(refused.size)
        self._unlogged_bad += int(refused.size)
        now = time.monotonic()
        if now - self._bad_logged_at < BAD_VALUE_LOG_INTERVAL_S:
            return
        first = int(refused[0])
        value = values[first] if len(values) == keys.size else values
        LOGGER.warning(
            "L3: refused %d Redis values since the last warning (the keys got their default rows); "
            "e.g. key %s (Redis key %s): %s",
            self._unlogged_bad,
            int(keys[first]),
            shorten(redis_keys(keys[first : first + 1], self.prefix)[0]),
            describe_value(value),
        )
        self._unlogged_bad, self._bad_logged_at = 0, now

    def fetch_bulk(
        self, keys: np.ndarray, dim: int, widths: np.ndarray | None = None, chunk: int = 10_000
    ) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`fetch`, for work off the serving path (the L1 rebuild).

        On the caller's thread, in chunks, with no call deadline, so that a large read never holds
        the serving calls' worker. Nothing is fetched while the breaker is not closed; a failure
        leaves the rest not found. Refused values are not found; the serving calls count them.
        """
        vectors = np.zeros((keys.size, dim), np.float32)
        found = np.zeros(keys.size, bool)
        for start in range(0, keys.size, chunk):
            if self.breaker.state != CLOSED:
                break
            try:
                values = self.client.mget_nonatomic(redis_keys(keys[start : start + chunk], self.prefix))
            except Exception as exc:  # the serving calls detect and count failures
                LOGGER.debug("L3 bulk read failed: %s", type(exc).__name__)
                break
            part = None if widths is None else widths[start : start + chunk]
            found[start : start + chunk] = decode_rows(values, vectors[start : start + chunk], part)[0]
        return vectors, found

    def upload(self, keys: np.ndarray, vectors: np.ndarray, chunk: int = 10_000) -> int:
        """Write rows (float32) into the cluster; rows written."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        for start in range(0, len(keys), chunk):
            names = redis_keys(keys[start : start + chunk], self.prefix)
            block = vectors[start : start + chunk]
            self.client.mset_nonatomic(dict(zip(names, (row.tobytes() for row in block), strict=True)))
        return len(keys)

    def healthy(self) -> bool:
        """False while the breaker is open."""
        return self.breaker.state == CLOSED

    def samples(self) -> list[MetricSample]:
        """L3 calls, errors by reason, breaker state."""
        out = [
            MetricSample(
                "recserve_store_l3_calls_total", "counter", "Batch calls to L3", (), float(self.calls)
            )
        ]
        out += [
            MetricSample(
                "recserve_store_l3_errors_total",
                "counter",
                "L3 calls not served, and L3 values refused (bad_value, per key); keys got defaults",
                (("reason", reason),),
                float(self.errors.get(reason, 0)),
            )
            for reason in L3_ERROR_REASONS
        ]
        out.append(
            MetricSample(
                "recserve_store_l3_breaker_open",
                "gauge",
                "1 while the L3 circuit breaker is open",
                (),
                float(self.breaker.state != CLOSED),
            )
        )
        return out

    def close(self) -> None:
        """Release the worker thread and the connections."""
        self._pool.shutdown(wait=False)
        self.client.close()


#: least time a new connection to a node may take (calls are bounded by the deadline regardless)
CONNECT_TIMEOUT_S = 1.0
#: Connecting again when the cluster's first answers come later than the deadline: how often in
#: all, and the first pause (doubled each time).
STARTUP_ATTEMPTS = 3
STARTUP_BACKOFF_S = 0.25
