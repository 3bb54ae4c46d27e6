"""Metric values as plain data: backends produce them, the Triton adapter publishes them."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MetricSample:
    """One value for the metrics endpoint; counters are running totals since start."""

    name: str
    kind: str  # "counter" or "gauge"
    description: str
    labels: tuple[tuple[str, str], ...]
    value: float


#: Upper edges of the served-probability histogram (a last bucket, ``+Inf``, holds the rest): fine
#: where click probabilities mostly lie, so that a shift of the distribution moves rows across edges.
PROBABILITY_EDGES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
PROBABILITY_METRIC = "recserve_served_probability"
PROBABILITY_HELP = "Probabilities served by the dense step, by dense version (a Prometheus histogram)"
#: Observed batches a :class:`ScoreHistogram` keeps before counting them on the request path.
FOLD_EVERY = 4096


class ScoreHistogram:
    """A running histogram of served probabilities, exported as a Prometheus histogram.

    ``<name>_bucket{le=...}`` counts rows at or below each edge (cumulative, ``+Inf`` = all rows),
    ``<name>_sum`` and ``<name>_count`` give the mean. The canary compares two versions' histograms
    over the same traffic window (population stability index, mean ratio).

    Args:
        labels: labels of every series, e.g. ``(("dense_version", "1"),)``.
    """

    def __init__(self, labels: tuple[tuple[str, str], ...]) -> None:
        self.labels = labels
        self._counts = np.zeros(len(PROBABILITY_EDGES) + 1, dtype=np.int64)  # per bucket, not cumulative
        self._total = 0.0
        self._pending: list[np.ndarray] = []  # observed, not yet counted
        self.lock = threading.Lock()

    def observe(self, probabilities: np.ndarray) -> None:
        """Keep served probabilities (any shape, copied) to count when the histogram is next read.

        The bucketing runs then, on the metrics thread, not on the request path; at most
        :data:`FOLD_EVERY` batches wait.
        """
        values = np.array(probabilities, dtype=np.float32).ravel()
        with self.lock:
            self._pending.append(values)
            if len(self._pending) >= FOLD_EVERY:
                self._fold()

    def _fold(self) -> None:  # under the lock
        if not self._pending:
            return
        values = np.concatenate(self._pending).astype(np.float64)
        self._pending = []
        buckets = np.searchsorted(PROBABILITY_EDGES, values, side="left")  # value <= edge: that bucket
        self._counts += np.bincount(buckets, minlength=len(self._counts))
        self._total += float(values.sum())

    @property
    def counts(self) -> np.ndarray:
        """Rows counted per bucket (not cumulative), everything observed included."""
        with self.lock:
            self._fold()
            return self._counts.copy()

    def samples(self) -> list[MetricSample]:
        """The histogram as counters: count and sum first, then the cumulative buckets up to ``+Inf``.

        Published in this order, one message per counter, a scrape that falls inside a
        publication sees ``_count`` ahead of ``le="+Inf"``: the canary re-reads until they agree
        (:func:`recserve.access.canary.figures.scores_settled`), since half-published buckets
        would put a second of rows on one side of an edge only.
        """
        with self.lock:
            self._fold()
            cumulative, total = np.cumsum(self._counts), self._total
        edges = [*(f"{edge:g}" for edge in PROBABILITY_EDGES), "+Inf"]
        return [
            MetricSample(
                f"{PROBABILITY_METRIC}_count", "counter", PROBABILITY_HELP, self.labels, float(cumulative[-1])
            ),
            MetricSample(f"{PROBABILITY_METRIC}_sum", "counter", PROBABILITY_HELP, self.labels, total),
            *(
                MetricSample(
                    f"{PROBABILITY_METRIC}_bucket", "counter", PROBABILITY_HELP, (*self.labels, ("le", le)), n
                )
                for le, n in zip(edges, cumulative.tolist(), strict=True)
            ),
        ]
