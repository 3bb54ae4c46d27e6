"""The device L1 served by a real tritonserver: device tensors leave embedding_lookup through DLPack.

Without a GPU the same code runs on torch's CPU device (``l1_device: "cpu"``): the lookup result is
a torch tensor handed to ``pb_utils.Tensor.from_dlpack``, merged batches are split per request, and
the scores equal the in-process reference; L1 hits are counted as ``l1``.
"""

from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from recserve.build import configs
from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.core.names import EMBEDDING_LOOKUP, L1_DEVICE_PARAMETER

from .helpers import grpc_client, infer_raw
from .private_server import private_server


def l1_hits(server) -> float:
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10).read().decode()
    )
    return sum(
        float(v) for v in re.findall(r'recserve_embedding_keys_total\{[^}]*tier="l1"[^}]*\} (\S+)', text)
    )


def test_device_l1_on_the_cpu_device_serves_the_reference_scores(spec, repository, tmp_path):
    def device_l1(root: Path) -> None:
        config = configs.step_config(spec, EMBEDDING_LOOKUP)
        config.parameters[L1_DEVICE_PARAMETER].string_value = "cpu"
        (root / EMBEDDING_LOOKUP / "config.pbtxt").write_text(configs.render(config))

    reference = reference_pipeline(spec, repository, runtime="torch")
    wires = [generate(spec, rows, seed=40 + rows).to_wire(spec) for rows in (1, 3, 8, 17)]  # ragged histories
    expected = [reference.predict(request) for request in wires]

    def predict_all(server) -> list[np.ndarray]:
        with ThreadPoolExecutor(len(wires)) as pool:  # concurrent: the dynamic batcher merges some of them
            return list(pool.map(lambda request: predict(server, request), wires))

    def predict(server, request) -> np.ndarray:
        with grpc_client(server) as client:
            return infer_raw(grpcclient, client, spec, request)

    with private_server(repository, tmp_path, model_control="none", prepare=device_l1) as server:
        for got, want in zip(predict_all(server), expected, strict=True):
            assert np.allclose(got, want, rtol=0, atol=1e-5)
        deadline = (
            time.monotonic() + 30
        )  # L1 is rebuilt every cache_refresh_s; metrics published once a second
        while l1_hits(server) == 0:
            if time.monotonic() > deadline:
                pytest.fail("no key was served from the device L1 within 30 s")
            predict_all(server)
            time.sleep(0.5)
        for got, want in zip(predict_all(server), expected, strict=True):
            assert np.allclose(got, want, rtol=0, atol=1e-5)
        assert "Traceback" not in server.log_tail(200)
