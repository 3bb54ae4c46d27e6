"""The served paths of the bench: candidate lists and rows, in the id form and the BYTES form.

Run in the venv against a running server (``python -m recserve.perf.gpu_check served``), one group
of points per call, each point appended to a JSON-lines file as soon as it is measured (a call cut
short still leaves the points before it):

* ``parity``: the served scores of rows and of a candidate list, in both forms, against the
  in-process PyTorch reference on the host, and the id form's against the BYTES form's;
* ``ids-lists``: one user's candidate list (``history`` long) of each of ``lists`` candidates, at
  each of ``concurrency`` requests in flight, in the id form;
* ``ids-rows``: row-layout requests of ``rows_batch`` synthetic rows (each with its own history), id form;
* ``bytes``: the same lists (``bytes_lists``) and rows in the BYTES form, for comparison.

The load is closed loop over gRPC: each of ``concurrency`` threads sends one request serialized once
before the clock starts, through a raw unary call (no per-call encoding), the next as soon as the
answer is in. Rows/s counts candidate rows (= user-item pairs). Every point carries Triton's
per-step queue and compute times over the point (:mod:`recserve.perf.harness.stats`), the client's
own CPU use (near 1 core: the load generator, not the server, may be the limit) and, where
``nvidia-smi dmon`` reads them, the PCIe bytes per row in each direction (approximate: 1-second
samples of the whole card).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient

from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.core.names import BYTES_WIRE, EMBEDDING_LOOKUP, IDS_WIRE, PROBABILITY, STEPS
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from recserve.perf.bench.candidates import LIST, LIST_BYTES, ROWS, requests_of
from recserve.perf.harness.stats import difference, snapshot
from recserve.perf.harness.timed_loop import timed_closed_loop
from recserve.perf.harness.traffic import infer_inputs, infer_request

from ..common import BenchSizes

METHOD = "/inference.GRPCInferenceService/ModelInfer"
TIMEOUT_S = 30.0  # a request unanswered this long counts as failed
GROUPS = ("parity", "ids-lists", "ids-rows", "bytes")

Emit = Callable[[dict[str, Any]], None]


def served_limit(url: str) -> int:
    """The most rows one request may carry: the served ``embedding_lookup``'s ``max_batch_size``."""
    with grpcclient.InferenceServerClient(url) as client:
        config = client.get_model_config(EMBEDDING_LOOKUP, as_json=True)["config"]
    return int(config.get("max_batch_size", 0))


def closed_loop(url: str, message: bytes, rows: int, concurrency: int, seconds: float) -> dict[str, Any]:
    """Candidate rows/s and latency percentiles of ``concurrency`` threads sending ``message`` in a loop."""

    @contextmanager
    def sender() -> Iterator[Callable[[], bool]]:
        with grpc.insecure_channel(url, options=[("grpc.max_receive_message_length", -1)]) as channel:
            call = channel.unary_unary(METHOD)  # bytes in, bytes out: serialized once, never parsed

            def send() -> bool:
                try:
                    call(message, timeout=TIMEOUT_S)
                    return True
                except grpc.RpcError:
                    return False

            yield send

    return timed_closed_loop(sender, rows, concurrency, seconds, 2 * TIMEOUT_S)


class PcieCounters:
    """``nvidia-smi dmon -s t`` in the background: the card's PCIe receive and transmit MB/s, per second.

    Args:
        seconds: how long the measurement runs (one sample a second, as many as fit).
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        count = str(max(int(seconds), 1))
        self.process = subprocess.Popen(
            ["nvidia-smi", "dmon", "-s", "t", "-d", "1", "-i", "0", "-c", count],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    @staticmethod
    def available() -> bool:
        """True where nvidia-smi is installed."""
        return shutil.which("nvidia-smi") is not None

    def stop(self) -> tuple[float, float] | None:
        """Mean host-to-device and device-to-host bytes/s over the samples (None without one)."""
        try:  # it ends by itself after its samples (and then has written them all)
            out, _ = self.process.communicate(timeout=self.seconds + 5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        samples = []
        for line in out.splitlines():
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            try:
                samples.append((float(fields[1]), float(fields[2])))
            except (IndexError, ValueError):
                continue
        if not samples:
            return None
        rx, tx = np.mean(np.asarray(samples), axis=0)
        return float(rx) * 1e6, float(tx) * 1e6  # rx: received by the card (host to device)


def measure_point(
    urls: tuple[str, str],
    model: str,
    request: dict[str, np.ndarray],
    rows: int,
    concurrency: int,
    seconds: float,
    pcie: bool,
) -> dict[str, Any]:
    """One closed-loop point with the steps' statistics and, with ``pcie``, the PCIe bytes per row."""
    grpc_url, http_url = urls
    message = infer_request(model, request).SerializeToString()
    before = snapshot(http_url)
    counters = PcieCounters(seconds) if pcie else None
    result = closed_loop(grpc_url, message, rows, concurrency, seconds)
    moved = counters.stop() if counters is not None else None
    steps = difference(before, snapshot(http_url), (*STEPS, model))
    result["steps"] = [step.as_dict() for step in steps]
    rate = result["rows_per_s"]
    result["pcie_h2d_bytes_per_row"] = moved[0] / rate if moved and rate else None
    result["pcie_d2h_bytes_per_row"] = moved[1] / rate if moved and rate else None
    return result


