"""The Redis-outage experiment's probe: a closed loop of ``ctr`` requests and the store's metrics.

:class:`OutageProbe` sends one request at a time over one gRPC channel and closes each phase with the
L3 counters, readiness and the store's gauges scraped from Triton's metrics endpoint
(:class:`PhaseResult`); :func:`l3_serving` and :func:`breaker_opened` are the conditions the
transitions wait for. Used by :mod:`recserve.perf.lab.redis_outage`.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.traffic import infer_request
from recserve.server import LOOPBACK, TritonServer

REFERENCE_ATOL = 1e-5  # served (ONNX Runtime, bucketed) against the in-process PyTorch reference
L3_REASONS = ("timeout", "error", "breaker_open", "busy")
_SAMPLE = re.compile(r"^(\w+)(\{[^}]*\})?\s+(\S+)$")


def scrape(metrics_url: str) -> dict[str, float]:
    """The recserve series of Triton's metrics endpoint: ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1).startswith("recserve_"):
            values[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return values


def models_ready(server: TritonServer, models: tuple[str, ...]) -> bool:
    """Server ready and every model in ``models`` ready (HTTP health endpoints)."""
    if not server.is_ready():
        return False
    for model in models:
        try:
            with urllib.request.urlopen(
                f"http://{server.http_url}/v2/models/{model}/ready", timeout=5
            ) as response:
                if response.status != 200:
                    return False
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False
    return True


@dataclass
class PhaseResult:
    """One phase: latencies, failures, and the store's state at its end."""

    kind: str  # a phase of recserve.perf.lab.redis_outage (UP, GOING_DOWN, ...), or a warm-up
    round: int = 0  # 1.. for the repeated phases
    latencies_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # responses equal to the in-process reference, which finds every item row: served by L3 (or, while
    # it is down, by L1 rows copied from it before its next rebuild); others got some default rows
    all_rows_found: int = 0
    l3: dict[str, float] = field(default_factory=dict)  # during the phase: "calls", and errors by reason
    ready: bool = False
    store_healthy: float = float("nan")
    breaker_open: float = float("nan")

    @property
    def name(self) -> str:
        """Kind and round, e.g. ``redis up 2``."""
        return f"{self.kind} {self.round}" if self.round else self.kind

    @property
    def requests(self) -> int:
        """Requests sent."""
        return len(self.latencies_ms) + len(self.failures)

    @classmethod
    def pooled(cls, kind: str, phases: list[PhaseResult]) -> PhaseResult:
        """One result holding the requests of ``phases`` (the same kind over several rounds)."""
        merged = cls(kind, ready=all(p.ready for p in phases))
        for p in phases:
            merged.latencies_ms += p.latencies_ms
            merged.failures += p.failures
            merged.all_rows_found += p.all_rows_found
            for key, value in p.l3.items():
                merged.l3[key] = merged.l3.get(key, 0.0) + value
        return merged

    def percentile(self, q: float) -> float:
        """Latency percentile of the served requests, ms."""
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")


class OutageProbe:
    """A closed loop of identical ``ctr`` requests over one gRPC channel, with the store's metrics."""

    def __init__(
        self, server: TritonServer, spec: ModelSpec, wire: dict[str, np.ndarray], reference: np.ndarray
    ) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.server = server
        self.models = (spec.name, EMBEDDING_LOOKUP)  # readiness: the ensemble and the L3 step
        self.message = infer_request(spec.name, wire)  # asks for the probabilities only
        self.channel = grpc.insecure_channel(server.grpc_url)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.reference = reference  # the scores when L3 serves every item row

    def all_rows_found(self, probabilities: np.ndarray | None) -> bool:
        """Whether a response has the scores of every item row found (none served its default)."""
        return probabilities is not None and np.allclose(
            probabilities, self.reference, rtol=0, atol=REFERENCE_ATOL
        )

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def send(self, result: PhaseResult) -> np.ndarray | None:
        """One request; its probabilities, or None when it failed (recorded in ``result``)."""
        started = time.perf_counter()
        try:
            response = self.stub.ModelInfer(self.message, timeout=30)
        except Exception as exc:  # every failure is counted, none may happen
            result.failures.append(str(exc)[:300])
            return None
        result.latencies_ms.append((time.perf_counter() - started) * 1e3)
        probabilities = np.frombuffer(response.raw_output_contents[0], np.float32)
        result.all_rows_found += self.all_rows_found(probabilities)
        return probabilities

    def metrics(self) -> dict[str, float]:
        """The store's metrics now."""
        return scrape(f"{LOOPBACK}:{self.server.ports.metrics}")

    def run(self, kind: str, requests: int, round_: int = 0) -> PhaseResult:
        """``requests`` requests, one after the other; L3 counters and readiness around them."""
        result = PhaseResult(kind, round_)
        before = self.metrics()
        for _ in range(requests):
            self.send(result)
        self._close_phase(result, before)
        return result

    def until(
        self,
        kind: str,
        condition: Callable[[dict[str, float], bool], bool],
        timeout_s: float,
        round_: int = 0,
    ) -> PhaseResult:
        """Requests until ``condition(metrics, all rows found in the last response)`` holds.

        The condition is checked every 0.25 s.
        """
        result = PhaseResult(kind, round_)
        before = self.metrics()
        checked = time.monotonic()
        deadline = checked + timeout_s
        while True:
            last = self.send(result)
            if time.monotonic() - checked >= 0.25:
                checked = time.monotonic()
                metrics = self.metrics()
                if condition(metrics, self.all_rows_found(last)):
                    break
                if checked > deadline:
                    store = {
                        k.removeprefix("recserve_store_"): v
                        for k, v in metrics.items()
                        if k.startswith("recserve_store_")
                    }
                    raise TimeoutError(
                        f"{result.name}: not reached within {timeout_s:.0f} s "
                        f"({len(result.failures)} failed); store metrics {store}"
                    )
        self._close_phase(result, before)
        return result

    def _close_phase(self, result: PhaseResult, before: dict[str, float]) -> None:
        after = self.metrics()
        series = {"calls": "recserve_store_l3_calls_total"}
        series.update(
            {reason: f'recserve_store_l3_errors_total{{reason="{reason}"}}' for reason in L3_REASONS}
        )
        result.l3 = {name: after.get(key, 0.0) - before.get(key, 0.0) for name, key in series.items()}
        result.ready = models_ready(self.server, self.models)
        result.store_healthy = after.get("recserve_store_healthy", float("nan"))
        result.breaker_open = after.get("recserve_store_l3_breaker_open", float("nan"))


def l3_serving(metrics: dict[str, float], all_rows_found: bool) -> bool:
    """L3 serves: the store is healthy, the breaker closed, and the last response found every item row."""
    healthy = (
        metrics.get("recserve_store_healthy") == 1.0 and metrics.get("recserve_store_l3_breaker_open") == 0.0
    )
    return healthy and all_rows_found


def breaker_opened(metrics: dict[str, float], all_rows_found: bool) -> bool:
    """The L3 circuit breaker is open (whatever the last response)."""
    return metrics.get("recserve_store_l3_breaker_open") == 1.0
