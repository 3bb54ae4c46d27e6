"""The metrics of one model instance on Triton's metrics endpoint, published off the request path."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import triton_python_backend_utils as pb_utils

from recserve.backends.base.metrics import MetricSample
from recserve.backends.triton.adapter import REQUEST_ERRORS

LOGGER = logging.getLogger(__name__)

#: Each metric update is a message from the stub to the server: a background thread publishes
#: this often (:meth:`MetricsPublisher.start`).
METRICS_INTERVAL_S = 1.0


class MetricsPublisher:
    """Publishes :class:`~recserve.backends.base.metrics.MetricSample` lists as ``pb_utils.MetricFamily``.

    Counters arrive as running totals and are published as increments; only changed values are
    sent, because every update is a message from the stub to the server (and waits for its answer).
    The first time a sample is seen its metric is created even at 0 (a counter without an
    increment, a gauge set), so every label combination a producer declares is on the endpoint from
    the first publication on.

    A model publishes through :meth:`publish_now` (in ``initialize``, in ``finalize``, and where its
    counts must be whole at once) and :meth:`start`: a daemon thread that publishes every
    ``interval_s``, so no request waits for the messages (sent from the request path, they stalled
    the request that sent them: docs/design/serving.md). Both send under one lock.
    """

    def __init__(self, interval_s: float = METRICS_INTERVAL_S) -> None:
        self.families: dict[str, Any] = {}  # keep references: metrics of a deleted family fail
        self.metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self.published: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish_now(self, samples: Callable[[], Sequence[MetricSample]]) -> None:
        """Take ``samples()`` and send what changed, under the publisher's lock."""
        with self.lock:
            self.publish(samples())

    def start(self, samples: Callable[[], Sequence[MetricSample]]) -> None:
        """Publish ``samples()`` every ``interval_s`` from a daemon thread until :meth:`stop`."""

        def run() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    self.publish_now(samples)
                except Exception:  # the metrics must never stop serving
                    LOGGER.exception("publishing metrics failed")

        self._thread = threading.Thread(target=run, name="recserve-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (waits for a publication under way)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def publish(self, samples: Sequence[MetricSample]) -> None:
        """Send what changed since the last call (and the process's error counts by code), unlocked.

        :meth:`publish_now` calls it under the lock.
        """
        for sample in [*samples, *REQUEST_ERRORS.samples()]:
            key = (sample.name, sample.labels)
            previous = self.published.get(key, 0.0 if sample.kind == "counter" else None)
            metric = self.metrics.get(key)
            if sample.value == previous and metric is not None:
                continue
            if metric is None:  # first seen: created even at 0, so the series exists before it counts
                family = self.families.get(sample.name)
                if family is None:
                    kind = (
                        pb_utils.MetricFamily.COUNTER
                        if sample.kind == "counter"
                        else pb_utils.MetricFamily.GAUGE
                    )
                    family = self.families[sample.name] = pb_utils.MetricFamily(
                        name=sample.name, description=sample.description, kind=kind
                    )
                metric = self.metrics[key] = family.Metric(labels=dict(sample.labels))
            if sample.kind == "counter":
                assert previous is not None  # a counter's previous total defaults to 0.0
                if sample.value != previous:
                    metric.increment(sample.value - previous)
            else:
                metric.set(sample.value)
            self.published[key] = sample.value
