"""Offered load for ``recserve bench-longseq``: workloads' requests sent on a fixed schedule.

:func:`offer` sends pre-serialised gRPC requests (cycled) at a fixed rate for a fixed time without
waiting for answers, as users' traffic arrives, so that every workload of a load point meets the
same offered load whatever its own speed; several workloads may share one stream, interleaved
request by request, so that the machine's drift from second to second reaches them alike.
:class:`Phase` holds what became of a workload's requests. A workload the server cannot keep up
with shows it as latency (and as requests unanswered within the timeout, counted as failed), not as
a lower offered rate.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from recserve.perf.harness.traffic import infer_request

T = TypeVar("T")

#: A request unanswered this long counts as failed.
TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Requests:
    """One workload's requests, serialised once: ``rows`` rows each, ``bytes`` on the wire on average."""

    model: str
    messages: tuple[Any, ...]
    rows: int

    @classmethod
    def of(cls, model: str, requests: list[dict[str, np.ndarray]]) -> Requests:
        """Serialise ``requests`` (all of the same number of rows)."""
        rows = {next(iter(r.values())).shape[0] for r in requests}
        if len(rows) != 1:
            raise ValueError(f"a workload's requests have one number of rows, got {sorted(rows)}")
        return cls(model, tuple(infer_request(model, r) for r in requests), rows.pop())

    @property
    def request_bytes(self) -> float:
        """Mean serialised size of a request, in bytes."""
        return float(np.mean([m.ByteSize() for m in self.messages]))


@dataclass
class Phase:
    """What became of one workload's requests in one round at one load point."""

    rate: float
    seconds: float
    rows: int
    latencies_ms: list[float] = field(default_factory=list)
    failed: int = 0
    sent: int = 0
    late_ms: list[float] = field(default_factory=list)  # how late each request left its schedule
    elapsed_s: float = 0.0

    def figures(self) -> dict[str, float]:
        """p50/p99 of the served, rows/s served over the phase, failures and the sender's lateness."""
        served = np.asarray(self.latencies_ms)
        p50, p99 = (float(v) for v in np.percentile(served, [50, 99])) if served.size else (np.inf, np.inf)
        return {
            "p50_ms": p50,
            "p99_ms": p99,
            "rows_per_s": served.size * self.rows / self.elapsed_s if self.elapsed_s > 0 else 0.0,
            "offered_rows_per_s": self.rate * self.rows,
            "sent": float(self.sent),
            "failed": float(self.failed),
            "sender_late_p99_ms": float(np.percentile(self.late_ms, 99)) if self.late_ms else 0.0,
        }


def offer(
    streams: Mapping[str, tuple[str, Requests]], rate: float, seconds: float, seed: int = 0
) -> dict[str, Phase]:
    """One or more workloads' requests, interleaved one by one in one stream of ``rate`` per second.

    ``streams``: per workload, the server's gRPC address and its requests (cycled). Each workload
    sends ``rate * seconds`` requests, in cycles of one request of each in a new order
    (:func:`mixed_order`), so the stream lasts ``seconds`` per workload and every workload meets the
    same moments of the machine. A workload's ``elapsed_s`` is its share of the stream's span, from
    the first send to the last answer (the span over the number of workloads): a server that falls
    behind serves fewer rows per second than were offered.
    """
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    names = list(streams)
    phases = {name: Phase(rate, seconds, streams[name][1].rows) for name in names}
    lock, done = threading.Lock(), threading.Semaphore(0)

    def record(future: Any, phase: Phase, sent_at: float) -> None:
        latency = (time.monotonic() - sent_at) * 1e3
        with lock:
            if future.exception() is None:
                phase.latencies_ms.append(latency)
            else:
                phase.failed += 1
        done.release()

    each = max(int(rate * seconds), 1)
    order = mixed_order(names, each, seed)
    with ExitStack() as stack:
        channels = {
            url: stack.enter_context(grpc.insecure_channel(url)) for url in {u for u, _ in streams.values()}
        }
        stubs = {url: service_pb2_grpc.GRPCInferenceServiceStub(c) for url, c in channels.items()}
        interval, sent = 1.0 / rate, dict.fromkeys(names, 0)
        start = time.monotonic()
        for i, name in enumerate(order):
            due = start + i * interval
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            url, requests = streams[name]
            phase, sent_at = phases[name], time.monotonic()
            phase.late_ms.append((sent_at - due) * 1e3)
            message = requests.messages[sent[name] % len(requests.messages)]
            future = stubs[url].ModelInfer.future(message, timeout=TIMEOUT_S)
            future.add_done_callback(lambda f, p=phase, s=sent_at: record(f, p, s))
            sent[name] += 1
            phase.sent += 1
        for _ in order:
            done.acquire(timeout=2 * TIMEOUT_S)
        span = time.monotonic() - start
    for phase in phases.values():
        phase.elapsed_s = span / len(names)
    return phases


def mixed_order(names: list[str], each: int, seed: int) -> list[str]:
    """``each`` cycles of ``names``, every cycle in a new random order (seeded): a stream's schedule.

    No workload always follows the same one, so none pays for, or profits from, another's requests.
    """
    rng = np.random.default_rng(seed)
    return [names[i] for _ in range(each) for i in rng.permutation(len(names))]


def warm(url: str, requests: Requests) -> None:
    """Each request once, one at a time (buckets, caches and connections warmed before the clock)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for message in requests.messages:
            stub.ModelInfer(message, timeout=3 * TIMEOUT_S)


def round_order(names: Sequence[T], number: int) -> list[T]:
    """The order of the workloads in round ``number``: a new start and a new stride each round.

    Each workload follows a different one in each round (as long as there are strides coprime with
    the count: 7 workloads, 6 rounds), so no workload pays for, or profits from, always running after
    the same one. A mere rotation would keep every workload's predecessor: W2 would nearly always
    run after W1, the 4,096-event workload, and the A/A copy after W0.
    """
    count = len(names)
    strides = [s for s in range(1, count) if math.gcd(s, count) == 1] or [1]
    stride = strides[number % len(strides)]
    start = 2 * number  # the last workload, start - stride, changes from round to round too
    return [names[(start + step * stride) % count] for step in range(count)]
