"""The access layer live: a real Envoy in front of two real tritonservers (stable, canary).

Both variants serve the tiny spec; the canary's repository has a second ``dense`` version folder,
so its responses say ``dense_version`` 2 where stable's say 1. Admission: requests over the in-flight
cap are refused at once with UNAVAILABLE (HTTP 503). Routing: a user stays on one variant; weights
change under traffic with no failed request; mirrored copies reach the canary, their responses
never reach a client, and a stalled shadow neither delays nor fails live requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2_grpc

from recserve.access import AccessLayer, ProxyPorts, behind_proxy, observe
from recserve.access.canary import controller as canary
from recserve.backends.request_log.read import read_kind
from recserve.backends.request_log.records import FEATURES, SCORES, SHADOW
from recserve.build.repository import build_repository
from recserve.build.synthetic import generate
from recserve.clients import AsyncCTRClient, CTRClient, RecserveClientError, ServerUnavailableError
from recserve.core.sections.logging import LOG_DIR_ENV
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from recserve.perf.harness.traffic import add_version, infer_request, scratch_repository

pytestmark = pytest.mark.integration

STABLE, CANDIDATE = 1, 2  # the dense version each variant serves


@pytest.fixture(scope="module")
def tiny() -> ModelSpec:
    return load_spec("tiny")


@pytest.fixture(scope="module")
def served(tiny: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two variants' repositories as their servers serve them (Triton's queues unbounded)."""
    root = tmp_path_factory.mktemp("access")
    stable = root / "stable"
    build_repository(tiny, stable)
    canary = scratch_repository(stable, root / "canary")
    assert add_version(canary, "dense") == CANDIDATE
    repositories, config_name = behind_proxy(
        {"stable": stable, "canary": canary},
        tiny.access.queue_policy,
        tiny.serving.queue_policies,
        root,
    )
    assert config_name is None  # the default profile: no queue policy behind the proxy
    return repositories


def _ports() -> ProxyPorts:
    return ProxyPorts.free()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the layer's servers log what they serve (``recserve access --log-dir``)."""
    return tmp_path_factory.mktemp("request_log")


