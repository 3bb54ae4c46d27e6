"""One closed-loop HTTP load generator for every server, so that their rows compare fairly.

perf_analyzer cannot drive TorchServe, so Triton's HTTP endpoint and TorchServe are measured with
this generator: ``concurrency`` workers on one asyncio loop, each sending its next pre-encoded
request as soon as the previous answer arrived, for a fixed time after a warm-up. Request bodies
are encoded once before the clock starts (Triton: the binary-tensor request ``tritonclient``
builds; TorchServe: the JSON a user of its HTTP API would post), so only transport and serving
are timed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from recserve.build.synthetic import generate
from recserve.core.names import PROBABILITY
from recserve.core.spec.model import ModelSpec

LOGGER = logging.getLogger(__name__)
#: A request slower than this waited out a sleeping batcher (tritonserver's 500 ms slot wait).
STALL_MS = 300.0

Batch = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Request:
    """One pre-encoded request."""

    body: bytes
    headers: Mapping[str, str]


@dataclass(frozen=True)
class HttpTarget:
    """Where to post and what: requests are cycled in order."""

    url: str
    requests: Sequence[Request]
    rows_per_request: int


@dataclass(frozen=True)
class LoadResult:
    """What one closed-loop measurement saw."""

    concurrency: int
    rows_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    requests: int
    failures: int
    max_ms: float = float("nan")
    stalled: int = 0  # requests over STALL_MS: a batcher asleep, not a slow execution


def sample_batches(
    spec: ModelSpec, rows_per_request: int, count: int = 16, seed: int = 7
) -> list[dict[str, np.ndarray]]:
    """``count`` request batches of synthetic rows (the same generator as training and perf data)."""
    rows = generate(spec, rows_per_request * count, seed)
    return [
        rows.take(slice(i * rows_per_request, (i + 1) * rows_per_request)).to_wire(spec) for i in range(count)
    ]


def triton_target(http_url: str, spec: ModelSpec, batches: Sequence[Batch]) -> HttpTarget:
    """Requests to Triton's ``/v2/models/<model>/infer`` in the binary tensor format."""
    import tritonclient.http as httpclient

    requests = []
    for batch in batches:
        inputs = []
        for wire in spec.wire_inputs():
            array = batch[wire.name]
            infer_input = httpclient.InferInput(wire.name, list(array.shape), wire.dtype)
            infer_input.set_data_from_numpy(array, binary_data=True)
            inputs.append(infer_input)
        outputs = [httpclient.InferRequestedOutput(PROBABILITY, binary_data=True)]
        body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
        headers = {"Content-Type": "application/octet-stream"}
        if json_size is not None:
            headers["Inference-Header-Content-Length"] = str(json_size)
        requests.append(Request(bytes(body), headers))
    rows = len(next(iter(batches[0].values())))
    return HttpTarget(f"http://{http_url}/v2/models/{spec.name}/infer", requests, rows)


def json_body(spec: ModelSpec, batch: Batch) -> bytes:
    """The batch as a JSON object of nested lists, one key per wire input (strings for BYTES)."""
    document = {}
    for wire in spec.wire_inputs():
        array = batch[wire.name]
        if wire.dtype == "BYTES":
            document[wire.name] = [
                [v.decode() if isinstance(v, bytes) else str(v) for v in row] for row in array
            ]
        else:
            document[wire.name] = array.tolist()
    return json.dumps(document, separators=(",", ":")).encode()


def torchserve_target(
    inference_url: str, model: str, spec: ModelSpec, batches: Sequence[Batch]
) -> HttpTarget:
    """Requests to TorchServe's ``/predictions/<model>`` as JSON."""
    headers = {"Content-Type": "application/json"}
    requests = [Request(json_body(spec, batch), headers) for batch in batches]
    rows = len(next(iter(batches[0].values())))
    return HttpTarget(f"http://{inference_url}/predictions/{model}", requests, rows)


async def _closed_loop(
    target: HttpTarget, concurrency: int, seconds: float, warmup_s: float, timeout_s: float
) -> LoadResult:
    import aiohttp

    latencies: list[float] = []
    failures = 0
    measuring = False
    stop_at = 0.0
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker(offset: int) -> None:
            nonlocal failures
            index = offset
            while time.perf_counter() < stop_at:
                request = target.requests[index % len(target.requests)]
                index += concurrency
                started = time.perf_counter()
                try:
                    async with session.post(
                        target.url, data=request.body, headers=request.headers
                    ) as response:
                        body = await response.read()
                        ok = response.status == 200
                        if not ok and measuring and not failures:
                            LOGGER.warning("%s answered %d: %s", target.url, response.status, body[:300])
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    ok = False
                    if measuring and not failures:
                        LOGGER.warning("%s failed: %r", target.url, exc)
                if measuring:
                    if ok:
                        latencies.append(time.perf_counter() - started)
                    else:
                        failures += 1

        async def clock() -> tuple[float, float]:
            nonlocal measuring
            await asyncio.sleep(warmup_s)
            measuring = True
            begin = time.perf_counter()
            await asyncio.sleep(seconds)
            measuring = False
            return begin, time.perf_counter()

        stop_at = time.perf_counter() + warmup_s + seconds
        timer = asyncio.create_task(clock())
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        begin, end = await timer
    ms = np.asarray(latencies) * 1e3 if latencies else np.asarray([np.nan])
    return LoadResult(
        concurrency=concurrency,
        rows_per_s=len(latencies) * target.rows_per_request / (end - begin),
        p50_ms=float(np.percentile(ms, 50)),
        p95_ms=float(np.percentile(ms, 95)),
        p99_ms=float(np.percentile(ms, 99)),
        requests=len(latencies),
        failures=failures,
        max_ms=float(ms.max()),
        stalled=int((ms > STALL_MS).sum()),
    )


def run_load(
    target: HttpTarget, concurrency: int, seconds: float = 5.0, warmup_s: float = 1.0, timeout_s: float = 30.0
) -> LoadResult:
    """Drive ``target`` with ``concurrency`` requests in flight for ``seconds`` (after ``warmup_s``).

    Requests that fail or answer other than 200 count as failures and not in the percentiles.
    """
    if concurrency < 1 or seconds <= 0:
        raise ValueError("concurrency must be >= 1 and seconds > 0")
    return asyncio.run(_closed_loop(target, concurrency, seconds, warmup_s, timeout_s))
