"""The ``cuda`` profile's code path served by a real tritonserver, on torch's CPU device.

``embedding_lookup`` with ``l1_device: "cpu"`` (tables resident on the device, its vectors handed
on as torch tensors through DLPack) and ``dense`` with ``dense_device: "cpu"`` (PyTorch buckets
taking its inputs as torch tensors through DLPack). Rows and candidate lists score the reference;
the dense step copies nothing from the host (every input arrives as a tensor), and both steps
publish their host-device bytes.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from recserve.build import configs
from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.clients import CTRClient, read_rows
from recserve.clients.writers import write_tsv
from recserve.core.names import DENSE, DENSE_DEVICE_PARAMETER, EMBEDDING_LOOKUP, L1_DEVICE_PARAMETER

from .helpers import grpc_client, infer_raw, metrics_text, wait_for
from .private_server import private_server


def on_cpu_device(spec):
    """A ``prepare`` hook: both steps on their device path, on torch's CPU device."""

    def prepare(root: Path) -> None:
        for step, parameter in ((EMBEDDING_LOOKUP, L1_DEVICE_PARAMETER), (DENSE, DENSE_DEVICE_PARAMETER)):
            config = configs.step_config(spec, step)
            config.parameters[parameter].string_value = "cpu"
            (root / step / "config.pbtxt").write_text(configs.render(config))

    return prepare


def copied(server) -> dict[tuple[str, str], float]:
    """Bytes by (direction, step) of the copy counter; each step's executions as (step, "executes")."""
    found = {}
    for name, labels, value in re.findall(
        r"^(recserve_device_\w+)\{([^}]*)\} (\S+)$", metrics_text(server), re.M
    ):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if name == "recserve_device_copy_bytes_total":
            found[(named["direction"], named["step"])] = float(value)
        elif name == "recserve_device_executes_total":
            found[(named["step"], "executes")] = float(value)
    return found


def as_rows(spec, history, rows):
    """The row layout of one user's candidate list: every row carries the user's history."""
    inputs = rows.to_inputs(spec)
    items = np.asarray(history, np.int64)
    inputs[spec.sequences[0].name] = np.tile(items if items.size else np.zeros(1, np.int64), (len(rows), 1))
    inputs[spec.sequence_length_input] = np.full((len(rows), 1), items.size, np.int32)
    return inputs


def test_device_steps_on_the_cpu_device_serve_the_reference(spec, repository, tmp_path):
    reference = reference_pipeline(spec, repository, runtime="torch")
    wires = [generate(spec, rows, seed=90 + rows).to_wire(spec) for rows in (1, 6, 19)]
    candidates = read_rows(write_tsv(tmp_path / "rows.tsv", generate(spec, 40, seed=91), spec), spec)
    history = candidates.history[3, : candidates.lengths[3]].tolist()
    assert history
    with private_server(repository, tmp_path, model_control="none", prepare=on_cpu_device(spec)) as server:
        for request in wires:
            with grpc_client(server) as client:
                got = infer_raw(grpcclient, client, spec, request)
            np.testing.assert_allclose(got, reference.predict(request), rtol=0, atol=1e-5)
        with CTRClient(server.grpc_url, timeout_s=30, spec=spec) as client:
            served = client.score_candidates({spec.sequences[0].name: history}, candidates)
        expected = reference.predict(as_rows(spec, history, candidates)).reshape(-1)
        np.testing.assert_allclose(np.asarray(served).reshape(-1), expected, rtol=0, atol=1e-5)
        wait_for(  # each step's metrics thread publishes once a second
            lambda: (
                (counts := copied(server)).get(("h2d", EMBEDDING_LOOKUP), 0) > 0
                and counts.get(("d2h", DENSE), 0) > 0
            ),
            10,
            "both steps' copy counts",
        )
        counts = copied(server)
        assert counts[("h2d", DENSE)] == 0, "dense copied host arrays: an input did not arrive as a tensor"
        assert counts[("d2h", DENSE)] > 0  # the probabilities
        assert counts[("h2d", EMBEDDING_LOOKUP)] > 0  # the keys
        assert "Traceback" not in server.log_tail(200)
