"""Raw tritonclient requests (what the SDK would refuse to build too), and waiting for a condition."""

from __future__ import annotations

import time
from collections.abc import Callable

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
