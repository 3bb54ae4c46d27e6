"""The in-process rate: the same feature -> lookup -> dense code called directly, no server."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.core.names import IDS_WIRE
from recserve.core.spec.model import ModelSpec


@dataclass(frozen=True)
class InProcessRate:
    """Closed-loop, one thread: rows per second and per-batch latency percentiles."""

    batch_size: int
    rows_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float


def measure_inprocess(
    spec: ModelSpec, repository: Path, batch_size: int, seconds: float = 3.0
) -> InProcessRate:
    """Call the ONNX Runtime pipeline on pre-built request tensors for ``seconds``.

    The requests are of the id form of the wire, as the served path gets them from the SDK and
    the perf input data.
    """
    pipeline = reference_pipeline(spec, repository, runtime="onnx")
    rows = generate(spec, batch_size * 16, seed=7)
    batches = [
        rows.take(slice(i * batch_size, (i + 1) * batch_size)).to_wire(spec, IDS_WIRE) for i in range(16)
    ]
    for batch in batches[:4]:
        pipeline.predict(batch)  # warm-up
    latencies_ms, elapsed = time_calls(pipeline.predict, batches, seconds)
    p50, p95, p99 = (float(v) for v in np.percentile(latencies_ms, [50, 95, 99]))
    return InProcessRate(batch_size, len(latencies_ms) * batch_size / elapsed, p50, p95, p99)


def time_calls(
    call: Callable[[Any], object], items: Sequence[Any], seconds: float
) -> tuple[np.ndarray, float]:
    """Call ``call`` on ``items`` in turn, one at a time, for ``seconds``.

    Returns:
        each call's latency in milliseconds, and the seconds that all calls took.
    """
    latencies: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        t0 = time.perf_counter()
        call(items[len(latencies) % len(items)])
        latencies.append(time.perf_counter() - t0)
    return np.asarray(latencies) * 1e3, time.perf_counter() - started
