"""Bounded loopback load for ``recserve lab chaos``: every answer timed, and what an outage cost.

:class:`PacedLoad` sends one batch over gRPC through the proxy from a few threads, each at a fixed
pace (a bounded rate, not a closed loop that would pile up on a restarting server), and keeps the
time and outcome of every request. :func:`outage` reads, for one kill, the requests failed after it
and the seconds until requests were served again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from recserve.clients import CTRClient, RecserveClientError
from recserve.core.spec.model import ModelSpec

#: Each request's deadline: a request to a dead server fails at once, one to a stuck one at this.
REQUEST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Outage:
    """What one kill cost the clients.

    Attributes:
        failed: requests that failed after the kill.
        served_again_s: seconds from the kill to the first answer after the last failure (0.0:
            nothing failed); None: requests were still failing at the end.
        requests: requests sent after the kill.
    """

    failed: int
    served_again_s: float | None
    requests: int


def outage(records: list[tuple[float, bool]], killed_at: float, until: float) -> Outage:
    """The requests failed after ``killed_at`` and the seconds until requests were served again.

    Args:
        records: (monotonic time the answer came, whether it was served), in any order.
        killed_at: when the process was killed.
        until: the end of the window looked at.
    """
    window = sorted((t, ok) for t, ok in records if killed_at <= t <= until)
    failures = [t for t, ok in window if not ok]
    if not failures:
        return Outage(0, 0.0, len(window))
    after = [t for t, ok in window if ok and t > failures[-1]]
    return Outage(len(failures), round(after[0] - killed_at, 3) if after else None, len(window))


class PacedLoad:
    """``threads`` clients, each sending ``inputs`` to ``url`` every ``1 / rate_per_thread`` seconds.

    Use as a context manager; :attr:`records` holds (time answered, served) of every request.
    """

    def __init__(
        self, url: str, spec: ModelSpec, inputs: dict[str, np.ndarray], threads: int, rate_per_thread: float
    ) -> None:
        self.url = url
        self.spec = spec
        self.inputs = inputs
        self.interval_s = 1.0 / rate_per_thread
        self.records: list[tuple[float, bool]] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]

    def _loop(self) -> None:
        client: CTRClient | None = None
        next_at = time.monotonic()
        while not self._stop.is_set():
            ok = False
            try:
                if client is None:
                    client = CTRClient(self.url, spec=self.spec, timeout_s=REQUEST_TIMEOUT_S)
                ok = len(client.predict_inputs(self.inputs)) > 0
            except (RecserveClientError, OSError) as exc:
                with self._lock:
                    self.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                if client is not None:
                    client.close()
                client = None  # a new channel after a failure (the proxy may have been restarted)
            with self._lock:
                self.records.append((time.monotonic(), ok))
            next_at = max(next_at + self.interval_s, time.monotonic())
            self._stop.wait(next_at - time.monotonic())
        if client is not None:
            client.close()

    def snapshot(self) -> list[tuple[float, bool]]:
        """The records so far."""
        with self._lock:
            return list(self.records)

    def quiet_since(self, since: float, seconds: float) -> bool:
        """True when requests were answered for ``seconds`` after ``since``, none failing meanwhile."""
        now = time.monotonic()
        window = [(t, ok) for t, ok in self.snapshot() if t >= max(since, now - seconds)]
        return now - since >= seconds and bool(window) and all(ok for _, ok in window)

    def __enter__(self) -> PacedLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 5)
