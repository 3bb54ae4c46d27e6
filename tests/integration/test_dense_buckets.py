"""The served dense step: a missed shape is answered at once, compiled in the background, then hits."""

import re
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.server import Ports, TritonServer

from .helpers import grpc_client, infer_raw, metrics_text

DEADLINE_S = 60.0


def dense_metrics(server) -> dict[str, float]:
    """The dense step's counters from the metrics endpoint, keyed ``family{label}``."""
    found = re.findall(
        r'^(recserve_dense_\w+)\{\w+="(\w+)"\} (\S+)$', metrics_text(server), flags=re.MULTILINE
    )
    return {f"{family}{{{label}}}": float(value) for family, label, value in found}


@pytest.fixture
def fresh(repository, tmp_path):
    """A server of this test's own: no compiles queued by other tests' shapes ahead of this one."""
    with TritonServer(repository, Ports.free(), log_path=tmp_path / "server.log") as server:
        yield server


def test_a_missed_shape_is_served_then_compiled_and_then_hits(fresh, spec, repository):
    server = fresh
    reference = reference_pipeline(spec, repository, runtime="torch")
    rows = generate(spec, 97, seed=97)  # 97 rows would pad to 128 (24% waste): a miss, compiles 104 rows
    rows.lengths[:] = 20  # one sequence bucket (32) for the whole batch
    rows.history[:, :20] = np.random.default_rng(97).integers(0, 50000, size=(97, 20))
    wire = rows.to_wire(spec)
    expected = reference.predict(wire)
    deadline = time.monotonic() + DEADLINE_S
    sent = 0
    with grpc_client(server) as client:
        first = dense_metrics(server)  # warm-up's counts included: they are published before READY
        while True:  # counters are published once a second; compiles finish in the background
            np.testing.assert_allclose(infer_raw(grpcclient, client, spec, wire), expected, rtol=0, atol=1e-5)
            sent += 1
            now = dense_metrics(server)
            grew = {k: now.get(k, 0) - first.get(k, 0) for k in now}
            if (
                grew.get("recserve_dense_bucket_requests_total{compile}", 0) >= 1
                and grew["recserve_dense_bucket_requests_total{hit}"] >= 1
            ):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"no compile and hit within {DEADLINE_S:.0f} s: {grew}")
            time.sleep(0.3)
        np.testing.assert_allclose(infer_raw(grpcclient, client, spec, wire), expected, rtol=0, atol=1e-5)
        sent += 1
    settled = time.monotonic() + 5.0  # the metrics thread publishes every count within a second
    while True:
        now = dense_metrics(server)
        grew = {k: now.get(k, 0) - first.get(k, 0) for k in now}
        served = grew["recserve_dense_bucket_requests_total{hit}"] + grew.get(
            "recserve_dense_bucket_requests_total{fallback}", 0
        )
        if served >= sent or time.monotonic() > settled:
            break
        time.sleep(0.2)
    hits = grew["recserve_dense_bucket_requests_total{hit}"]
    # every request is one dense batch, counted once, as a hit or a fallback
    assert hits + grew["recserve_dense_bucket_requests_total{fallback}"] == sent, grew
    assert grew["recserve_dense_bucket_requests_total{miss}"] >= 1
    assert grew["recserve_dense_padding_total{padding_rows}"] == 7 * hits
    assert now["recserve_dense_padding_total{real_rows}"] > 0


def test_counters_are_exported_at_zero_as_soon_as_the_server_is_ready(repository, tmp_path):
    """Series a dashboard alerts on exist before their first event: zero is told apart from missing."""
    with TritonServer(repository, Ports.free(), log_path=tmp_path / "server.log") as fresh:  # no request
        text = metrics_text(fresh)
    for series in (
        r'recserve_dense_bucket_requests_total\{[^}]*event="fallback"[^}]*\}',
        r'recserve_dense_bucket_requests_total\{[^}]*event="compile_failure"[^}]*\}',
        r"recserve_store_updates_rejected_total",
        r'recserve_embedding_keys_total\{[^}]*tier="l3"[^}]*\}',
    ):
        assert re.search(rf"^{series} 0$", text, flags=re.MULTILINE), f"{series} at 0 not exported:\n{text}"
