"""Failed requests of a step counted by their Triton error code, for the metrics endpoint.

Triton 2.51 cannot tell a client's mistake from a server fault: a Python-backend step that answers
a request with an error still counts a success for the step, and the ensemble counts the failure
(twice, with ``reason="OTHER"``) whatever its code. So each step counts the errors it answers with,
by code, as ``recserve_request_errors_total{code=...}``; the canary reads them to judge a variant by
its server-side failures only (``INTERNAL``, ``UNAVAILABLE``), never by the requests clients got
wrong (``INVALID_ARG``).
"""

from __future__ import annotations

import threading

from recserve.backends.base.metrics import MetricSample

REQUEST_ERRORS_METRIC = "recserve_request_errors_total"
REQUEST_ERRORS_HELP = "Requests a step answered with an error, by Triton error code"
#: Codes exported from the start (at 0), so that a reader sees the series before any error.
DECLARED_CODES = ("INVALID_ARG", "INTERNAL")


class RequestErrorCounts:
    """Running totals of the errors one step answered with, by code (thread-safe)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(DECLARED_CODES, 0)
        self.lock = threading.Lock()

    def count(self, code: str) -> None:
        """One request failed with ``code`` (a Triton error code name, e.g. ``INVALID_ARG``)."""
        with self.lock:
            self.counts[code] = self.counts.get(code, 0) + 1

    def samples(self) -> list[MetricSample]:
        """One counter per code seen (the declared ones at least)."""
        with self.lock:
            counts = dict(self.counts)
        return [
            MetricSample(REQUEST_ERRORS_METRIC, "counter", REQUEST_ERRORS_HELP, (("code", code),), float(n))
            for code, n in sorted(counts.items())
        ]
