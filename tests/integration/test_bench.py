"""``recserve bench`` machinery on a tiny grid, and a short locust run through the client SDK."""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from recserve.clients import CTRClient
from recserve.core.names import STEPS
from recserve.perf.bench import report
from recserve.perf.bench.bench import Grid, run_bench
from recserve.perf.harness.loadgen import sample_batches
from recserve.perf.lab.queue_stall import SERVED, run_queue_stall
from recserve.server import Ports, Security, TritonServer

ROOT = Path(__file__).resolve().parents[2]

TINY = Grid(
    client_batches=(1,),
    concurrencies=(1, 16),
    measurement_ms=500,
    inprocess_batches=(1, 8),
    inprocess_s=0.3,
    loadgen_batches=(8,),
    loadgen_concurrencies=(2,),
    loadgen_s=1.0,
    overhead_points=((8, 2),),
    sdk_batches=(8,),
    torchserve=False,
    monolith_instances=(1,),
    hops_requests=20,
    hops_rounds=1,
    candidates_s=0.5,
)


def test_bench_writes_points_summary_and_plots(spec, repository, tmp_path):
    started = time.monotonic()
    run, points, summary = run_bench(spec, "ctr", repository, tmp_path, TINY, run_name="tiny")
    assert time.monotonic() - started < 240  # tiny grid: about a minute on an idle 2-core machine
    assert {p.name for p in run.iterdir()} >= {
        "points.csv",
        "points.json",
        "summary.json",
        "hops.json",
        "candidates.json",
        "latency_vs_throughput.png",
    }
    written = json.loads((run / "summary.json").read_text())
    for key in (
        "ensemble_vs_inprocess",
        "dynamic_batching_gain",
        "vs_torchserve_throughput",
        "vs_torchserve_p99",
        "vs_monolith_throughput",
        "hop_floor_ratio",
        "candidate_list_gain",
    ):
        assert key in written and key in written["targets"]
    # The ratios are read at p99 <= 50 ms, which a loaded machine may miss at every point: the
    # machinery is checked with a bound every point meets, the written file against the same code.
    # A point that finds no stable window is kept without figures; on a busy machine the tuned
    # ensemble's 1 x 16 point may (the queue-policy stall, docs/performance.md), and then the gain
    # read from it is not measured.
    unstable = [p for p in points if not math.isfinite(p.rows_per_s)]
    assert len(unstable) <= 1, unstable
    unbounded = report.summarize(points, p99_bound_ms=float("inf"))
    assert unbounded["ensemble_vs_inprocess"] > 0
    gain_points = [p for p in points if p.client_batch == 1 and p.concurrency == 16 and p in unstable]
    assert (
        unbounded["dynamic_batching_gain"] is None if gain_points else unbounded["dynamic_batching_gain"] > 0
    )
    assert unbounded["vs_monolith_throughput"] > 0
    # the p99 side is read from the tuned point at the monolith's best shape, which may be the unstable one
    monolith = report.best_under(
        [p for p in points if p.system.startswith(report.MONOLITH) and p.generator == report.PERF_ANALYZER],
        float("inf"),
    )
    assert monolith is not None
    partner = report.select(
        unstable, system=report.TUNED, generator=report.PERF_ANALYZER, protocol="grpc", shared_memory="none",
        client_batch=monolith.client_batch, concurrency=monolith.concurrency,
    )  # fmt: skip
    assert unbounded["vs_monolith_p99"] is None if partner else unbounded["vs_monolith_p99"] > 0
    hops = json.loads((run / "hops.json").read_text())
    assert (
        written["hop_floor_ratio"] == hops["hop_floor_ratio"] and hops["systems"]["echo_2_hops"]["p50_ms"] > 0
    )
    lists = json.loads((run / "candidates.json").read_text())
    assert written["candidate_list_gain"] == lists["candidate_list_gain"]
    # both forms measured at each concurrency and served one request at a time; more in flight, the
    # tuned configs' queue policy may refuse some (counted as failures, not timed): not checked here
    for form in ("candidate_list", "rows"):
        assert set(lists["medians"][form]) == {"1", "2", "4"}, form
        assert lists["medians"][form]["1"]["rows_per_s"] > 0, form
    assert written["ensemble_vs_inprocess"] == report.summarize(points)["ensemble_vs_inprocess"]
    assert written["vs_torchserve_throughput"] is None  # TorchServe was left out of this run
    for probe in ("http_over_grpc", "system_shm_over_grpc", "sdk_system_shm_over_wire"):
        assert written["overheads"][probe], probe
    configurations = {p.configuration for p in points}
    assert {"inprocess", "triton-naive grpc perf_analyzer", "triton-tuned grpc perf_analyzer",
            "triton-tuned http http-loadgen", "triton-tuned http perf_analyzer",
            "triton-tuned grpc perf_analyzer shm=system", "monolith-1 grpc perf_analyzer",
            } <= configurations  # fmt: skip
    for p in points:
        assert p.failures == 0 and (p in unstable or (p.rows_per_s > 0 and p.p50_ms <= p.p99_ms)), p
        if p in unstable:  # perf_analyzer found no stable window: nothing was measured, no breakdown
            continue
        if p.system in (report.NAIVE, report.TUNED):
            assert {s["model"] for s in p.steps} == set(STEPS), p
        if p.system.startswith(report.MONOLITH):
            assert {s["model"] for s in p.steps} == {spec.name}, p
    naive = [s for p in points if p.system == report.NAIVE for s in p.steps]
    assert all(s["requests_per_execution"] == 1.0 for s in naive)  # no dynamic batching there
    rows = (run / "points.csv").read_text().splitlines()
    assert len(rows) == len(points) + 1


