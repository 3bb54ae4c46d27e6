"""``recserve lab overload``: open-loop load at fractions and multiples of measured capacity.

The server and the load generator get cores of their own where the machine has two or more:
tritonserver (and every stub it starts) is pinned to the first core this process may use, the
generator to the others, so that at twice capacity the generator is not starved by the server it
measures (nor the server by it). Capacity is measured closed-loop (``concurrency`` requests in
flight) on that same server, pinned the same way. Then requests are sent on a fixed schedule,
whatever the server does (open loop, as real traffic arrives): half of capacity, then a spike at
``spike_factor`` times capacity, then half of capacity again. Each request ends as served, shed
(UNAVAILABLE: the queue policy refused it) or failed (anything else). The report gives accepted and
rejection latency percentiles per phase, the time the server takes after the spike to serve at its
normal latency again, the cores each side used and, from Triton's statistics, where the time went
in each step during the spike.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from recserve.build import configs
from recserve.build.synthetic import generate
from recserve.core.names import STEPS
from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.stats import Snapshot, StepTimes, difference, snapshot
from recserve.perf.harness.traffic import infer_inputs, scratch_repository
from recserve.perf.lab.open_loop import FAILED, SHED, PhaseStats, open_loop, phase_stats, recovery_s
from recserve.server import Ports, TritonServer

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cores:
    """Which CPU cores the server and the load generator may use (None: not pinned)."""

    server: frozenset[int] | None
    client: frozenset[int] | None

    @classmethod
    def split(cls, available: set[int] | None = None) -> Cores:
        """The first available core for the server, the rest for the generator; unpinned on one core."""
        cores = sorted(os.sched_getaffinity(0) if available is None else available)
        if len(cores) < 2:
            return cls(None, None)
        return cls(frozenset(cores[:1]), frozenset(cores[1:]))

    def describe(self) -> str:
        """``server cores {0}, load generator cores {1}`` or that nothing is pinned."""
        if self.server is None or self.client is None:
            return "not pinned (fewer than 2 cores): server and load generator share the machine"
        return (
            f"server (tritonserver and its stubs) on cores {sorted(self.server)}, "
            f"load generator on cores {sorted(self.client)}"
        )


@contextlib.contextmanager
def pinned(cores: frozenset[int] | None) -> Iterator[None]:
    """Run the block with the calling thread on ``cores`` (threads it starts inherit them); restore after."""
    if cores is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def measure_capacity(
    url: str, spec: ModelSpec, request: dict[str, np.ndarray], seconds: float = 4.0, concurrency: int = 8
) -> float:
    """Requests per second served closed-loop with ``concurrency`` requests in flight.

    Refused requests are not counted.
    """
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
    if rate <= 0:
        raise RuntimeError(
            f"no request was served in {seconds:.0f} s with {concurrency} in flight: no capacity to measure"
        )
    return rate


def pinned_capacity(root: Path, spec: ModelSpec, rows: int, cores: Cores, log_path: Path) -> float:
    """Closed-loop capacity of ``root`` served with its ``config.pbtxt``, pinned as ``cores`` says.

    Queue policies that refuse by a time budget also refuse some closed-loop requests (a client whose
    request waits is not sending), so capacity is measured on the served configs, which have no queue
    policy in the bundled specs and refuse none.
    """
    request = generate(spec, rows, seed=5).to_wire(spec)
    with (
        TritonServer(root, Ports.free(), log_path=log_path, cpus=cores.server) as server,
        pinned(cores.client),
    ):
        return measure_capacity(server.grpc_url, spec, request)


@dataclass(frozen=True)
class OverloadReport:
    """Capacity, per-phase statistics, the recovery time and the steps' times during the spike."""

    capacity_rps: float
    phases: list[PhaseStats]
    recovery_s: float
    failures: list[str]
    shed_reasons: dict[str, int]
    spike_steps: list[StepTimes]
    cores: str
    queue: str

    def summary(self) -> dict[str, object]:
        """The figures as a JSON-ready dict: the two latency verdicts, recovery, failures and phases.

        ``served_p99_ratio`` is the spike's served p99 over the first half-capacity phase's;
        ``shed_p99_ms`` the spike's refusal p99 (NaN, written as null, when nothing was refused).
        """
        half, spike = self.phases[0], self.phases[1]

        def number(value: float) -> float | None:
            return None if np.isnan(value) or np.isinf(value) else round(float(value), 3)

        return {
            "served_p99_ratio": number(spike.served_p99_ms / half.served_p99_ms),
            "shed_p99_ms": number(spike.shed_p99_ms),
            "recovery_s": number(self.recovery_s),
            "capacity_rps": number(self.capacity_rps),
            "failed": sum(s.failed for s in self.phases),
            "failures": self.failures,
            "shed_reasons": self.shed_reasons,
            "queue": self.queue or "[serving.queue]",
            "cores": self.cores,
            "phases": [
                {key: number(v) if isinstance(v, float) else v for key, v in vars(s).items()}
                for s in self.phases
            ],
        }

    def table(self) -> str:
        """Markdown tables plus the verdict against the targets."""
        lines = [
            f"queue policy: {self.queue or '[serving.queue]'}; {self.cores}",
            f"capacity (closed loop, 8 in flight, [serving.queue] configs, same cores) "
            f"{self.capacity_rps:.0f} requests/s",
            "",
            "| phase | target req/s | sent req/s | sent | served | shed | failed "
            "| served p50 / p90 / p99 ms | shed p50 / p99 ms | sender late p99 ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for s in self.phases:
            lines.append(
                f"| {s.name} | {s.rate:.0f} | {s.offered:.0f} | {s.sent} | {s.served} | {s.shed} | "
                f"{s.failed} | {s.served_p50_ms:.1f} / {s.served_p90_ms:.1f} / {s.served_p99_ms:.1f} | "
                f"{s.shed_p50_ms:.1f} / {s.shed_p99_ms:.1f} | "
                f"{s.sender_late_p99_ms:.1f} |"
            )
        half, spike = self.phases[0], self.phases[1]
        lines += [
            "",
            f"spike served p99 / half-capacity served p99 = "
            f"{spike.served_p99_ms / half.served_p99_ms:.2f} (target <= 1.5)",
            f"spike shed p99 = {spike.shed_p99_ms:.1f} ms (target < 5)",
            f"back to normal {self.recovery_s:.1f} s after the spike (target <= 10)",
            "shed because: "
            + (
                ", ".join(f"{reason} ({count})" for reason, count in self.shed_reasons.items())
                or "nothing shed"
            ),
            "",
            "during the spike, per step (Triton statistics; queue and compute are means per served request):",
            "",
            "| step | served | refused | executions | requests / execution | queue ms | compute ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {s.model} | {s.requests} | {s.failed} | {s.executions} | {s.requests_per_execution:.1f} | "
            f"{s.queue_us / 1e3:.2f} | {s.compute_us / 1e3:.2f} |"
            for s in self.spike_steps
        ]
        return "\n".join(lines)


def run_overload(
    server: TritonServer,
    spec: ModelSpec,
    rows: int = 8,
    spike_factor: float = 2.0,
    seconds: float = 5.0,
    recovery_window_s: float = 10.0,
    client_cores: frozenset[int] | None = None,
    capacity_rps: float | None = None,
    url: str | None = None,
) -> OverloadReport:
    """Half capacity, a spike and half capacity again, open loop, against ``server``.

    The load generator runs in this process on ``client_cores`` (None: wherever it may run).
    ``capacity_rps`` None: capacity is measured closed-loop on ``server`` first. ``url``: send the
    open-loop phases there (a proxy in front of ``server``) instead of to ``server`` itself; the
    steps' statistics still come from ``server``.
    """
    request = generate(spec, rows, seed=5).to_wire(spec)
    snapshots: dict[int, Snapshot] = {}

    def at_phase(phase: int) -> None:  # the steps' counters at the spike's start and end
        if phase in (1, 2):
            snapshots[phase] = snapshot(server.http_url)

    with pinned(client_cores):
        capacity = capacity_rps or measure_capacity(server.grpc_url, spec, request)
        half, spike = capacity / 2, capacity * spike_factor
        outcomes = open_loop(
            url or server.grpc_url,
            spec,
            request,
            [(half, seconds), (spike, seconds), (half, recovery_window_s)],
            at_phase,
        )
    names = ("half capacity", f"{spike_factor:g}x capacity", "half capacity, after")
    stats = [
        phase_stats(name, rate, [o for o in outcomes if o.phase == phase])
        for phase, (name, rate) in enumerate(zip(names, (half, spike, half), strict=True))
    ]
    spike_end = max(o.sent_s for o in outcomes if o.phase == 1)
    back = recovery_s(outcomes, spike_end, stats[0].served_p99_ms)
    reasons: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.result == SHED:
            reason = outcome.message.split("] ")[-1].split(", ")[-1]
            reasons[reason] = reasons.get(reason, 0) + 1
    failures = [o.message for o in outcomes if o.result == FAILED][:5]
    return OverloadReport(
        capacity,
        stats,
        back,
        failures,
        reasons,
        difference(snapshots[1], snapshots[2], STEPS),
        Cores(server.cpus, client_cores).describe(),
        server.config_name or "",
    )


def overload_command(
    spec: ModelSpec,
    repository: Path,
    rows: int,
    spike_factor: float,
    seconds: float,
    queue: str | None = None,
    json_path: Path | None = None,
) -> int:
    """``recserve lab overload``: a private server on free loopback ports, pinned apart from the generator.

    Prints the tables (and writes :meth:`OverloadReport.summary` as JSON to ``json_path``).

    ``queue`` names a queue policy of the spec (its ``configs/<queue>.pbtxt``); None or ``default``
    serves ``[serving.queue]``.
    """
    queue = None if queue in (None, "default") else queue
    if queue is not None:
        configs.spec_queue(spec, queue)  # refuses an unknown profile before anything starts
    cores = Cores.split()
    with tempfile.TemporaryDirectory(prefix="recserve-overload-") as scratch:
        root = scratch_repository(repository, Path(scratch) / "repository")
        capacity = pinned_capacity(root, spec, rows, cores, Path(scratch) / "capacity.log")
        server = TritonServer(
            root, Ports.free(), log_path=Path(scratch) / "server.log", config_name=queue, cpus=cores.server
        )
        with server:
            report = run_overload(
                server, spec, rows, spike_factor, seconds, client_cores=cores.client, capacity_rps=capacity
            )
    print(report.table())
    if json_path is not None:
        json_path.write_text(json.dumps(report.summary(), indent=2) + "\n")
    return 0 if not report.failures else 1
