"""Raw tritonclient requests (what the SDK would refuse to build too), and waiting for a condition."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from recserve.perf.traffic import infer_inputs
from recserve.spec import ModelSpec

__all__ = ["grpc_client", "http_client", "infer_inputs", "infer_raw", "wait_for"]


def infer_raw(module, client, spec: ModelSpec, inputs: dict[str, np.ndarray], **kwargs) -> np.ndarray:
    """Send ``inputs`` as they are and return ``probability``."""
    result = client.infer(spec.name, infer_inputs(module, inputs), **kwargs)
    return result.as_numpy("probability").reshape(-1)


def run_perf(url: str, output: Path, *options: str) -> subprocess.CompletedProcess:
    """``recserve perf`` against ``url`` (short windows, no in-process rate), its points in ``output``."""
    return subprocess.run(
        [sys.executable, "-m", "recserve.cli", "perf", "--url", url, *options,
         "--measurement-ms", "1500", "--output", str(output), "--no-inprocess"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def grpc_client(server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def http_client(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, connection_timeout=30, network_timeout=30)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str = "condition") -> float:
    """Seconds until ``condition()`` held; fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what}: not met within {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic() - started