def rows_request(spec: ModelSpec, rows: int, form: str) -> dict[str, np.ndarray]:
    """``rows`` synthetic rows in the row layout of ``form`` (each with its own history)."""
    return generate(spec, rows, seed=5).to_wire(spec, form)


def plan(spec: ModelSpec, group: str, sizes: BenchSizes, limit: int) -> Iterator[tuple[dict[str, Any], Any]]:
    """The points of one group: (what, a function making its request and model) in measurement order."""
    rows = min(sizes.rows_batch, limit)
    if group in ("ids-lists", "bytes"):
        form = IDS_WIRE if group == "ids-lists" else BYTES_WIRE
        lists = sizes.lists if group == "ids-lists" else sizes.bytes_lists
        levels = sizes.concurrency if group == "ids-lists" else sizes.bytes_concurrency
        for candidates in lists:
            what = {"form": form, "shape": "list", "candidates": candidates}
            made = None if candidates > limit else requests_of(spec, candidates, sizes.history)
            for level in levels:
                request = None if made is None else made[LIST if form == IDS_WIRE else LIST_BYTES]
                yield {**what, "concurrency": level}, (spec.candidates_model, request, candidates)
    if group in ("ids-rows", "bytes"):
        form = IDS_WIRE if group == "ids-rows" else BYTES_WIRE
        request = rows_request(spec, rows, form)
        levels = sizes.concurrency if group == "ids-rows" else sizes.bytes_concurrency
        for level in levels:
            yield (
                {"form": form, "shape": "rows", "candidates": rows, "concurrency": level},
                (spec.name, request, rows),
            )


def run_points(
    spec: ModelSpec,
    urls: tuple[str, str],
    group: str,
    sizes: BenchSizes,
    until: float,
    pcie: bool,
    emit: Emit,
) -> None:
    """Measure one group's points until ``until`` (monotonic): each emitted as measured, or skipped."""
    limit = served_limit(urls[0])
    for what, (model, request, rows) in plan(spec, group, sizes, limit):
        if request is None:
            emit({**what, "skipped": f"{rows} rows per request exceed the served maximum {limit}"})
        elif until - time.monotonic() < sizes.seconds + 10:
            emit({**what, "skipped": "out of time in this step"})
        else:
            emit(
                {
                    **what,
                    **measure_point(
                        urls, str(model), request, rows, what["concurrency"], sizes.seconds, pcie
                    ),
                }
            )


def served_scores(url: str, model: str, request: dict[str, np.ndarray]) -> np.ndarray:
    """One request's probabilities."""
    with grpcclient.InferenceServerClient(url) as client:
        result = client.infer(
            model,
            infer_inputs(grpcclient, request),
            outputs=[grpcclient.InferRequestedOutput(PROBABILITY)],  # the versions are not read here
            client_timeout=TIMEOUT_S,
        )
    return np.asarray(result.as_numpy(PROBABILITY)).reshape(-1)


def parity(
    spec: ModelSpec, repository: Path, url: str, sizes: BenchSizes, tolerance: float
) -> dict[str, Any]:
    """Served rows and a served list, in both forms, against the PyTorch reference; ids against bytes."""
    reference = reference_pipeline(spec, repository, runtime="torch")
    limit = min(served_limit(url), spec.model.max_batch_size)
    rows, candidates = min(sizes.rows_batch, limit), min(min(sizes.lists), limit)
    made = requests_of(spec, candidates, sizes.history)
    cases = {
        "rows": (spec.name, {f: rows_request(spec, rows, f) for f in (IDS_WIRE, BYTES_WIRE)}, None),
        "list": (spec.candidates_model, {IDS_WIRE: made[LIST], BYTES_WIRE: made[LIST_BYTES]}, made[ROWS]),
    }
    figures: dict[str, Any] = {"tolerance": tolerance}
    for shape, (model, by_form, as_rows) in cases.items():
        expected = np.asarray(reference.predict(as_rows or by_form[IDS_WIRE])).reshape(-1)
        scores = {form: served_scores(url, str(model), request) for form, request in by_form.items()}
        for form, served in scores.items():
            figures[f"{shape}_{form}_max_abs_diff"] = float(np.abs(served - expected).max())
        figures[f"{shape}_ids_vs_bytes_max_abs_diff"] = float(
            np.abs(scores[IDS_WIRE] - scores[BYTES_WIRE]).max()
        )
        figures[f"{shape}_rows"] = int(expected.size)
    worst = max(v for k, v in figures.items() if k.endswith("_max_abs_diff"))
    figures.update(max_abs_diff=worst, ok=worst <= tolerance)
    return figures


def cmd_served(
    spec_path: Path,
    repository: Path,
    urls: tuple[str, str],
    group: str,
    sizes: BenchSizes,
    seconds: float,
    pcie: bool,
    jsonl: Path,
    tolerance: float,
) -> int:
    """One group of the served bench, each result appended to ``jsonl`` as one JSON line."""
    until = time.monotonic() + seconds
    spec = load_spec(spec_path)

    def emit(point: dict[str, Any]) -> None:
        with open(jsonl, "a") as fh:
            fh.write(json.dumps(point) + "\n")

    if group == "parity":
        emit({"parity": parity(spec, repository, urls[0], sizes, tolerance)})
    else:
        run_points(spec, urls, group, sizes, until, pcie and PcieCounters.available(), emit)
    return 0
