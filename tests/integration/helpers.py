"""Raw tritonclient requests (what the SDK would refuse to build too), closed-loop clients, waiting,
the ``recserve`` command as a subprocess, private copies of a repository, the metrics endpoint."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from recserve.clients import CTRClient, RecserveClientError
from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.traffic import infer_inputs

__all__ = [
    "ClosedLoopClients",
    "copy_repository",
    "grpc_client",
    "http_client",
    "infer_inputs",
    "infer_raw",
    "metrics_text",
    "recserve",
    "wait_for",
]


def infer_raw(module, client, spec: ModelSpec, inputs: dict[str, np.ndarray], **kwargs) -> np.ndarray:
    """Send ``inputs`` as they are and return ``probability``."""
    result = client.infer(spec.name, infer_inputs(module, inputs), **kwargs)
    return result.as_numpy("probability").reshape(-1)


def recserve(*args: str) -> subprocess.CompletedProcess:
    """The ``recserve`` command with ``args``, run as a subprocess (output captured, 120 s at most)."""
    return subprocess.run(
        [sys.executable, "-m", "recserve.cli", *args], capture_output=True, text=True, timeout=120
    )


def copy_repository(repository: Path, target: Path) -> Path:
    """A private copy of ``repository`` at ``target``, without its update log."""
    shutil.copytree(repository, target, ignore=shutil.ignore_patterns("updates"))
    return target


def run_perf(url: str, output: Path, *options: str) -> subprocess.CompletedProcess:
    """``recserve perf`` against ``url`` (short windows, no in-process rate), its points in ``output``."""
    return subprocess.run(
        [sys.executable, "-m", "recserve.cli", "perf", "--url", url, *options,
         "--measurement-ms", "1500", "--output", str(output), "--no-inprocess"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def grpc_client(server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def metrics_text(server) -> str:
    """What ``server``'s metrics endpoint shows now (Prometheus text)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10) as response:
        return response.read().decode()


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


class ClosedLoopClients:
    """``count`` SDK clients sending ``inputs`` to ``url`` over gRPC, each again as soon as answered.

    Inside the ``with`` block ``counts["ok"]`` / ``counts["failed"]`` grow and ``errors`` holds each
    failure as ``"<exception type>: <message>"``; leaving the block stops and joins the clients.
    """

    def __init__(self, url: str, spec: ModelSpec, inputs: dict[str, np.ndarray], count: int) -> None:
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(url, spec, inputs)) for _ in range(count)]

    def _loop(self, url: str, spec: ModelSpec, inputs: dict[str, np.ndarray]) -> None:
        with CTRClient(url, spec=spec, timeout_s=30) as client:
            while not self._stop.is_set():
                try:
                    client.predict_inputs(inputs)
                    self.counts["ok"] += 1
                except RecserveClientError as exc:
                    self.counts["failed"] += 1
                    self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> ClosedLoopClients:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def import_torch_model(
    head, example: tuple, names: list[str], axes: dict, spec_file: Path, folder: Path
) -> Path:
    """``head`` exported by plain ``torch.onnx.export`` over the contract's ``names`` and imported with the
    tables in ``folder/tables`` (``recserve import``); the repository it made (``folder/repository``).
    """
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            head,
            example,
            str(folder / "model.onnx"),
            input_names=names,
            output_names=["logit"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    imported = recserve(
        "--spec", str(spec_file), "import", "--tables", str(folder / "tables"),
        "--dense", str(folder / "model.onnx"), "--repository", str(folder / "repository"),
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    return folder / "repository"
