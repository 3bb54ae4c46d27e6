"""The in-process rate: the same feature -> lookup -> dense code called directly, no server."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.spec import ModelSpec


@dataclass(frozen=True)
class InProcessRate:
    """Closed-loop, one thread: rows per second and per-batch latency percentiles."""

    batch_size: int
    rows_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float


def measure_inprocess(spec: ModelSpec, repository: Path, batch_size: int, seconds: float = 3.0) -> InProcessRate:
    """Call the ONNX Runtime pipeline on pre-built request tensors for ``seconds``."""
    pipeline = reference_pipeline(spec, repository, runtime="onnx")
    rows = generate(spec, batch_size * 16, seed=7)
    batches = [rows.take(slice(i * batch_size, (i + 1) * batch_size)).to_wire(spec) for i in range(16)]
    for batch in batches[:4]:
        pipeline.predict(batch)  # warm-up
    latencies = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        t0 = time.perf_counter()
        pipeline.predict(batches[len(latencies) % len(batches)])
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    ms = np.asarray(latencies) * 1e3
    p50, p95, p99 = (float(v) for v in np.percentile(ms, [50, 95, 99]))
    return InProcessRate(batch_size, len(latencies) * batch_size / elapsed, p50, p95, p99)
