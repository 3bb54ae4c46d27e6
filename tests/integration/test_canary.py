"""The canary live: a real Envoy, real tritonservers, the controller reading their real metrics.

Stable serves dense version 1 of the tiny spec. Each test deploys a canary (a new repository on
the canary's server, restarted in place) and runs ``recserve canary``'s controller against it
while clients send traffic through the proxy:

* a canary whose network returns NaN for a share of rows (its requests fail with INTERNAL) is
  rolled back in its shadow stage within two controller periods; clients never see a failure;
* a canary whose scores are halved is rolled back at its first live step within two periods;
  requests never fail, and after the rollback every response is stable's;
* a healthy canary goes through shadow → 50 → 100 % and is promoted; the proxy, restarted from
  its folder, still sends everything to it;
* malformed requests aimed at the canary and at stable (a client picks its user id, so its
  variant) move no decision: they are counted as client errors, apart from the failures.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import helper
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from recserve.access import PROTOCOLS, AccessLayer, ProxyPorts, behind_proxy, cluster_name
from recserve.access.canary import controller as canary
from recserve.backends.base.artifacts import file_entry, read_manifest, write_manifest
from recserve.build.repository import build_repository
from recserve.build.synthetic import generate
from recserve.clients import CTRClient, RecserveClientError
from recserve.core.names import PROBABILITY, USER_HEADER
from recserve.core.sections.serving import CanarySection
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec, spec_path
from recserve.perf.harness.traffic import scratch_repository

pytestmark = pytest.mark.integration

STABLE, CANDIDATE = 1, 2  # dense versions
PERIOD_S = 1.5  # the controller's period here (the dense step publishes its histogram once a second)


@pytest.fixture(scope="module")
def tiny() -> ModelSpec:
    return load_spec("tiny")


@pytest.fixture(scope="module")
def stable(tiny: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("canary-stable")
    build_repository(tiny, root / "repository")
    return root / "repository"


def _candidate(stable: Path, target: Path, rewrite) -> Path:
    """A copy of ``stable`` whose only dense version is 2: version 1's network passed through
    ``rewrite(graph, probability_name) -> nodes`` that compute the new ``probability``."""
    repository = scratch_repository(stable, target)
    dense = repository / "dense"
    shutil.move(dense / "1", dense / str(CANDIDATE))
    folder = dense / str(CANDIDATE)
    model = onnx.load(folder / "model.onnx")
    graph = model.graph
    (output,) = [o for o in graph.output if o.name == PROBABILITY]
    for node in graph.node:
        node.output[:] = ["raw_probability" if name == output.name else name for name in node.output]
    graph.node.extend(rewrite("raw_probability"))
    onnx.save(model, folder / "model.onnx")
    manifest = read_manifest(folder)
    manifest["version"] = CANDIDATE
    manifest["files"]["model"] = file_entry(folder, folder / "model.onnx")
    write_manifest(folder, manifest)
    return repository


def _same(raw: str) -> list:
    return [helper.make_node("Identity", [raw], [PROBABILITY])]


def _nan_below(threshold: float):
    """NaN for rows under ``threshold``: probability + 0 × sqrt(probability − threshold)."""

    def rewrite(raw: str) -> list:
        const = helper.make_node(
            "Constant",
            [],
            ["threshold"],
            value=helper.make_tensor("t", onnx.TensorProto.FLOAT, [], [threshold]),
        )
        zero = helper.make_node(
            "Constant", [], ["zero"], value=helper.make_tensor("z", onnx.TensorProto.FLOAT, [], [0.0])
        )
        return [
            const,
            zero,
            helper.make_node("Sub", [raw, "threshold"], ["margin"]),
            helper.make_node("Sqrt", ["margin"], ["root"]),
            helper.make_node("Mul", ["root", "zero"], ["poison"]),
            helper.make_node("Add", [raw, "poison"], [PROBABILITY]),
        ]

    return rewrite


def _halved(raw: str) -> list:
    half = helper.make_node(
        "Constant", [], ["half"], value=helper.make_tensor("h", onnx.TensorProto.FLOAT, [], [0.5])
    )
    return [half, helper.make_node("Mul", [raw, "half"], [PROBABILITY])]


@pytest.fixture(scope="module")
def layer(tiny: ModelSpec, stable: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AccessLayer]:
    root = tmp_path_factory.mktemp("canary")
    canary = _candidate(stable, root / "healthy", _same)
    served, _ = behind_proxy(
        {"stable": stable, "canary": canary}, "unbounded", tiny.serving.queue_policies, root
    )
    access = dataclasses.replace(tiny.access, max_requests=8, shadow_max_requests=8, request_timeout_s=10.0)
    with AccessLayer(access, served, root / "run", ProxyPorts.free()) as running:
        yield running


def _deploy(layer: AccessLayer, repository: Path) -> None:
    """Serve ``repository`` as the canary (its server restarted in place) from a fresh decision."""
    (layer.workdir / canary.STATE_FILE).unlink(missing_ok=True)
    layer.repositories["canary"][0] = repository
    layer.restart("canary", 0)
    assert layer.proxy is not None
    layer.proxy.wait_healthy([cluster_name("canary", p) for p in PROTOCOLS])


def _settings(tiny: ModelSpec, **changes) -> CanarySection:
    base = dict(
        period_s=PERIOD_S, dwell_s=2.0, min_requests=40, min_judged=30, metrics_port=ProxyPorts.free().admin
    )
    return dataclasses.replace(tiny.access.canary, **{**base, **changes})


@dataclasses.dataclass
class Traffic:
    """What the clients saw: (when, dense version) per served request, and every failure."""

    served: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    failed: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@contextmanager
def _traffic(
    layer: AccessLayer, tiny: ModelSpec, clients: int = 3, users: tuple[str, ...] = ()
) -> Iterator[Traffic]:
    """Closed-loop clients (gRPC and HTTP) sending 4-row requests through the proxy (as ``users``,
    one each in turn, when given)."""
    seen, stop = Traffic(), threading.Event()

    def client(i: int) -> None:
        protocol, url = ("http", layer.http_url) if i % 3 == 2 else ("grpc", layer.grpc_url)
        requests = [generate(tiny, 4, seed=100 * i + k).to_wire(tiny) for k in range(16)]
        user = users[i % len(users)] if users else None
        with CTRClient(url, protocol=protocol, spec=tiny, timeout_s=30, user_id=user) as sdk:
            k = 0
            while not stop.is_set():
                started = time.monotonic()
                try:
                    version = sdk.score_inputs(requests[k % len(requests)]).dense_version
                    with seen.lock:
                        seen.served.append((started, version))
                except RecserveClientError as exc:
                    with seen.lock:
                        seen.failed.append((started, str(exc)))
                k += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)  # every client connected and sending
        yield seen
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def _run(layer: AccessLayer, tiny: ModelSpec, settings: CanarySection, timeout_s: float = 60.0):
    """Run the controller to its decision (or ``timeout_s``); the controller and its final state."""
    stack = canary.Stack.load(layer.workdir / canary.STACK_FILE)
    controller = canary.CanaryController(tiny.name, settings, stack, layer.workdir)
    server = controller.serve_metrics()
    stop = threading.Event()
    timer = threading.Timer(timeout_s, stop.set)
    timer.start()
    try:
        state = controller.run(stop, new=True)
    finally:
        timer.cancel()
        server.shutdown()
    return controller, state


def _stable_threshold(layer: AccessLayer, tiny: ModelSpec, share: float) -> float:
    """The ``share`` quantile of stable's probabilities on the traffic's rows."""
    with CTRClient(layer.grpc_url, spec=tiny) as sdk:
        scores = [sdk.predict_inputs(generate(tiny, 64, seed=s).to_wire(tiny)) for s in range(4)]
    return float(np.quantile(np.concatenate(scores), share))


def test_a_candidate_failing_a_share_of_rows_is_rolled_back_in_its_shadow_stage(layer, tiny, tmp_path):
    threshold = _stable_threshold(layer, tiny, 0.2)
    _deploy(layer, _candidate(layer.repositories["stable"][0], tmp_path / "failing", _nan_below(threshold)))
    settings = _settings(tiny, shadow_fraction=1.0, steps=(50.0, 100.0))
    with _traffic(layer, tiny) as seen:
        controller, state = _run(layer, tiny, settings)
        time.sleep(0.5)
    assert state.status == canary.ROLLED_BACK, state
    rollback = state.events[-1]
    assert rollback["stage"] == "shadow" and "error rate" in rollback["reason"], rollback
    assert rollback["after_s"] <= 2 * PERIOD_S + 0.5, rollback  # within two periods (+ the scrapes)
    assert seen.served and not seen.failed, seen.failed[:3]  # mirrored failures never reach a client
    assert {v for _, v in seen.served} == {STABLE}
    log = [json.loads(line) for line in (layer.workdir / canary.LOG_FILE).read_text().splitlines()]
    assert log[-1]["event"] == "rollback" and log[-2]["event"] == "start"
    assert "recserve_access_canary_rollbacks_total 1" in controller.exposition()
    print(f"failing canary rolled back after {rollback['after_s']} s: {rollback['reason']}")


def test_a_candidate_shifting_its_scores_is_rolled_back_at_its_first_live_step(layer, tiny, tmp_path):
    _deploy(layer, _candidate(layer.repositories["stable"][0], tmp_path / "halved", _halved))
    settings = _settings(tiny, shadow_fraction=0.0, steps=(50.0, 100.0))
    with _traffic(layer, tiny) as seen:
        controller, state = _run(layer, tiny, settings)
        decided = time.monotonic()
        time.sleep(1.5)
    assert state.status == canary.ROLLED_BACK, state
    rollback = state.events[-1]
    assert rollback["stage"] == "50%" and rollback["after_s"] <= 2 * PERIOD_S + 0.5, rollback
    assert "PSI" in rollback["reason"] or "mean probability" in rollback["reason"], rollback
    assert rollback["figures"]["mean_ratio"] < 0.8, rollback
    assert not seen.failed, seen.failed[:3]
    versions = Counter(v for _, v in seen.served)
    assert versions[CANDIDATE] > 0, versions  # it was live before it went
    after = {v for t, v in seen.served if t > decided + 0.3}
    assert after == {STABLE}, after
    print(f"shifted canary rolled back after {rollback['after_s']} s: {rollback['reason']}")


def test_recserve_canary_promotes_a_healthy_candidate_and_a_restarted_proxy_keeps_it(layer, tiny, tmp_path):
    _deploy(layer, _candidate(layer.repositories["stable"][0], tmp_path / "healthy", _same))
    metrics_port = ProxyPorts.free().admin
    spec = tmp_path / "tiny-canary.toml"  # the bundled tiny spec with a quick rollout
    # p99s of a loaded 2-core machine wander: only a large latency regression would count here
    spec.write_text(
        spec_path("tiny").read_text()
        + "\n[access.canary]\nsteps = [50, 100]\nshadow_fraction = 0.5\ndwell_s = 1.0\nsettle_s = 1.0\n"
        + f"period_s = {PERIOD_S}\nmin_requests = 40\nmin_judged = 30\np99_slack_ms = 25.0\n"
        + f"metrics_port = {metrics_port}\n"
    )
    command = [
        sys.executable,
        "-m",
        "recserve.cli",
        "--spec",
        str(spec),
        "canary",
        "--workdir",
        str(layer.workdir),
    ]
    with _traffic(layer, tiny) as seen:
        rollout = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        exposition = ""
        while rollout.poll() is None and "recserve_access_canary_stage" not in exposition:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{metrics_port}/metrics", timeout=2
                ) as response:
                    exposition = response.read().decode()
            except OSError:
                time.sleep(0.2)
        out, err = rollout.communicate(timeout=60)
        decided = time.monotonic()
        time.sleep(1.0)
    assert rollout.returncode == 0, (out, err[-2000:])  # 0: promoted
    assert out.strip() == "canary promoted at stage 100%", out
    assert 'recserve_access_canary_status{status="running"} 1' in exposition  # served while it ran
    state = canary.CanaryState.load(layer.workdir / canary.STATE_FILE)
    assert [e["event"] for e in state.events] == ["step", "step", "promote"]
    assert [e["stage"] for e in state.events] == ["shadow", "50%", "100%"]
    assert not seen.failed, seen.failed[:3]
    assert {v for t, v in seen.served if t > decided + 0.3} == {CANDIDATE}
    assert state.events[-1]["figures"]["error_rate_increase"] <= 0.0

    layer.restart_proxy()  # the runtime weights are gone; the saved decision is not
    with CTRClient(layer.grpc_url, spec=tiny) as sdk:
        request = generate(tiny, 4, seed=7).to_wire(tiny)
        assert {sdk.score_inputs(request).dense_version for _ in range(20)} == {CANDIDATE}
    assert layer.admin.runtime() == {}  # nothing set at run time: the config itself routes so


def _users_by_variant(layer: AccessLayer, tiny: ModelSpec) -> dict[int, str]:
    """A user id the proxy routes to each dense version (stable's and the canary's)."""
    request = generate(tiny, 1, seed=3).to_wire(tiny)
    found: dict[int, str] = {}
    for user in (f"user-{i}" for i in range(200)):
        with CTRClient(layer.grpc_url, spec=tiny, user_id=user) as sdk:
            found.setdefault(sdk.score_inputs(request).dense_version, user)
        if len(found) == 2:
            return found
    raise AssertionError(f"no user routed to each variant: {found}")


def _malformed(tiny: ModelSpec) -> list[dict[str, np.ndarray]]:
    """Requests only a client is to blame for: a value no step accepts, and a shape Triton refuses."""
    valid = generate(tiny, 4, seed=11).to_wire(tiny)
    text = next(name for name, array in valid.items() if array.dtype == object)  # hex categoricals
    wide = next(name for name, array in valid.items() if array.dtype == np.float32 and array.shape[1] > 1)
    bad_value = {**valid, text: valid[text].copy()}
    bad_value[text].flat[0] = b"zz-not-hex"
    bad_shape = {**valid, wide: valid[wide][:, :1].copy()}
    return [bad_value, bad_shape]


def _send_malformed(layer: AccessLayer, tiny: ModelSpec, users: list[str], stop: threading.Event) -> Counter:
    """Malformed requests with these user ids over HTTP and gRPC until ``stop``; the answers' kinds."""
    answers: Counter = Counter()
    clients = [
        (grpcclient, grpcclient.InferenceServerClient(layer.grpc_url)),
        (httpclient, httpclient.InferenceServerClient(layer.http_url)),
    ]
    k = 0
    while not stop.is_set():
        module, client = clients[k % 2]
        arrays = _malformed(tiny)[(k // 2) % 2]
        inputs = []
        for name, array in arrays.items():
            dtype = "BYTES" if array.dtype == object else np_to_triton_dtype(array.dtype)
            tensor = module.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            client.infer(tiny.name, inputs, headers={USER_HEADER: users[(k // 4) % len(users)]})
            answers["served"] += 1
        except InferenceServerException as exc:
            answers[str(exc.status())] += 1
        k += 1
    return answers


def test_malformed_requests_at_either_variant_move_no_decision(layer, tiny, tmp_path):
    _deploy(layer, _candidate(layer.repositories["stable"][0], tmp_path / "healthy", _same))
    # 50 % live from the start; the stage lasts longer than the attack: no decision is due in it.
    # Only the error rate is judged here: each variant scores other rows (its users' own), and p99s
    # of a loaded 2-core machine wander
    settings = _settings(
        tiny,
        shadow_fraction=0.0,
        steps=(50.0, 100.0),
        dwell_s=60.0,
        max_psi=100.0,
        mean_ratio=(0.01, 100.0),
        p99_slack_ms=1000.0,
    )
    stack = canary.Stack.load(layer.workdir / canary.STACK_FILE)
    ensembles = [tiny.name, *([tiny.candidates_model] if tiny.candidates_model else [])]
    controller = canary.CanaryController(ensembles, settings, stack, layer.workdir)
    stop, attack = threading.Event(), threading.Event()
    rollout = threading.Thread(target=controller.run, args=(stop,), kwargs={"new": True}, daemon=True)
    rollout.start()
    try:
        while controller.periods == 0:  # begun: the stage's weights are on the proxy
            time.sleep(0.1)
        users = _users_by_variant(layer, tiny)
        answers: Counter = Counter()
        with _traffic(layer, tiny, clients=6, users=tuple(users.values())) as seen:
            sender = threading.Thread(
                target=lambda: answers.update(_send_malformed(layer, tiny, list(users.values()), attack))
            )
            sender.start()
            time.sleep(5 * PERIOD_S)  # five periods under attack
            attack.set()
            sender.join(30)
            time.sleep(PERIOD_S)
    finally:
        stop.set()
        rollout.join(30)
    state, verdict = controller.state, controller.verdict
    assert state.status == canary.RUNNING and state.stage == 0 and not state.events, state
    assert not seen.failed, seen.failed[:3]
    assert answers["served"] == 0 and sum(answers.values()) > 20, answers  # every one refused
    figures = dict(verdict.figures)
    assert figures["client_errors_canary"] > 0 and figures["client_errors_stable"] > 0, figures
    assert figures["error_rate_increase"] == 0.0, figures  # no failure on either side
    exposition = controller.exposition()
    assert 'recserve_access_canary_figure{figure="client_errors_canary"}' in exposition
    print(f"malformed answers {dict(answers)}; figures {figures}")
