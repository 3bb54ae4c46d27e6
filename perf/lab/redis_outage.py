"""``recserve lab redis-outage``: ``ctr`` latency with its L3 Redis Cluster up, all of it down, and back.

The command starts a real Redis Cluster (3 masters + 3 replicas on loopback) and a tritonserver over
a scratch copy of the repository whose ``item`` table lives only in that cluster (``[store]
remote_tables``), then sends ``ctr`` requests of a fixed batch, one at a time (closed loop), a
bounded number per phase:

1. **redis up**: every item key is served by L3;
2. **all redis down**: every node, masters and replicas, is killed; the phase is measured once the
   circuit breaker is open (the requests in between are reported on their own row); then the nodes
   are started again and the rows loaded again, and the next phase waits until the breaker has
   closed and a response has every item row found again (also its own row);
3. phases 1 and 2 alternate ``rounds`` times, so that a busy spell of a shared machine hits both
   alike; **redis back** is a last up phase after the last restart.

It reports p50/p99/max latency and failed requests per phase, responses with every item row found
(equal to the in-process reference over the local tables), the L3 counters (calls, errors by reason;
the store publishes them at most once a second, so a phase's counts are good to about a second),
readiness and ``recserve_store_healthy``, and the p99 difference down minus up (the goal: at most
1 ms; an open breaker answers item keys with their default rows without calling Redis).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recserve.build.repository import reference_pipeline, upload_remote_tables, version_dir
from recserve.build.synthetic import generate
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.l3_repository import l3_repository
from recserve.perf.harness.redis_cluster import RedisCluster
from recserve.perf.lab.outage_probe import L3_REASONS, OutageProbe, PhaseResult, breaker_opened, l3_serving
from recserve.server import Ports, TritonServer

LOGGER = logging.getLogger(__name__)

P99_GOAL_MS = 1.0
UP, DOWN, BACK = "redis up", "all redis down", "redis back"
GOING_DOWN, COMING_BACK = "killed, until the breaker opened", "restarted, until L3 served again"


def _gauge(value: float) -> str:
    return "" if np.isnan(value) else f"{value:.0f}"


@dataclass
class OutageReport:
    """The phases of one run and the verdict."""

    batch_size: int
    deadline_ms: float
    phases: list[PhaseResult]
    load_average: tuple[float, float, float]

    def of(self, kind: str) -> list[PhaseResult]:
        """The phases of one kind, in order."""
        return [p for p in self.phases if p.kind == kind]

    def pooled(self, kind: str) -> PhaseResult:
        """The requests of every phase of one kind together."""
        return PhaseResult.pooled(kind, self.of(kind))

    @property
    def p99_down_minus_up_ms(self) -> float:
        """p99 with all Redis down minus p99 with Redis up (each over all rounds)."""
        return self.pooled(DOWN).percentile(99) - self.pooled(UP).percentile(99)

    @property
    def failed(self) -> int:
        """Failed requests over the whole run, transitions included."""
        return sum(len(p.failures) for p in self.phases)

    @property
    def problems(self) -> list[str]:
        """What breaks the promise: a failed request, readiness, or the store's health gauges.

        Latency is judged by :attr:`p99_down_minus_up_ms` separately (a timing, not a pass/fail).
        """
        out = [
            f"{p.name}: {len(p.failures)} failed, first: {p.failures[0]}" for p in self.phases if p.failures
        ]
        out += [
            f"{p.name}: the server or a model was not ready at the end of the phase"
            for p in self.phases
            if not p.ready
        ]
        out += [
            f"{p.name}: recserve_store_healthy {p.store_healthy}, breaker open {p.breaker_open} "
            "(expected 0 and 1)"
            for p in self.of(DOWN)
            if (p.store_healthy, p.breaker_open) != (0.0, 1.0)
        ]
        return out

    @property
    def notes(self) -> list[str]:
        """Phases with Redis running where L3 did not serve every request.

        That is, a deadline too tight for the machine.
        """
        return [
            f"{p.name}: {p.all_rows_found} of {len(p.latencies_ms)} responses found every item row; "
            f"{sum(p.l3.get(r, 0) for r in ('timeout', 'error', 'busy')):.0f} L3 calls failed "
            "(raise --deadline-ms?)"
            for p in (*self.of(UP), *self.of(BACK))
            if p.all_rows_found != len(p.latencies_ms)
        ]

    def table(self) -> str:
        """Markdown table and verdict."""
        lines = [
            f"ctr, batch {self.batch_size}, one request at a time; L3 deadline {self.deadline_ms:g} ms; "
            f"load average {', '.join(f'{x:.1f}' for x in self.load_average)}",
            "",
            "| phase | requests | failed | p50 ms | p99 ms | max ms | all item rows found | L3 calls "
            "| L3 errors (timeout/error/breaker_open/busy) | ready | store healthy | breaker open |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |",
        ]
        pooled = [self.pooled(kind) for kind in (UP, DOWN)] if len(self.of(UP)) > 1 else []
        for p in (*self.phases, *pooled):
            errors = "/".join(f"{p.l3.get(reason, 0):.0f}" for reason in L3_REASONS)
            lines.append(
                f"| {p.name} | {p.requests} | {len(p.failures)} | {p.percentile(50):.2f} | "
                f"{p.percentile(99):.2f} | {max(p.latencies_ms, default=float('nan')):.2f} | "
                f"{p.all_rows_found} | {p.l3.get('calls', 0):.0f} | {errors} | "
                f"{'yes' if p.ready else 'NO'} | {_gauge(p.store_healthy)} | {_gauge(p.breaker_open)} |"
            )
        delta = self.p99_down_minus_up_ms
        lines += [
            "",
            f"p99 all Redis down - p99 Redis up (all rounds) = {delta:+.2f} ms "
            f"(goal <= {P99_GOAL_MS:g} ms: {'met' if delta <= P99_GOAL_MS else 'NOT met'})",
            "p99 Redis back - p99 Redis up = "
            f"{self.pooled(BACK).percentile(99) - self.pooled(UP).percentile(99):+.2f} ms",
            f"failed requests over the run: {self.failed}",
            *(f"note: {note}" for note in self.notes),
            "PASS" if not self.problems else "FAIL: " + "; ".join(self.problems),
        ]
        return "\n".join(lines)


def run_outage(
    spec: ModelSpec,
    repository: Path,
    scratch: Path,
    requests: int = 1000,
    rounds: int = 3,
    batch_size: int = 16,
    deadline_ms: float | None = None,
    warmup: int = 200,
    settle_timeout_s: float = 60.0,
) -> OutageReport:
    """Start the cluster and the server in ``scratch`` and run the phases (see the module docstring).

    Up and down alternate ``rounds`` times (``requests`` each), so that a busy spell of a shared
    machine hits both alike; the back phase follows the last restart.
    """
    wire = generate(spec, batch_size, seed=17).to_wire(spec)
    reference = reference_pipeline(spec, repository, runtime="torch").predict(wire)  # every item row found
    with RedisCluster(scratch / "redis") as cluster:
        variant = l3_repository(
            spec, repository, scratch / "repository", cluster.nodes, deadline_ms, cluster.password_env
        )
        options = variant.store
        tables = version_dir(scratch / "repository", EMBEDDING_LOOKUP, variant)
        upload_remote_tables(variant, tables, options)
        with TritonServer(scratch / "repository", Ports.free(), log_path=scratch / "server.log") as server:
            probe = OutageProbe(server, spec, wire, reference)
            phases = []
            try:
                probe.until("warm-up", l3_serving, settle_timeout_s)
                probe.run("warm-up", warmup)
                for round_ in range(1, rounds + 1):
                    phases.append(probe.run(UP, requests, round_))
                    cluster.kill_all()
                    LOGGER.info("round %d: killed every Redis node", round_)
                    phases.append(probe.until(GOING_DOWN, breaker_opened, settle_timeout_s, round_))
                    phases.append(probe.run(DOWN, requests, round_))
                    cluster.restart()
                    upload_remote_tables(variant, tables, options)
                    LOGGER.info("round %d: Redis Cluster back and loaded", round_)
                    phases.append(probe.until(COMING_BACK, l3_serving, settle_timeout_s, round_))
                phases.append(probe.run(BACK, requests))
            finally:
                probe.close()
    load = tuple(float(x) for x in Path("/proc/loadavg").read_text().split()[:3])
    return OutageReport(batch_size, options.redis_deadline_ms, phases, load)  # type: ignore[arg-type]


def outage_command(
    spec: ModelSpec, repository: Path, requests: int, rounds: int, batch_size: int, deadline_ms: float | None
) -> int:
    """``recserve lab redis-outage``: prints the table.

    Exit status 1 on a failed request or a readiness problem.
    """
    with tempfile.TemporaryDirectory(prefix="recserve-redis-outage-") as scratch:
        report = run_outage(spec, repository, Path(scratch), requests, rounds, batch_size, deadline_ms)
    print(report.table())
    return 0 if not report.problems else 1
