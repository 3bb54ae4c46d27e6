"""``recserve overload``: open-loop load at fractions and multiples of measured capacity.

Capacity is measured closed-loop first (``concurrency`` requests in flight). Then requests are sent
on a fixed schedule, whatever the server does (open loop, as real traffic arrives): half of
capacity, then a spike at ``spike_factor`` times capacity, then half of capacity again. Each
request ends as served, shed (UNAVAILABLE: the queue policy refused it) or failed (anything else).
The report gives accepted and rejection latency percentiles per phase and the time the server
takes after the spike to serve at its normal latency again.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from recserve.build.synthetic import generate
from recserve.perf.soak import infer_inputs, infer_request, scratch_repository
from recserve.server import Ports, TritonServer
from recserve.spec import ModelSpec

LOGGER = logging.getLogger(__name__)

SERVED, SHED, FAILED = "served", "shed", "failed"


@dataclass(frozen=True)
class Outcome:
    """One request: when it was sent (s since the run began), its latency and how it ended."""

    phase: int
    sent_s: float
    latency_ms: float
    result: str
    message: str = ""


def measure_capacity(url: str, spec: ModelSpec, request: dict[str, np.ndarray], seconds: float = 4.0, concurrency: int = 8) -> float:
    """Requests per second served closed-loop with ``concurrency`` requests in flight."""
    done, stop = [0], threading.Event()
    lock = threading.Lock()

    def loop() -> None:
        with grpcclient.InferenceServerClient(url) as client:
            inputs = infer_inputs(grpcclient, request)
            while not stop.is_set():
                try:
                    client.infer(spec.name, inputs)
                    with lock:
                        done[0] += 1
                except InferenceServerException:
                    continue

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # warm-up
    with lock:
        start_count, started = done[0], time.monotonic()
    time.sleep(seconds)
    with lock:
        rate = (done[0] - start_count) / (time.monotonic() - started)
    stop.set()
    for thread in threads:
        thread.join(30)
    return rate


def open_loop(url: str, spec: ModelSpec, request: dict[str, np.ndarray], phases: list[tuple[float, float]]) -> list[Outcome]:
    """Send requests at ``rate`` per second for ``seconds``, phase after phase, without waiting for answers.

    The request message is serialised once and sent with the raw gRPC stub, so that the sender
    spends as little of the machine as it can. A phase starts when the previous one has sent its
    last request, so a sender that fell behind does not carry a burst into the next phase; the rate
    it really offered is in :class:`PhaseStats`.
    """
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    outcomes: list[Outcome] = []
    lock = threading.Lock()
    pending = threading.Semaphore(0)
    sent = 0
    origin = time.monotonic()
    message = infer_request(spec.name, request)

    def record(future: grpc.Future, sent_at: float, phase: int) -> None:
        latency = (time.monotonic() - sent_at) * 1e3
        error = future.exception()
        if error is None:
            outcome = Outcome(phase, sent_at - origin, latency, SERVED)
        else:
            code = error.code() if isinstance(error, grpc.Call) else None
            result = SHED if code == grpc.StatusCode.UNAVAILABLE else FAILED
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            outcome = Outcome(phase, sent_at - origin, latency, result, (details or "")[:200])
        with lock:
            outcomes.append(outcome)
        pending.release()

    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for phase, (rate, seconds) in enumerate(phases):
            phase_start, interval = time.monotonic(), 1.0 / rate
            for i in range(int(rate * seconds)):
                delay = phase_start + i * interval - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                sent_at = time.monotonic()
                future = stub.ModelInfer.future(message, timeout=30)
                future.add_done_callback(lambda f, sent_at=sent_at, phase=phase: record(f, sent_at, phase))
                sent += 1
        for _ in range(sent):
            pending.acquire(timeout=60)
    return sorted(outcomes, key=lambda o: o.sent_s)


@dataclass(frozen=True)
class PhaseStats:
    """Percentiles of one phase."""

    name: str
    rate: float
    offered: float
    sent: int
    served: int
    shed: int
    failed: int
    served_p50_ms: float
    served_p99_ms: float
    shed_p99_ms: float


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def phase_stats(name: str, rate: float, outcomes: list[Outcome]) -> PhaseStats:
    """Counts and latency percentiles of the outcomes of one phase."""
    served = [o.latency_ms for o in outcomes if o.result == SERVED]
    shed = [o.latency_ms for o in outcomes if o.result == SHED]
    span = outcomes[-1].sent_s - outcomes[0].sent_s if len(outcomes) > 1 else float("nan")
    return PhaseStats(
        name, rate, (len(outcomes) - 1) / span, len(outcomes), len(served), len(shed), sum(o.result == FAILED for o in outcomes),
        _p(served, 50), _p(served, 99), _p(shed, 99),
    )


def recovery_s(outcomes: list[Outcome], spike_end_s: float, normal_p99_ms: float, window_s: float = 1.0) -> float:
    """Seconds after the spike until a whole window is served, none shed, p99 within 1.5x normal."""
    after = [o for o in outcomes if o.sent_s >= spike_end_s]
    start = spike_end_s
    while after and start < after[-1].sent_s:
        window = [o for o in after if start <= o.sent_s < start + window_s]
        if window and all(o.result == SERVED for o in window) and _p([o.latency_ms for o in window], 99) <= 1.5 * normal_p99_ms:
            return start - spike_end_s
        start += window_s / 4
    return float("inf")


@dataclass(frozen=True)
class OverloadReport:
    """Capacity, per-phase statistics and the recovery time."""

    capacity_rps: float
    phases: list[PhaseStats]
    recovery_s: float
    failures: list[str]
    shed_reasons: dict[str, int]

    def table(self) -> str:
        """Markdown table plus the verdict against the targets."""
        lines = [
            f"capacity (closed loop) {self.capacity_rps:.0f} requests/s",
            "",
            "| phase | target req/s | sent req/s | sent | served | shed | failed | served p50 ms | served p99 ms | shed p99 ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for s in self.phases:
            lines.append(
                f"| {s.name} | {s.rate:.0f} | {s.offered:.0f} | {s.sent} | {s.served} | {s.shed} | {s.failed} | "
                f"{s.served_p50_ms:.1f} | {s.served_p99_ms:.1f} | {s.shed_p99_ms:.1f} |"
            )
        half, spike = self.phases[0], self.phases[1]
        lines += [
            "",
            f"spike served p99 / half-capacity served p99 = {spike.served_p99_ms / half.served_p99_ms:.2f} (target <= 1.5)",
            f"spike shed p99 = {spike.shed_p99_ms:.1f} ms (target < 5)",
            f"back to normal {self.recovery_s:.1f} s after the spike (target <= 10)",
            "shed because: " + ", ".join(f"{reason} ({count})" for reason, count in self.shed_reasons.items()),
        ]
        return "\n".join(lines)


def run_overload(
    url: str, spec: ModelSpec, rows: int = 8, spike_factor: float = 2.0, seconds: float = 5.0, recovery_window_s: float = 10.0
) -> OverloadReport:
    """Measure capacity, then half capacity, a spike and half capacity again, open loop."""
    request = generate(spec, rows, seed=5).to_wire(spec)
    capacity = measure_capacity(url, spec, request)
    half, spike = capacity / 2, capacity * spike_factor
    outcomes = open_loop(url, spec, request, [(half, seconds), (spike, seconds), (half, recovery_window_s)])
    names = ("half capacity", f"{spike_factor:g}x capacity", "half capacity, after")
    stats = [
        phase_stats(name, rate, [o for o in outcomes if o.phase == phase])
        for phase, (name, rate) in enumerate(zip(names, (half, spike, half)))
    ]
    spike_end = max(o.sent_s for o in outcomes if o.phase == 1)
    back = recovery_s(outcomes, spike_end, stats[0].served_p99_ms)
    reasons: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.result == SHED:
            reason = outcome.message.split(", ")[-1]
            reasons[reason] = reasons.get(reason, 0) + 1
    return OverloadReport(capacity, stats, back, [o.message for o in outcomes if o.result == FAILED][:5], reasons)


def overload_command(spec: ModelSpec, repository: Path, rows: int, spike_factor: float, seconds: float) -> int:
    """``recserve overload``: a private server on free loopback ports; prints the table."""
    with tempfile.TemporaryDirectory(prefix="recserve-overload-") as scratch:
        root = scratch_repository(repository, Path(scratch) / "repository")
        with TritonServer(root, Ports.free(), log_path=Path(scratch) / "server.log") as server:
            report = run_overload(server.grpc_url, spec, rows, spike_factor, seconds)
    print(report.table())
    return 0 if not report.failures else 1
