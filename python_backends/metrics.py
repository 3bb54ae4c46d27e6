"""Metric values as plain data: backends produce them, the Triton adapter publishes them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricSample:
    """One value for the metrics endpoint; counters are running totals since start."""

    name: str
    kind: str  # "counter" or "gauge"
    description: str
    labels: tuple[tuple[str, str], ...]
    value: float
