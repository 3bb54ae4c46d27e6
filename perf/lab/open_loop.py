"""Open-loop load: requests sent on a fixed schedule whatever the server does, and what became of them.

:func:`open_loop` sends one pre-serialised request at given rates, phase after phase, over the raw
gRPC stub; each :class:`Outcome` ends as served, shed (UNAVAILABLE: the queue policy refused it) or
failed. :func:`phase_stats` and :func:`recovery_s` summarise them. Used by ``recserve lab overload``
(:mod:`recserve.perf.lab.overload`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.traffic import infer_request

SERVED, SHED, FAILED = "served", "shed", "failed"
#: A window after the spike counts as normal again when at most this share of it is shed.
NORMAL_SHED_SHARE = 0.01


@dataclass(frozen=True)
class Outcome:
    """One request: when it was due and sent (s since the run began), its latency and how it ended."""

    phase: int
    due_s: float
    sent_s: float
    latency_ms: float
    result: str
    message: str = ""


def open_loop(
    url: str,
    spec: ModelSpec,
    request: dict[str, np.ndarray],
    phases: list[tuple[float, float]],
    on_phase: Callable[[int], None] | None = None,
) -> list[Outcome]:
    """Send requests at ``rate`` per second for ``seconds``, phase after phase, without waiting for answers.

    The request message is serialised once and sent with the raw gRPC stub, so that the sender
    spends as little of the machine as it can; each outcome keeps when it was due and when it left,
    so a sender that fell behind shows. A phase starts when the previous one has sent its last
    request, so a late sender does not carry a burst into the next phase. ``on_phase(i)`` is called
    before phase ``i`` starts and, with ``len(phases)``, after the last request has left.
    """
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    outcomes: list[Outcome] = []
    lock = threading.Lock()
    pending = threading.Semaphore(0)
    sent = 0
    origin = time.monotonic()
    message = infer_request(spec.name, request)

    def record(future: grpc.Future, due: float, sent_at: float, phase: int) -> None:
        latency = (time.monotonic() - sent_at) * 1e3
        error = future.exception()
        timing = (phase, due - origin, sent_at - origin, latency)
        if error is None:
            outcome = Outcome(*timing, SERVED)
        else:
            code = error.code() if isinstance(error, grpc.Call) else None
            result = SHED if code == grpc.StatusCode.UNAVAILABLE else FAILED
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            outcome = Outcome(*timing, result, (details or "")[:200])
        with lock:
            outcomes.append(outcome)
        pending.release()

    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for phase, (rate, seconds) in enumerate(phases):
            if on_phase is not None:
                on_phase(phase)
            phase_start, interval = time.monotonic(), 1.0 / rate
            for i in range(int(rate * seconds)):
                due = phase_start + i * interval
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                sent_at = time.monotonic()
                future = stub.ModelInfer.future(message, timeout=30)
                future.add_done_callback(
                    lambda f, due=due, sent_at=sent_at, phase=phase: record(f, due, sent_at, phase)
                )
                sent += 1
        if on_phase is not None:
            on_phase(len(phases))
        for _ in range(sent):
            pending.acquire(timeout=60)
    return sorted(outcomes, key=lambda o: o.sent_s)


@dataclass(frozen=True)
class PhaseStats:
    """Counts and latency percentiles of one phase (``sender_late_p99_ms``: how late requests left)."""

    name: str
    rate: float
    offered: float
    sent: int
    served: int
    shed: int
    failed: int
    served_p50_ms: float
    served_p90_ms: float
    served_p99_ms: float
    shed_p50_ms: float
    shed_p99_ms: float
    sender_late_p99_ms: float


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def phase_stats(name: str, rate: float, outcomes: list[Outcome]) -> PhaseStats:
    """Counts and latency percentiles of the outcomes of one phase."""
    served = [o.latency_ms for o in outcomes if o.result == SERVED]
    shed = [o.latency_ms for o in outcomes if o.result == SHED]
    span = outcomes[-1].sent_s - outcomes[0].sent_s if len(outcomes) > 1 else float("nan")
    late = [(o.sent_s - o.due_s) * 1e3 for o in outcomes]
    return PhaseStats(
        name,
        rate,
        (len(outcomes) - 1) / span,
        len(outcomes),
        len(served),
        len(shed),
        sum(o.result == FAILED for o in outcomes),
        _p(served, 50),
        _p(served, 90),
        _p(served, 99),
        _p(shed, 50),
        _p(shed, 99),
        _p(late, 99),
    )


def recovery_s(
    outcomes: list[Outcome], spike_end_s: float, normal_p99_ms: float, window_s: float = 1.0
) -> float:
    """Seconds after the spike until a whole window sheds at most 1% and its p99 is within 1.5x normal."""
    after = [o for o in outcomes if o.sent_s >= spike_end_s]
    start = spike_end_s
    while after and start < after[-1].sent_s:
        window = [o for o in after if start <= o.sent_s < start + window_s]
        served = [o.latency_ms for o in window if o.result == SERVED]
        calm = window and sum(o.result != SERVED for o in window) <= NORMAL_SHED_SHARE * len(window)
        if calm and _p(served, 99) <= 1.5 * normal_p99_ms:
            return start - spike_end_s
        start += window_s / 4
    return float("inf")