@pytest.fixture(scope="module")
def layer(tiny: ModelSpec, served: dict[str, Path], log_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    access = dataclasses.replace(
        tiny.access,
        weights={"stable": 50, "canary": 50},
        max_requests=2,
        shadow_max_requests=2,
        request_timeout_s=10.0,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(LOG_DIR_ENV, str(log_dir))  # what `access --log-dir` sets; the servers inherit it
        with AccessLayer(access, served, tmp_path_factory.mktemp("run"), _ports()) as running:
            yield running


def _request(spec: ModelSpec, rows: int = 4, seed: int = 1) -> dict[str, np.ndarray]:
    return generate(spec, rows, seed=seed).to_wire(spec)


def _dense_version(client: CTRClient, request: dict[str, np.ndarray]) -> int:
    return client.score_inputs(request).dense_version


def test_requests_over_the_cap_are_refused_at_once_with_unavailable(layer, tiny):
    layer.admin.set_weights({"stable": 100, "canary": 0})
    message = infer_request(tiny.name, _request(tiny, rows=64))
    refused_before = layer.admin.cluster_stat("stable", "grpc", "upstream_rq_active_overflow")
    with grpc.insecure_channel(layer.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(message, timeout=30)  # connected and warm
        done: dict[int, float] = {}
        lock = threading.Lock()
        calls = []
        for i in range(80):  # all at once: far over 2 in flight
            sent = time.monotonic()
            future = stub.ModelInfer.future(message, timeout=30)

            def finished(f, i=i, sent=sent):
                with lock:
                    done[i] = (time.monotonic() - sent) * 1e3

            future.add_done_callback(finished)
            calls.append(future)
        errors = [f.exception() for f in calls]
        deadline = time.monotonic() + 10
        while len(done) < len(calls) and time.monotonic() < deadline:
            time.sleep(0.01)
    refused = [i for i, e in enumerate(errors) if e is not None]
    served = [i for i, e in enumerate(errors) if e is None]
    codes = Counter(errors[i].code() for i in refused)
    assert refused and served, f"refused {len(refused)}, served {len(served)}"
    assert set(codes) == {grpc.StatusCode.UNAVAILABLE}, codes
    overloaded = [dict(errors[i].trailing_metadata() or ()).get("x-envoy-overloaded") for i in refused]
    assert overloaded == ["true"] * len(refused)  # refused by the proxy's cap, not by Triton
    assert layer.admin.cluster_stat("stable", "grpc", "upstream_rq_active_overflow") - refused_before == len(
        refused
    )
    refused_ms = [done[i] for i in refused]
    served_ms = [done[i] for i in served]
    # not queued: a refusal does not wait for the requests ahead of it. Queued behind 2 in flight, the
    # median of 80 requests would wait about 20 service times; on a shared 2-core machine a refusal
    # and a served request may take about as long (the client and the proxy share the cores).
    assert np.median(refused_ms) < 4 * np.median(served_ms), (np.median(refused_ms), np.median(served_ms))
    assert max(refused_ms) < 1000, max(refused_ms)

    results: list[str] = []

    def http_call() -> None:
        try:
            with CTRClient(layer.http_url, protocol="http", spec=tiny, timeout_s=30) as client:
                client.predict_inputs(_request(tiny, rows=64))
            results.append("served")
        except ServerUnavailableError:
            results.append("refused")
        except RecserveClientError as exc:
            results.append(f"failed: {exc}")

    threads = [threading.Thread(target=http_call) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert set(results) <= {"served", "refused"}, results
    assert "served" in results
    assert layer.admin.cluster_stat("stable", "http", "upstream_rq_503") == results.count("refused")
    with CTRClient(layer.grpc_url, spec=tiny) as client:  # right after the burst, served again
        assert _dense_version(client, _request(tiny)) == STABLE


def test_a_user_stays_on_one_variant_across_calls_and_protocols(layer, tiny):
    layer.admin.set_weights({"stable": 50, "canary": 50})
    request = _request(tiny)
    seen: dict[int, set[int]] = {}
    for user in range(40):
        with (
            CTRClient(layer.grpc_url, spec=tiny, user_id=f"user-{user}") as over_grpc,
            CTRClient(layer.http_url, protocol="http", spec=tiny, user_id=f"user-{user}") as over_http,
        ):
            seen[user] = {_dense_version(client, request) for client in (over_grpc, over_http, over_grpc)}
    moved = {user: versions for user, versions in seen.items() if len(versions) > 1}
    assert not moved, f"users served by both variants: {moved}"
    on_candidate = sum(versions == {CANDIDATE} for versions in seen.values())
    assert 0 < on_candidate < len(seen), f"{on_candidate} of {len(seen)} users on the canary"

    async def over_asyncio() -> dict[int, int]:  # the asyncio client sends the same header
        found = {}
        for user in range(10):
            async with AsyncCTRClient(layer.grpc_url, spec=tiny, user_id=f"user-{user}") as client:
                found[user] = (await client.score_inputs(request)).dense_version
        return found

    for user, version in asyncio.run(over_asyncio()).items():
        assert seen[user] == {version}, (user, seen[user], version)


def test_weights_change_under_traffic_with_no_failed_request(layer, tiny):
    layer.admin.set_weights({"stable": 100, "canary": 0})
    stop = threading.Event()
    lock = threading.Lock()
    seen: list[tuple[float, int]] = []  # (when the request started, the dense version that served it)
    failures: list[str] = []

    def traffic(protocol: str, url: str, seed: int) -> None:
        request = _request(tiny, rows=8, seed=seed)
        with CTRClient(url, protocol=protocol, spec=tiny, timeout_s=30) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    version = _dense_version(client, request)
                    with lock:
                        seen.append((started, version))
                except RecserveClientError as exc:
                    with lock:
                        failures.append(f"{protocol}: {exc}")
                stop.wait(0.003)

    threads = [
        threading.Thread(target=traffic, args=("grpc", layer.grpc_url, 1)),
        threading.Thread(target=traffic, args=("http", layer.http_url, 2)),
    ]
    for thread in threads:
        thread.start()
    changes = []
    try:
        for stable_share in (100, 50, 0, 100):
            weights = {"stable": stable_share, "canary": 100 - stable_share}
            asked = time.monotonic()  # the old phase ends as the change is asked for
            layer.admin.set_weights(weights)
            changes.append((asked, time.monotonic()))  # the new one starts once Envoy's admin has answered
            time.sleep(3.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not failures, failures[:5]
    # Envoy's workers pick up a new runtime snapshot asynchronously: milliseconds when idle, but on
    # the 2-core CI machine under the whole suite a request on the old weights got through 0.3 s
    # after a change once, and over 0.8 s after it in three runs of the suite; so a phase counts
    # from 2 s after Envoy's admin answered the change
    settle = 2.0

    def window(phase: int) -> list[tuple[float, int]]:
        start = changes[phase][1] + settle
        end = changes[phase + 1][0] if phase + 1 < len(changes) else float("inf")
        return [(t, v) for t, v in seen if start <= t < end]

    def only(phase: int, version: int) -> None:
        # twice in the suite, one request in about 300 still went to the other variant 2 to 3.5 s
        # after a change (cause unknown); one is let pass, and the failure says when each started
        asked, answered = changes[phase]
        strays = [(t, v) for t, v in window(phase) if v != version]
        when = [f"{t - asked:.2f} s after asking, {t - answered:.2f} s after the answer" for t, _ in strays]
        assert len(window(phase)) > len(strays) and len(strays) <= 1, (
            Counter(v for _, v in window(phase)),
            when[:5],
        )

    only(0, STABLE)
    assert set(Counter(v for _, v in window(1))) == {STABLE, CANDIDATE}
    only(2, CANDIDATE)
    only(3, STABLE)
    runtime = layer.admin.runtime()
    assert runtime["access.weights.grpc.canary_grpc"] == "0"


def test_shadow_copies_reach_the_candidate_and_a_stalled_shadow_never_holds_live_traffic(
    layer, tiny, log_dir
):
    admin = layer.admin
    admin.set_weights({"stable": 100, "canary": 0})
    admin.set_shadow_fraction(1.0)

    def shadow(stat: str) -> int:
        return admin.cluster_stat("canary", "grpc", stat, shadow=True)

    def live_candidate() -> int:
        return admin.cluster_stat("canary", "grpc", "upstream_rq_total")

    request = _request(tiny)
    stats = ("upstream_rq_total", "upstream_rq_active_overflow", "upstream_rq_completed")
    before = {stat: shadow(stat) for stat in stats}
    live_before = live_candidate()
    try:
        with CTRClient(layer.grpc_url, spec=tiny) as client:
            answers = [client.score_inputs(request) for _ in range(30)]
        assert {a.dense_version for a in answers} == {STABLE}, "a client saw a mirrored response"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # completed counts answered and dropped copies alike
            if shadow("upstream_rq_completed") - before["upstream_rq_completed"] >= 30:
                break
            time.sleep(0.1)
        sent, dropped = (shadow(stat) - before[stat] for stat in stats[:2])
        assert sent + dropped == 30 and sent >= 10, (sent, dropped)
        assert live_candidate() == live_before  # mirrored copies are not live canary traffic

        canary = layer.servers["canary"][0].process
        assert canary is not None
        os.kill(canary.pid, signal.SIGSTOP)  # the shadow stalls: it accepts and never answers
        try:
            dropped_before = shadow("upstream_rq_active_overflow")
            latencies = []
            with CTRClient(layer.grpc_url, spec=tiny, timeout_s=30) as client:
                for _ in range(30):
                    started = time.monotonic()
                    assert _dense_version(client, request) == STABLE
                    latencies.append(time.monotonic() - started)
            # live requests neither waited for the stalled copies nor failed; over the shadow's cap
            # the copies were dropped
            assert max(latencies) < 5.0, max(latencies)
            assert shadow("upstream_rq_active_overflow") - dropped_before >= 30 - 2 * 2
        finally:
            os.kill(canary.pid, signal.SIGCONT)
    finally:
        admin.set_shadow_fraction(0.0)
    with CTRClient(layer.grpc_url, spec=tiny, user_id="after") as client:
        assert _dense_version(client, request) == STABLE
    # the copies were logged as shadow traffic of the canary (a stopping server writes its log)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(LOG_DIR_ENV, str(log_dir))
        layer.restart("canary", 0)
    ids = {a.request_id for a in answers}
    for kind in (FEATURES, SCORES):
        logged = read_kind(log_dir, kind).to_pydict()
        copies = {
            (variant, traffic)
            for request_id, variant, traffic in zip(
                logged["request_id"], logged["variant"], logged["traffic"], strict=True
            )
            if request_id in ids and variant != "stable"
        }
        assert copies == {("canary", SHADOW)}, (kind, copies)
        assert (
            len(
                {r for r, v in zip(logged["request_id"], logged["variant"], strict=True) if v == "canary"}
                & ids
            )
            >= 10
        )


def test_every_dashboard_query_reads_a_series_the_running_stack_exports(layer, tiny, tmp_path):
    with CTRClient(layer.grpc_url, spec=tiny, timeout_s=30) as client:
        for seed in range(4):  # a few requests: the latency histograms get their first samples
            client.predict_inputs(_request(tiny, seed=seed))
    triton, envoy = layer.scrape_targets()
    assert len(triton) == len(layer.all_servers()) == 2 and envoy == [f"127.0.0.1:{layer.ports.admin}"]
    exported = observe.exported_names(layer.admin.prometheus())
    stack = canary.Stack.load(layer.workdir / canary.STACK_FILE)  # the canary controller's series too
    exported |= observe.exported_names(
        canary.CanaryController(tiny.name, tiny.access.canary, stack, layer.workdir).exposition()
    )
    for target in triton:
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
            exported |= observe.exported_names(response.read().decode())
    board = json.loads(observe.write(tmp_path, tiny, triton, envoy)[1].read_text())
    for panel in board["panels"]:
        for query in panel["targets"]:
            missing = observe.metric_names(query["expr"]) - exported
            assert not missing, (panel["title"], missing)


def test_the_proxy_and_servers_stop_by_pid(tiny, served, tmp_path):
    layer = AccessLayer(tiny.access, {"stable": served["stable"]}, tmp_path, _ports())
    with layer:
        assert layer.alive() and (tmp_path / "envoy.json").is_file()
        with CTRClient(layer.grpc_url, spec=tiny) as client:
            assert _dense_version(client, _request(tiny)) == STABLE
        processes = [layer.proxy.process, *(s.process for s in layer.all_servers())]
    assert all(p is not None and p.poll() is not None for p in processes)
    assert not layer.alive()
