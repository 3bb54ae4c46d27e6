"""A dead tritonserver never takes the stack down: the supervisor restarts it, counted, its memory freed.

The crash is the real one: tritonserver 2.51 aborts (``std::bad_alloc``) on an HTTP JSON body whose
input declares a huge shape, sent straight to its own port. ``recserve serve`` restarts it on the
same ports after the backoff, removes the dead server's shared-memory regions, and serves the next
request. Behind the access layer, with two replicas, requests through Envoy keep being answered
while one replica is down and restarted. A killed Python-backend stub leaves its server ready while
every request through its model fails: the supervisor notices the missing stub and restarts the
server; a killed proxy is started again on its ports.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from recserve.access import AccessLayer, ProxyPorts
from recserve.access.process import SUPERVISOR_FILE
from recserve.build.repository import build_repository
from recserve.build.synthetic import generate
from recserve.clients import CTRClient, RecserveClientError
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from recserve.perf.harness.stats import snapshot
from recserve.server import Backoff, Ports
from recserve.server.shm import SHM_DIR

from .helpers import ClosedLoopClients, wait_for

pytestmark = pytest.mark.integration

IN_FLIGHT = 4  # closed-loop clients through the proxy


def shape_bomb(http_url: str, spec: ModelSpec) -> None:
    """The JSON body that aborts tritonserver 2.51: a 2**40-row shape with one ``data`` element."""
    dense = spec.wire_inputs()[0]
    body = {"inputs": [{"name": dense.name, "shape": [2**40, *dense.dims], "datatype": "FP32", "data": [0]}]}
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/{spec.name}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # the server dies mid-request
        urllib.request.urlopen(request, timeout=30)


def ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def regions(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def test_serve_restarts_a_server_killed_by_a_request_and_frees_its_shared_memory(
    spec: ModelSpec, repository: Path, tmp_path: Path
) -> None:
    ports = Ports.free()
    http = f"127.0.0.1:{ports.http}"
    output = tmp_path / "serve.log"
    with open(output, "wb") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "recserve.cli", "serve", "--repository", str(repository),
             "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
             "--metrics-port", str(ports.metrics), "--status-file", str(tmp_path / "supervisor.json")],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for(lambda: ready(http), 120, "recserve serve ready")
        wire = generate(spec, 4, seed=1).to_wire(spec)
        down_s = []
        for crash in (1, 2, 3):
            prefix = f"recserve_{serve.pid}_{crash}_"  # the regions of the server now running
            assert regions(prefix), f"no regions named {prefix}*"
            crashed_at = time.monotonic()
            shape_bomb(http, spec)
            wait_for(lambda: not ready(http), 30, "the server down")
            wait_for(lambda: ready(http), 120, f"ready again after crash {crash}")
            down_s.append(time.monotonic() - crashed_at)
            assert serve.poll() is None, output.read_text()[-3000:]
            assert not regions(prefix), "the dead server's shared memory is still there"
            with CTRClient(f"127.0.0.1:{ports.grpc}", spec=spec, timeout_s=30) as client:
                assert len(client.predict_inputs(wire)) == 4
        counted = 'recserve_supervisor_restarts_total{process="tritonserver",cause="process_died"} 3'
        prom = tmp_path / "supervisor.prom"
        wait_for(lambda: prom.is_file() and counted in prom.read_text(), 30, "3 restarts counted")
        backoff = Backoff()
        for crash, seconds in enumerate(down_s, start=1):
            assert seconds >= backoff.delay(crash), (crash, seconds)  # never faster than the backoff
        text = output.read_text(errors="replace")
        died = re.findall(r"died: killed by SIGABRT; last error: (.*); crash (\d) \((\d) in a row\)", text)
        assert [(int(c), int(r)) for _, c, r in died] == [(1, 1), (2, 2), (3, 3)], text[-3000:]
        assert all("bad_alloc" in error for error, _, _ in died), died
        load = Path("/proc/loadavg").read_text().split()[:3]
        times = ", ".join(f"{s:.1f}" for s in down_s)
        print(f"crash -> ready again: {times} s, median {statistics.median(down_s):.1f} s; load {load}")
    finally:
        serve.send_signal(signal.SIGINT)
        code = serve.wait(90)
    assert code == 0  # a deliberate stop: no restart
    assert not regions(f"recserve_{serve.pid}_")


def _requests(http_url: str) -> int:
    return snapshot(http_url).get(EMBEDDING_LOOKUP, {}).get("requests", 0)


def test_a_replica_killed_by_a_request_is_restarted_while_the_proxy_serves_on(tmp_path: Path) -> None:
    tiny = load_spec("tiny")
    build_repository(tiny, tmp_path / "built")
    access = dataclasses.replace(
        tiny.access, weights={"stable": 100}, shadow_fraction=0.0, max_requests=IN_FLIGHT, replicas=2
    )
    wire = generate(tiny, 8, seed=5).to_wire(tiny)
    with AccessLayer(access, {"stable": tmp_path / "built"}, tmp_path / "access", ProxyPorts.free()) as layer:
        supervisor = layer.supervise()
        with ClosedLoopClients(layer.grpc_url, tiny, wire, IN_FLIGHT) as clients:
            replicas = layer.servers["stable"]
            wait_for(lambda: all(_requests(s.http_url) > 0 for s in replicas), 60, "both replicas serving")
            victim, survivor = replicas[1], replicas[0]
            prefix = victim.shm_prefix
            assert regions(prefix)
            crashed_at = time.monotonic()
            shape_bomb(victim.http_url, tiny)
            at_crash, ok_at_crash = _requests(survivor.http_url), clients.counts["ok"]
            wait_for(lambda: supervisor.status()["stable-1"]["restarts"] == 1, 120, "restarted")
            restarted = layer.servers["stable"][1]
            assert restarted is not victim and restarted.ports == victim.ports
            wait_for(lambda: _requests(restarted.http_url) > 0, 60, "taking traffic again")
            without_s = time.monotonic() - crashed_at
            served_meanwhile = clients.counts["ok"] - ok_at_crash
            assert _requests(survivor.http_url) > at_crash
        assert layer.proxy is not None and layer.proxy.process is not None
        assert layer.proxy.process.poll() is None  # the stack stayed up
        assert survivor.process is not None and survivor.process.poll() is None
        status = json.loads((layer.workdir / SUPERVISOR_FILE).read_text())
    assert status["stable-1"]["crashes"] == 1 and status["stable-1"]["restarts"] == 1
    assert status["stable-1"]["last_cause"] == "killed by SIGABRT"
    assert "bad_alloc" in status["stable-1"]["last_error"]
    assert status["stable-0"]["crashes"] == 0
    assert not regions(prefix)
    counts, errors = clients.counts, clients.errors
    assert counts["failed"] <= IN_FLIGHT, errors  # at most the requests in flight on the victim
    assert all("unavailable" in e.lower() for e in errors), errors
    print(
        f"crash -> ready {status['stable-1']['last_down_s']:.1f} s; without the replica "
        f"{without_s:.1f} s, {served_meanwhile} requests "
        f"served through the proxy meanwhile, {counts['failed']} failed of {sum(counts.values())}; "
        f"load {Path('/proc/loadavg').read_text().split()[:3]}"
    )


def _served(url: str, spec: ModelSpec, wire: dict) -> bool:
    try:
        with CTRClient(url, spec=spec, timeout_s=5) as client:
            return len(client.predict_inputs(wire)) == len(next(iter(wire.values())))
    except RecserveClientError:
        return False


def test_a_dead_stub_and_a_dead_proxy_are_noticed_restarted_and_counted(tmp_path: Path) -> None:
    """kill -9 of a stub left the server ready and every request failing; of Envoy, the stack down."""
    tiny = load_spec("tiny")
    build_repository(tiny, tmp_path / "built")
    access = dataclasses.replace(
        tiny.access, weights={"stable": 100}, shadow_fraction=0.0, max_requests=IN_FLIGHT, replicas=1
    )
    wire = generate(tiny, 8, seed=5).to_wire(tiny)
    with AccessLayer(access, {"stable": tmp_path / "built"}, tmp_path / "access", ProxyPorts.free()) as layer:
        layer.supervise()
        server = layer.servers["stable"][0]
        assert _served(layer.grpc_url, tiny, wire)
        stub = next(pid for pid, model in server.stubs().items() if model == EMBEDDING_LOOKUP)
        killed_at = time.monotonic()
        os.kill(stub, signal.SIGKILL)
        wait_for(lambda: _served(layer.grpc_url, tiny, wire), 60, "served again after the stub died")
        stub_s = time.monotonic() - killed_at
        assert layer.servers["stable"][0] is not server  # started again, not only reloaded
        assert layer.proxy is not None and layer.proxy.process is not None
        proxy = layer.proxy.process
        killed_at = time.monotonic()
        proxy.kill()
        wait_for(lambda: _served(layer.grpc_url, tiny, wire), 60, "served again after the proxy died")
        proxy_s = time.monotonic() - killed_at
        prom_file = (layer.workdir / SUPERVISOR_FILE).with_suffix(".prom")
        restarted = 'recserve_supervisor_restarts_total{process="envoy",cause="process_died"} 1'
        wait_for(lambda: restarted in prom_file.read_text(), 30, "the proxy's restart counted")
        status = json.loads((layer.workdir / SUPERVISOR_FILE).read_text())
        prom = prom_file.read_text()
    assert status["stable-0"]["last_cause"] == f"stub of '{EMBEDDING_LOOKUP}' (pid {stub}) killed by SIGKILL"
    assert status["stable-0"]["restarts"] == 1
    assert status["envoy"]["last_cause"] == "killed by SIGKILL" and status["envoy"]["restarts"] == 1
    assert 'recserve_supervisor_restarts_total{process="stable-0",cause="stub_died"} 1' in prom
    assert 'recserve_supervisor_restarts_total{process="envoy",cause="process_died"} 1' in prom
    assert stub_s < 30 and proxy_s < 30
    print(f"served again {stub_s:.1f} s after the stub died, {proxy_s:.1f} s after the proxy died")
