"""What a variant did, read from the running stack's metrics: the canary's windows and figures.

A :class:`Window` holds one variant's running totals (judged requests, server-side failures, client
errors, the proxy's latency histogram, the served-probability histogram); the difference of two is
what it did in between. :func:`triton_window`, :func:`envoy_latency` and :func:`envoy_timeouts`
read them from a tritonserver's and Envoy's Prometheus text.

The canary judges the server, not its clients. A failure is a request the variant failed by its own
fault: a step answered ``INTERNAL`` or ``UNAVAILABLE`` (a non-finite output is ``INTERNAL``),
counted by the steps in ``recserve_request_errors_total{code}``; a step's queue refused it or a
non-Python step failed (Triton's ``nv_inference_request_failure`` of the steps with reason
``REJECTED`` or ``BACKEND``); or Envoy timed it out (``envoy_cluster_upstream_rq_timeout`` of the
variant's clusters). The judged requests are the ensembles' successes plus those failures. Client
errors (:data:`CLIENT_CODES`) are counted apart and are in neither. Triton 2.51 cannot make this
split itself: its ensemble counts a failed request twice with ``reason="OTHER"`` whatever the
code, and a Python step counts a request it answers with an error as a success. Requests that
Triton's core refuses before any step runs (a wrong shape, an unknown input) are in none of
Triton's counters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from recserve.access import observe

PROBABILITY = "recserve_served_probability"
#: What the steps count failed requests by (``recserve.backends.base.request_errors``), and the codes of
#: those a client caused; every other code is the server's fault.
REQUEST_ERRORS = "recserve_request_errors_total"
CLIENT_CODES = frozenset({"INVALID_ARG", "NOT_FOUND", "UNSUPPORTED", "ALREADY_EXISTS", "CANCELLED"})
#: Triton's failure reasons of a step that are the server's fault (queue refusals, non-Python steps).
SERVER_REASONS = frozenset({"REJECTED", "BACKEND"})


@dataclass(frozen=True)
class Window:
    """Running totals of one variant (or their difference over a stretch of traffic).

    ``requests`` are the judged ones (served, or failed by the server), ``failures`` the
    server-side failures among them; ``client_errors`` are the requests refused for the client's
    fault, in neither. ``latency`` and ``scores`` are cumulative histograms: upper edge -> count at
    or below it (``inf`` holds every observation).
    """

    requests: float = 0.0
    failures: float = 0.0
    latency: Mapping[float, float] = field(default_factory=dict)  # ms
    scores: Mapping[float, float] = field(default_factory=dict)  # probability
    score_sum: float = 0.0
    client_errors: float = 0.0

    def since(self, start: Window) -> Window:
        """What happened after ``start`` (a counter that went down was reset: its value counts)."""

        def delta(now: float, then: float) -> float:
            return now - then if now >= then else now

        def histogram(now: Mapping[float, float], then: Mapping[float, float]) -> dict[float, float]:
            reset = any(now.get(le, 0.0) < then.get(le, 0.0) for le in then)
            return {le: n if reset else n - then.get(le, 0.0) for le, n in now.items()}

        return Window(
            delta(self.requests, start.requests),
            delta(self.failures, start.failures),
            histogram(self.latency, start.latency),
            histogram(self.scores, start.scores),
            delta(self.score_sum, start.score_sum),
            delta(self.client_errors, start.client_errors),
        )

    @property
    def error_rate(self) -> float:
        """Failed share of the requests (0 without requests)."""
        return self.failures / self.requests if self.requests else 0.0

    @property
    def timed(self) -> float:
        """Requests in the latency histogram."""
        return self.latency.get(math.inf, 0.0)

    @property
    def scored(self) -> float:
        """Rows in the score histogram."""
        return self.scores.get(math.inf, 0.0)

    def p99_ms(self) -> float | None:
        """The 99th percentile of the latency histogram (linear within a bucket); None when empty."""
        return quantile(self.latency, 0.99)

    def mean_score(self) -> float | None:
        """Mean served probability; None without scored rows."""
        return self.score_sum / self.scored if self.scored else None

    def score_shares(self) -> list[float]:
        """Share of the scored rows in each bucket of the score histogram (edges ascending)."""
        edges = sorted(self.scores)
        counts = [self.scores[le] - (self.scores[edges[i - 1]] if i else 0.0) for i, le in enumerate(edges)]
        total = sum(counts)
        return [c / total for c in counts] if total else [0.0] * len(counts)


def quantile(cumulative: Mapping[float, float], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram, linear within its bucket; None when empty.

    A quantile in the ``inf`` bucket is given as the last finite edge.
    """
    edges = sorted(cumulative)
    total = cumulative.get(math.inf, cumulative[edges[-1]] if edges else 0.0)
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in edges:
        count = cumulative[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, count
    return lower


def psi(expected: Sequence[float], actual: Sequence[float], floor: float = 1e-4) -> float:
    """Population stability index of two distributions over the same buckets (shares summing to 1).

    Empty buckets count as ``floor`` so that the index stays finite. Common reading: under 0.1 no
    shift, 0.1–0.25 a moderate one, over 0.25 a large one.
    """
    if len(expected) != len(actual):
        raise ValueError(f"PSI needs the same buckets, got {len(expected)} and {len(actual)}")
    total = 0.0
    for e, a in zip(expected, actual, strict=True):
        e, a = max(e, floor), max(a, floor)
        total += (a - e) * math.log(a / e)
    return total


def _edge(label: str) -> float:
    return math.inf if label == "+Inf" else float(label)


def triton_window(text: str, ensembles: str | Sequence[str]) -> Window:
    """One server's judged requests, server-side failures and client errors, and its score histogram.

    Args:
        text: the server's metrics (Prometheus text).
        ensembles: the ensembles whose successes count as served requests (every other model is a
            step of theirs).

    A server whose steps export no :data:`REQUEST_ERRORS` cannot tell client errors apart: every
    failure of its ensembles then counts as the server's.
    """
    judged = {ensembles} if isinstance(ensembles, str) else set(ensembles)
    served = ensemble_failures = step_failures = client = score_sum = 0.0
    by_code = False
    scores: dict[float, float] = {}
    for name, labels, value in observe.parse_exposition(text):
        model = labels.get("model")
        if name == "nv_inference_request_success" and model in judged:
            served += value
        elif name == "nv_inference_request_failure":
            if model in judged:
                ensemble_failures += value
            elif labels.get("reason") in SERVER_REASONS:
                step_failures += value
        elif name == REQUEST_ERRORS:
            by_code = True
            if labels.get("code") in CLIENT_CODES:
                client += value
            else:
                step_failures += value
        elif name == f"{PROBABILITY}_bucket":
            scores[_edge(labels["le"])] = scores.get(_edge(labels["le"]), 0.0) + value
        elif name == f"{PROBABILITY}_sum":
            score_sum += value
    failures = step_failures if by_code else ensemble_failures
    return Window(served + failures, failures, {}, scores, score_sum, client)


def scores_settled(text: str) -> bool:
    """Whether the served-probability histograms in ``text`` were read whole.

    A dense step publishes ``_count`` before its buckets and ``le="+Inf"`` last, one counter at a
    time (:class:`recserve.backends.base.metrics.ScoreHistogram`): a scrape inside a publication
    reads more rows in the counts than in the ``+Inf`` buckets.
    """
    counted = bucketed = 0.0
    for name, labels, value in observe.parse_exposition(text):
        if name == f"{PROBABILITY}_count":
            counted += value
        elif name == f"{PROBABILITY}_bucket" and labels.get("le") == "+Inf":
            bucketed += value
    return counted == bucketed


def envoy_latency(text: str, clusters: Sequence[str]) -> dict[float, float]:
    """The summed request-time histogram (ms) of ``clusters`` from Envoy's ``/stats/prometheus``."""
    latency: dict[float, float] = {}
    for name, labels, value in observe.parse_exposition(text):
        if name == "envoy_cluster_upstream_rq_time_bucket" and labels.get("envoy_cluster_name") in clusters:
            edge = _edge(labels["le"])
            latency[edge] = latency.get(edge, 0.0) + value
    return latency


def envoy_timeouts(text: str, clusters: Sequence[str]) -> float:
    """Requests of ``clusters`` that Envoy timed out (``upstream_rq_timeout``): the server's fault."""
    return sum(
        value
        for name, labels, value in observe.parse_exposition(text)
        if name == "envoy_cluster_upstream_rq_timeout" and labels.get("envoy_cluster_name") in clusters
    )


def plus(a: Window, b: Window) -> Window:
    """Two servers' totals added (the latency histogram is the proxy's, not added here)."""
    scores = {le: a.scores.get(le, 0.0) + b.scores.get(le, 0.0) for le in {*a.scores, *b.scores}}
    return Window(
        a.requests + b.requests,
        a.failures + b.failures,
        a.latency,
        scores,
        a.score_sum + b.score_sum,
        a.client_errors + b.client_errors,
    )