@pytest.fixture(scope="module")
def shm_server(repository, tmp_path_factory):
    """A server that lets clients register shared memory (locked by default)."""
    log = tmp_path_factory.mktemp("shm") / "server.log"
    with TritonServer(
        repository, Ports.free(), log_path=log, security=Security(client_shared_memory=True)
    ) as running:
        yield running


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sdk_shared_memory_gives_the_same_probabilities(shm_server, spec, protocol):
    server = shm_server
    batches = sample_batches(spec, 5, count=3) + sample_batches(spec, spec.model.max_batch_size, count=1)
    url = server.grpc_url if protocol == "grpc" else server.http_url
    with (
        CTRClient(url, protocol, spec=spec) as wire,
        CTRClient(url, protocol, spec=spec, shared_memory=True) as shm,
    ):
        for inputs in batches:
            np.testing.assert_array_equal(shm.predict_inputs(inputs), wire.predict_inputs(inputs))
        scored, plain = (
            shm.score_inputs(batches[0]),
            wire.score_inputs(batches[0]),
        )  # probabilities in the region, versions in the response
        np.testing.assert_array_equal(scored.probabilities, plain.probabilities)
        np.testing.assert_array_equal(scored.embedding_version, plain.embedding_version)
        np.testing.assert_array_equal(scored.dense_version, plain.dense_version)
        region = shm._shm.region.name
    assert not Path("/dev/shm", region).exists()  # closed: unregistered and removed


def locust(server, *extra):
    locustfile = ROOT / "perf" / "bench" / "locustfile.py"
    command = [
        str(Path(sys.executable).parent / "locust"), "-f", str(locustfile), "--headless",
        "-u", "3", "-r", "3", "--run-time", "4s", "--only-summary", "--ctr-url", server.http_url, *extra,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_locust_run_reports_p99_and_failures_and_fails_over_threshold(server):
    ok = locust(server, "--p99-ms", "5000")
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "failure ratio 0.0000" in ok.stdout
    strict = locust(server, "--p99-ms", "0.001")
    assert strict.returncode != 0
    assert "p99" in strict.stdout


@pytest.mark.parametrize("command", [["bench", "--help"], ["lab", "tune", "--help"]])
def test_bench_and_tune_commands_exist(command):
    done = subprocess.run(
        [str(Path(sys.executable).parent / "recserve"), *command], capture_output=True, text=True
    )
    assert done.returncode == 0 and "--repository" in done.stdout


def test_bench_queues_serves_each_configuration_in_turns(spec, repository, tmp_path):
    summary = run_queue_stall(spec, repository, ("throughput_first",), 4, 1.0, 2, tmp_path)
    assert [(r["round"], r["configuration"]) for r in summary["rounds"]] == [
        (0, SERVED), (0, "throughput_first"), (1, "throughput_first"), (1, SERVED),
    ]  # fmt: skip
    for r in summary["rounds"]:
        assert r["failures"] == 0 and r["requests"] > 0 and r["p50_ms"] <= r["max_ms"], r
