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

import copy
import logging
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recserve.backends.store.tiered import TieredStore
from recserve.build import configs
from recserve.build.repository import reference_pipeline, upload_remote_tables, version_dir, write_tables
from recserve.build.synthetic import generate
from recserve.perf.harness.redis_cluster import RedisCluster
from recserve.perf.harness.traffic import infer_request
from recserve.server import LOOPBACK, Ports, TritonServer
from recserve.spec import ModelSpec, parse_spec
from recserve.wire import EMBEDDING_LOOKUP, PROBABILITY

LOGGER = logging.getLogger(__name__)

P99_GOAL_MS = 1.0
REFERENCE_ATOL = 1e-5  # served (ONNX Runtime, bucketed) against the in-process PyTorch reference
UP, DOWN, BACK = "redis up", "all redis down", "redis back"
GOING_DOWN, COMING_BACK = "killed, until the breaker opened", "restarted, until L3 served again"
L3_REASONS = ("timeout", "error", "breaker_open", "busy")
_SAMPLE = re.compile(r"^(\w+)(\{[^}]*\})?\s+(\S+)$")


def l3_repository(
    spec: ModelSpec,
    repository: Path,
    target: Path,
    nodes: list[str],
    deadline_ms: float | None = None,
    password_env: str = "",
) -> ModelSpec:
    """A copy of a built repository whose target-item table lives only in the Redis Cluster at ``nodes``.

    Args:
        spec: the spec the repository was built from.
        repository: the built repository (left unchanged).
        target: where the copy goes (without the update log).
        nodes: ``host:port`` seeds of the cluster.
        deadline_ms: the L3 deadline of the copy; None keeps the spec's ``redis_deadline_ms``.
        password_env: the environment variable holding the cluster's password (empty: none).

    Returns:
        The copy's spec (its configs carry it); load the cluster with :func:`upload_remote_tables`.
    """
    doc = copy.deepcopy(spec.source)
    store = {
        **doc.get("store", {}),
        "redis_nodes": list(nodes),
        "remote_tables": [spec.attention("redis-outage")[0].table],
    }
    if deadline_ms is not None:
        store["redis_deadline_ms"] = float(deadline_ms)
    if password_env:
        store["redis_password_env"] = password_env
    doc["store"] = store
    variant = parse_spec(doc)
    shutil.copytree(repository, target, ignore=shutil.ignore_patterns("updates", "__pycache__"))
    source = TieredStore.load(version_dir(repository, EMBEDDING_LOOKUP, spec), spec)
    tables = {name: source.table_arrays(name) for name in source.table_names}
    root = version_dir(target, EMBEDDING_LOOKUP, spec)
    shutil.rmtree(root / "shards")
    write_tables(variant, tables, root)
    configs.write_configs(variant, target)
    return variant


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

    kind: str  # UP, GOING_DOWN, DOWN, COMING_BACK, BACK, or a warm-up
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
        self.message = infer_request(spec.name, wire)
        self.message.outputs.add(name=PROBABILITY)
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


def _serving(metrics: dict[str, float], all_rows_found: bool) -> bool:
    """L3 serves: the store is healthy, the breaker closed, and the last response found every item row."""
    healthy = (
        metrics.get("recserve_store_healthy") == 1.0 and metrics.get("recserve_store_l3_breaker_open") == 0.0
    )
    return healthy and all_rows_found


def _breaker_open(metrics: dict[str, float], all_rows_found: bool) -> bool:
    return metrics.get("recserve_store_l3_breaker_open") == 1.0


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
                probe.until("warm-up", _serving, settle_timeout_s)
                probe.run("warm-up", warmup)
                for round_ in range(1, rounds + 1):
                    phases.append(probe.run(UP, requests, round_))
                    cluster.kill_all()
                    LOGGER.info("round %d: killed every Redis node", round_)
                    phases.append(probe.until(GOING_DOWN, _breaker_open, settle_timeout_s, round_))
                    phases.append(probe.run(DOWN, requests, round_))
                    cluster.restart()
                    upload_remote_tables(variant, tables, options)
                    LOGGER.info("round %d: Redis Cluster back and loaded", round_)
                    phases.append(probe.until(COMING_BACK, _serving, settle_timeout_s, round_))
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
