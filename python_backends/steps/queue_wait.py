"""The steps' queue wait, read from tritonserver's own counters: the degradation controller's load.

tritonserver counts, per model, the requests waiting in its dynamic batcher's queue now
(``nv_inference_pending_request_count``) and the requests it finished
(``nv_inference_request_success`` and ``_failure``). :class:`QueueWait` reads them from the
server's metrics endpoint (its address in the environment variable
:data:`~recserve.core.sections.degrade.METRICS_URL_ENV`, set by ``TritonServer``) and returns, per
call, the wait a request arriving now can expect: per step, its pending requests over the rate it
finished requests since the previous call, summed over the steps; and the rate the steps finished
requests at (the slowest step's), which is what they can serve while a backlog keeps them busy.
"""

from __future__ import annotations

import logging
import re
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

LOGGER = logging.getLogger(__name__)

_SERIES = re.compile(
    r"^(nv_inference_queue_duration_us|nv_inference_request_success|nv_inference_request_failure"
    r'|nv_inference_pending_request_count)\{[^}]*model="([^"]+)"[^}]*\}\s+([0-9.eE+-]+)\s*$',
    re.MULTILINE,
)


@dataclass(frozen=True)
class StepCounts:
    """One step's counters at one reading: requests finished (and their summed queue wait), pending now."""

    finished: float = 0.0
    waited_us: float = 0.0
    pending: float = 0.0


def step_counts(text: str, models: Sequence[str]) -> dict[str, StepCounts]:
    """Per model of ``models``, its counters in the metrics endpoint's text."""
    found = {model: [0.0, 0.0, 0.0] for model in models}
    column = {"nv_inference_queue_duration_us": 1, "nv_inference_pending_request_count": 2}
    for name, model, value in _SERIES.findall(text):
        if model in found:
            found[model][column.get(name, 0)] += float(value)
    return {model: StepCounts(*values) for model, values in found.items()}


def expected_wait_ms(
    before: dict[str, StepCounts], after: dict[str, StepCounts], elapsed_s: float
) -> float | None:
    """What a request arriving now would wait in the steps' queues, in milliseconds (None: idle).

    Per step, the requests pending now over the rate it finished them since the last reading
    (a step that finished none with some pending: at least the whole interval); summed over the
    steps. Unlike the mean wait of the finished requests, which tritonserver counts only as they
    leave, this follows a backlog as it builds and as it drains.
    """
    total, busy = 0.0, False
    for model, now in after.items():
        then = before.get(model, StepCounts())
        rate = (now.finished - then.finished) / elapsed_s if elapsed_s > 0 else 0.0
        busy = busy or rate > 0 or now.pending > 0
        if now.pending > 0:
            total += now.pending / rate * 1e3 if rate > 0 else elapsed_s * 1e3
    return total if busy else None


def served_per_s(before: dict[str, StepCounts], after: dict[str, StepCounts], elapsed_s: float) -> float:
    """Requests the slowest of the steps finished per second from one reading to the next."""
    if elapsed_s <= 0 or not after:
        return 0.0
    return min((now.finished - before.get(m, StepCounts()).finished) / elapsed_s for m, now in after.items())


class QueueWait:
    """The expected queue wait over the steps, from one reading of the counters to the next.

    Args:
        url: the server's metrics endpoint (``http://host:port/metrics``).
        models: the steps whose queues a request passes (the ensemble's steps).
        timeout_s: the most one read may take.
    """

    def __init__(self, url: str, models: Sequence[str], timeout_s: float = 0.5) -> None:
        self.url, self.models, self.timeout_s = url, tuple(models), timeout_s
        self.previous: tuple[float, dict[str, StepCounts]] | None = None
        self.served_per_s = 0.0  # the slowest step's finished requests per second, at the last sample

    def read(self) -> str:
        """The endpoint's text."""
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:  # noqa: S310 (loopback)
            return str(response.read().decode())

    def sample(self) -> float | None:
        """Milliseconds a request arriving now would wait in the steps' queues (None: idle, or a first)."""
        now, counts = time.monotonic(), step_counts(self.read(), self.models)
        previous, self.previous = self.previous, (now, counts)
        if previous is None:
            return None
        self.served_per_s = served_per_s(previous[1], counts, now - previous[0])
        return expected_wait_ms(previous[1], counts, now - previous[0])
