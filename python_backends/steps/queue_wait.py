"""The steps' mean queue wait, read from tritonserver's own counters: the degradation controller's load.

tritonserver counts, per model, the microseconds its requests waited in the dynamic batcher's queue
(``nv_inference_queue_duration_us``) and the requests it finished (``nv_inference_request_success``
and ``_failure``). :class:`QueueWait` reads them from the server's metrics endpoint (its address
in the environment variable :data:`~recserve.core.sections.degrade.METRICS_URL_ENV`, set by
``TritonServer``) and returns, per call, the mean wait a request spent in the steps' queues since the
previous call: the sum over the steps of each one's added wait over its added requests.
"""

from __future__ import annotations

import logging
import re
import urllib.request
from collections.abc import Sequence

LOGGER = logging.getLogger(__name__)

_SERIES = re.compile(
    r"^(nv_inference_queue_duration_us|nv_inference_request_success|nv_inference_request_failure)"
    r'\{[^}]*model="([^"]+)"[^}]*\}\s+([0-9.eE+-]+)\s*$',
    re.MULTILINE,
)


def queue_totals(text: str, models: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Per model of ``models``: (microseconds waited in its queue, requests finished), from metrics text."""
    totals = {model: [0.0, 0.0] for model in models}
    for name, model, value in _SERIES.findall(text):
        if model in totals:
            totals[model][0 if name == "nv_inference_queue_duration_us" else 1] += float(value)
    return {model: (waited, count) for model, (waited, count) in totals.items()}


class QueueWait:
    """The mean queue wait per request over the steps, between calls.

    Args:
        url: the server's metrics endpoint (``http://host:port/metrics``).
        models: the steps whose queues a request passes (the ensemble's steps).
        timeout_s: the most one read may take.
    """

    def __init__(self, url: str, models: Sequence[str], timeout_s: float = 0.5) -> None:
        self.url, self.models, self.timeout_s = url, tuple(models), timeout_s
        self.previous: dict[str, tuple[float, float]] | None = None

    def read(self) -> str:
        """The endpoint's text."""
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:  # noqa: S310 (loopback)
            return str(response.read().decode())

    def sample(self) -> float | None:
        """Milliseconds a request waited in the steps' queues since the last call (None: none finished)."""
        totals = queue_totals(self.read(), self.models)
        previous, self.previous = self.previous, totals
        return mean_wait_ms(previous, totals) if previous is not None else None


def mean_wait_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> float | None:
    """The steps' summed mean wait per request between two readings (None: no step finished one)."""
    waits = []
    for model, (waited, count) in after.items():
        then_waited, then_count = before.get(model, (0.0, 0.0))
        if count > then_count:
            waits.append((waited - then_waited) / (count - then_count) / 1000.0)
    return sum(waits) if waits else None
