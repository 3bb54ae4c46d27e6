"""``recserve bench``: the serving core measured side by side, in one run on one machine.

Five configurations serve the same model on the same inputs:

* the in-process bound: feature -> lookup -> dense called directly (ONNX Runtime, one thread), at
  every batch bucket up to ``max_batch_size``;
* Triton configured naively: no dynamic batching, one instance per step;
* Triton with the spec's tuned ``[serving]`` plan;
* the monolith a user would write first: one Python-backend model running the whole path, with
  1 and 2 instances (:mod:`recserve.perf.peers.monolith`);
* TorchServe with a handler running the PyTorch network and TorchServe's batching.

The Triton configurations are measured with perf_analyzer over gRPC on the grid of client batch
sizes and concurrencies, alternating at each point; the tuned one also with HTTP and with system
shared memory (the overhead probes). Triton's HTTP endpoint and TorchServe are measured with the
same HTTP load generator (:mod:`recserve.perf.harness.loadgen`): those two rows are the fair comparison.
Every Triton point carries the per-step queue/compute breakdown from the server's statistics.
The hop floor (:mod:`recserve.perf.bench.hops`: the served ensemble at batch 1 against echo ensembles of its
shape) is measured in the same run, and so are 4,096-event users through a state
(:mod:`recserve.perf.bench.longseq.bench`, its ``longseq_*`` keys in the summary). Results go to
``<output>/<run>/``: ``points.csv``, ``points.json``, ``hops.json``, ``summary.json``, PNG plots.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recserve.build import configs
from recserve.clients import CTRClient
from recserve.core.names import IDS_WIRE, STEPS
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import spec_path
from recserve.perf.bench import report
from recserve.perf.bench.analyzer import LOOSE_STABILITY, measure_point
from recserve.perf.bench.candidates import measure as measure_candidates
from recserve.perf.bench.hops import run_hops
from recserve.perf.bench.input_data import write_input_data
from recserve.perf.bench.longseq.bench import LongseqGrid, run_longseq
from recserve.perf.bench.report import Point
from recserve.perf.harness.inprocess import measure_inprocess, time_calls
from recserve.perf.harness.loadgen import (
    HttpTarget,
    run_load,
    sample_batches,
    torchserve_target,
    triton_target,
)
from recserve.perf.harness.stats import difference, snapshot
from recserve.perf.peers.monolith import write_monolith_repository
from recserve.server import Ports, Security, TritonServer

LOGGER = logging.getLogger(__name__)

HOPS_FILE = "hops.json"  # the bench-hops summary of the run
CANDIDATES_FILE = "candidates.json"  # the bench-candidates summary of the run
LONGSEQ_FILE = "longseq.json"  # the bench-longseq summary of the run

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Grid:
    """What to measure and for how long."""

    client_batches: tuple[int, ...] = (1, 16, 64)
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    measurement_ms: int = 2000
    inprocess_batches: tuple[int, ...] | None = None  # None: every batch bucket of the spec
    inprocess_s: float = 2.0
    loadgen_batches: tuple[int, ...] = (1, 64)
    loadgen_concurrencies: tuple[int, ...] = (1, 4, 16, 32)
    loadgen_s: float = 5.0
    overhead_points: tuple[tuple[int, int], ...] = ((1, 16), (64, 4))  # (client batch, concurrency)
    sdk_batches: tuple[int, ...] = (1, 64)  # one SDK client, with and without system shared memory
    torchserve: bool = True
    monolith_instances: tuple[int, ...] = (1, 2)
    hops_requests: int = 300  # recserve lab hops in the same run (0: left out)
    hops_rounds: int = 3
    candidates_s: float = 3.0  # recserve lab candidate-lists on the tuned server, per point (0: left out)
    longseq: LongseqGrid | None = None  # recserve bench-longseq in the same run (None: left out)

    @classmethod
    def full(cls) -> Grid:
        """The whole grid (about 10 minutes on 2 cores, and bench-longseq's 7 or so)."""
        return cls(longseq=LongseqGrid())

    @classmethod
    def quick(cls) -> Grid:
        """Enough for every headline ratio in a few minutes."""
        return cls(
            client_batches=(1, 64),
            concurrencies=(1, 16),
            measurement_ms=1000,
            inprocess_batches=(1, 64, 256),
            inprocess_s=1.0,
            loadgen_batches=(64,),
            loadgen_concurrencies=(4, 16),
            loadgen_s=3.0,
            overhead_points=((64, 4),),
            sdk_batches=(64,),
            longseq=LongseqGrid.quick(),
        )


def _stderr(message: str) -> None:
    LOGGER.info("%s", message)


def _perf_point(
    spec: ModelSpec,
    server: TritonServer,
    system: str,
    protocol: str,
    batch: int,
    concurrency: int,
    grid: Grid,
    data: Path,
    shared_memory: str = "none",
) -> Point:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    before = snapshot(server.http_url)
    # perf_analyzer's shared memory refuses optional inputs: the row ensemble of the id form alone
    model = "" if shared_memory == "none" else configs.single_form_ensemble(spec, IDS_WIRE).name
    p = measure_point(
        spec, url, protocol, batch, concurrency, grid.measurement_ms, data=data,
        shared_memory=shared_memory, stability_percentage=LOOSE_STABILITY, model=model,
    )  # fmt: skip
    if p is None:  # kept as a point without figures, which no ratio reads
        return Point(
            system, report.PERF_ANALYZER, protocol, batch, concurrency, math.nan, math.inf, math.inf,
            math.inf, shared_memory,
        )  # fmt: skip
    models = (spec.name,) if system.startswith(report.MONOLITH) else STEPS
    steps = difference(before, snapshot(server.http_url), models)
    return Point(
        system, report.PERF_ANALYZER, protocol, batch, concurrency, p.rows_per_s, p.p50_us / 1e3,
        p.p95_us / 1e3, p.p99_us / 1e3, shared_memory, steps=tuple(s.as_dict() for s in steps),
    )  # fmt: skip


def _load_point(
    system: str, target: HttpTarget, concurrency: int, seconds: float, http_url: str | None = None
) -> Point:
    before = snapshot(http_url) if http_url else None
    result = run_load(target, concurrency, seconds)
    steps = difference(before, snapshot(http_url), STEPS) if http_url and before else []
    return Point(
        system, report.HTTP_LOADGEN, "http", target.rows_per_request, concurrency, result.rows_per_s,
        result.p50_ms, result.p95_ms, result.p99_ms, failures=result.failures,
        steps=tuple(s.as_dict() for s in steps),
    )  # fmt: skip


def _sdk_point(
    spec: ModelSpec, server: TritonServer, batch: int, shared_memory: bool, seconds: float
) -> Point:
    """One blocking SDK client (gRPC) in a closed loop: the cost of the client path itself."""
    batches = sample_batches(spec, batch)
    with CTRClient(server.grpc_url, "grpc", spec=spec, shared_memory=shared_memory) as client:
        for inputs in batches[:2]:
            client.predict_inputs(inputs)  # warm-up
        before = snapshot(server.http_url)
        latencies_ms, elapsed = time_calls(client.predict_inputs, batches, seconds)
        steps = difference(before, snapshot(server.http_url), STEPS)
    p50, p95, p99 = (float(v) for v in np.percentile(latencies_ms, [50, 95, 99]))
    shm = "system" if shared_memory else "none"
    return Point(
        report.TUNED, report.SDK, "grpc", batch, 1, len(latencies_ms) * batch / elapsed, p50, p95, p99, shm,
        steps=tuple(s.as_dict() for s in steps),
    )  # fmt: skip


def run_bench(
    spec: ModelSpec,
    spec_name: str,
    repository: Path,
    output: Path,
    grid: Grid,
    run_name: str | None = None,
    progress: Progress = _stderr,
) -> tuple[Path, list[Point], dict[str, Any]]:
    """Measure every configuration, write the results folder, return it, the points and the summary.

    All servers are started first and stay up (idle ones cost memory, not CPU); the configurations
    are then measured in turn at each load point, so that a slow phase of a shared machine hits
    them alike and the ratios stay meaningful.
    """
    run = output / (run_name or time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    run.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    points: list[Point] = []

    def add(point: Point) -> None:
        points.append(point)
        progress(
            f"[bench] {point.configuration}, batch {point.client_batch} x {point.concurrency}: "
            f"{point.rows_per_s:.0f} rows/s, p99 {point.p99_ms:.1f} ms"
        )

    with tempfile.TemporaryDirectory(prefix="recserve-bench-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        data = write_input_data(spec, work / "input_data.json")
        servers: dict[str, TritonServer] = {}
        for system, plan in (
            (report.NAIVE, configs.ServingPlan.naive()),
            (report.TUNED, configs.ServingPlan.from_spec(spec)),
        ):
            variant = configs.write_variant(spec, repository, work / system, plan=plan)
            ids_only = configs.single_form_ensemble(spec, IDS_WIRE)  # for the shared-memory probes
            (variant / ids_only.name / str(spec.version)).mkdir(parents=True)
            (variant / ids_only.name / "config.pbtxt").write_text(configs.render(ids_only))
            # the shared-memory probes register client regions: open that API on the bench's own servers
            security = Security(client_shared_memory=True)
            servers[system] = stack.enter_context(
                TritonServer(variant, Ports.free(), log_path=work / f"{system}.log", security=security)
            )
        for count in grid.monolith_instances:
            system = f"{report.MONOLITH}-{count}"
            monolith = write_monolith_repository(spec, repository, work / system, count)
            servers[system] = stack.enter_context(
                TritonServer(monolith, Ports.free(), log_path=work / f"{system}.log")
            )
        torchserve = None
        if grid.torchserve:
            from recserve.perf.peers.torchserve import TorchServe

            torchserve = stack.enter_context(
                TorchServe(spec_path(spec_name), repository, work / "torchserve")
            )
        progress(f"[bench] servers ready after {time.monotonic() - started:.0f} s")

        def inprocess() -> None:
            for batch in grid.inprocess_batches or spec.serving.batch_buckets:
                rate = measure_inprocess(spec, repository, batch, seconds=grid.inprocess_s)
                add(
                    Point(
                        report.INPROCESS,
                        report.DIRECT,
                        "none",
                        batch,
                        1,
                        rate.rows_per_s,
                        rate.p50_ms,
                        rate.p95_ms,
                        rate.p99_ms,
                    )
                )

        inprocess()  # measured again after the Triton grid: the bound is the better of the two
        tuned = servers[report.TUNED]
        for batch in grid.client_batches:
            for concurrency in grid.concurrencies:
                for system, server in servers.items():
                    add(_perf_point(spec, server, system, "grpc", batch, concurrency, grid, data))
        inprocess()
        for batch, concurrency in grid.overhead_points:
            if batch not in grid.client_batches or concurrency not in grid.concurrencies:  # the gRPC baseline
                add(_perf_point(spec, tuned, report.TUNED, "grpc", batch, concurrency, grid, data))
            for protocol, shm in (("http", "none"), ("grpc", "system")):
                add(_perf_point(spec, tuned, report.TUNED, protocol, batch, concurrency, grid, data, shm))
        for batch in grid.sdk_batches:
            for shared_memory in (False, True):
                add(_sdk_point(spec, tuned, batch, shared_memory, grid.loadgen_s))

        if grid.hops_requests:
            progress("[bench] the hop floor (batch 1, one request in flight)")
            hops = run_hops(spec, repository, work / "hops", grid.hops_requests, grid.hops_rounds)
            (run / HOPS_FILE).write_text(json.dumps(hops, indent=1))
        if grid.candidates_s and spec.candidates_model:
            progress("[bench] one user's candidate list against the same rows (candidate_list_gain)")
            lists = measure_candidates(
                spec, tuned.grpc_url, seconds=grid.candidates_s, rounds=grid.hops_rounds
            )
            (run / CANDIDATES_FILE).write_text(json.dumps(lists, indent=1))
        if grid.longseq is not None and spec.sequences:
            progress("[bench] 4,096-event users through a state against 256-event rows (bench-longseq)")
            _, longseq = run_longseq(spec, repository, output, grid.longseq, progress)
            (run / LONGSEQ_FILE).write_text(json.dumps(longseq, indent=1))
        for batch in grid.loadgen_batches:
            batches = sample_batches(spec, batch)
            targets: dict[str, tuple[HttpTarget, str | None]] = {
                report.TUNED: (triton_target(tuned.http_url, spec, batches), tuned.http_url)
            }
            if torchserve is not None:
                targets[report.TORCHSERVE] = (
                    torchserve_target(torchserve.inference_url, "ctr", spec, batches),
                    None,
                )
            for concurrency in grid.loadgen_concurrencies:
                for system, (target, stats_url) in targets.items():
                    add(_load_point(system, target, concurrency, grid.loadgen_s, stats_url))

    run_info = {
        "name": run.name,
        "seconds": round(time.monotonic() - started, 1),
        "grid": asdict(grid),
        "tuned_plan": asdict(configs.ServingPlan.from_spec(spec)),
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "load_average_at_end": os.getloadavg(),
        },
    }
    report.write_points(points, run)
    (run / "run.json").write_text(json.dumps(run_info, indent=1))
    return run, points, write_summary(run, points)


def write_summary(run: Path, points: Sequence[Point]) -> dict[str, Any]:
    """``summary.json`` and the plots of a results folder, from its points (and ``run.json``)."""
    hops, lists = (
        json.loads((run / name).read_text()) if (run / name).exists() else None
        for name in (HOPS_FILE, CANDIDATES_FILE)
    )
    summary = report.summarize(points, hops=hops, candidates=lists)
    summary["overheads"] = report.overheads(points)
    if (run / LONGSEQ_FILE).exists():  # the longseq_* ratios, the exact error and the hit rate
        longseq = json.loads((run / LONGSEQ_FILE).read_text())
        summary.update({key: value for key, value in longseq.items() if key.startswith("longseq_")})
    if (run / "run.json").exists():
        summary["run"] = json.loads((run / "run.json").read_text())
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    report.plot(points, run)
    return summary


def format_result(points: Sequence[Point], summary: dict[str, Any]) -> str:
    """The short table and the ratios, as printed at the end of a run."""
    return f"{report.table(points)}\n\n{report.describe_summary(summary)}"
