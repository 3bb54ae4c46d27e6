"""The device lookup served by a real tritonserver: device tensors leave embedding_lookup through DLPack.

Without a GPU the same code runs on torch's CPU device (``l1_device: "cpu"``): the lookup result is
a torch tensor handed to ``pb_utils.Tensor.from_dlpack``, merged batches are split per request, and
the scores equal the in-process reference. With ``[store] device_memory_mib = 0`` the device L1
serves (its hits counted as ``l1``); with the default budget every table is resident (``device``).
"""

from __future__ import annotations

import copy
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from recserve.build import configs
from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.core.names import EMBEDDING_LOOKUP, L1_DEVICE_PARAMETER

from .helpers import grpc_client, infer_raw, metrics_text
from .private_server import private_server


def tier_hits(server, tier: str = "l1") -> float:
    text = metrics_text(server)
    return sum(
        float(v)
        for v in re.findall(rf'recserve_embedding_keys_total\{{[^}}]*tier="{tier}"[^}}]*\}} (\S+)', text)
    )


def on_cpu_device(spec, device_memory_mib: float | None = None):
    """A ``prepare`` hook: ``embedding_lookup`` on torch's CPU device, with that device budget in its spec."""

    def prepare(root: Path) -> None:
        config = configs.step_config(spec, EMBEDDING_LOOKUP)
        config.parameters[L1_DEVICE_PARAMETER].string_value = "cpu"
        if device_memory_mib is not None:
            doc = copy.deepcopy(spec.source)
            doc.setdefault("store", {})["device_memory_mib"] = device_memory_mib
            config.parameters["spec"].string_value = json.dumps(doc, separators=(",", ":"))
        (root / EMBEDDING_LOOKUP / "config.pbtxt").write_text(configs.render(config))

    return prepare


def test_resident_tables_on_the_cpu_device_serve_the_reference_scores(spec, repository, tmp_path):
    reference = reference_pipeline(spec, repository, runtime="torch")
    wires = [generate(spec, rows, seed=60 + rows).to_wire(spec) for rows in (1, 5, 16)]
    with private_server(repository, tmp_path, model_control="none", prepare=on_cpu_device(spec)) as server:
        for request in wires:
            with grpc_client(server) as client:
                got = infer_raw(grpcclient, client, spec, request)
            assert np.allclose(got, reference.predict(request), rtol=0, atol=1e-5)
        deadline = time.monotonic() + 10  # metrics are published once a second
        while tier_hits(server, "device") == 0:
            if time.monotonic() > deadline:
                pytest.fail("no key was counted as served from the device tier")
            time.sleep(0.5)
        assert tier_hits(server, "l2") == 0 and tier_hits(server, "l1") == 0  # every table resident
        assert "Traceback" not in server.log_tail(200)


def test_device_l1_on_the_cpu_device_serves_the_reference_scores(spec, repository, tmp_path):
    device_l1 = on_cpu_device(spec, device_memory_mib=0)  # no table resident: the device L1 alone

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
        while tier_hits(server) == 0:
            if time.monotonic() > deadline:
                pytest.fail("no key was served from the device L1 within 30 s")
            predict_all(server)
            time.sleep(0.5)
        for got, want in zip(predict_all(server), expected, strict=True):
            assert np.allclose(got, want, rtol=0, atol=1e-5)
        assert "Traceback" not in server.log_tail(200)
