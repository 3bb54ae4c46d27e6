"""Test and benchmark traffic against a served repository: requests, senders, scratch copies.

Shared by the soak, the overload and Redis-outage experiments and the integration tests: a pool of
valid requests from the spec's synthetic rows, malformed variants of them, one sender thread that
mixes gRPC and HTTP, and the counts of what the server answered.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, serialize_byte_tensor

from recserve.backends.base.artifacts import model_versions
from recserve.build.synthetic import generate
from recserve.core.names import DENSE_VERSION, EMBEDDING_VERSION, PROBABILITY
from recserve.core.spec.model import ModelSpec
from recserve.server import TritonServer


@dataclass
class TrafficCounts:
    """What the traffic threads saw."""

    valid_ok: int = 0
    valid_failed: int = 0
    bad_refused: int = 0
    bad_accepted: int = 0
    failures: list[str] = field(default_factory=list)
    versions: set[int] = field(default_factory=set)  # dense versions seen
    embedding_versions: set[tuple[int, ...]] = field(
        default_factory=set
    )  # store snapshots seen (table versions)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(
        self,
        bad: bool,
        error: InferenceServerException | None,
        version: int | None = None,
        embedding_version: tuple[int, ...] | None = None,
    ) -> None:
        """Count one response (with the dense version and the table versions that served it)."""
        with self.lock:
            if bad:
                refused = error is not None and (error.status() or "").upper() in (
                    "400",
                    "STATUSCODE.INVALID_ARGUMENT",
                )
                self.bad_refused += refused
                self.bad_accepted += not refused
                if not refused:
                    self.failures.append(f"malformed request answered with {error!s}"[:300])
            elif error is None:
                self.valid_ok += 1
                if version is not None:
                    self.versions.add(version)
                if embedding_version is not None:
                    self.embedding_versions.add(embedding_version)
            else:
                self.valid_failed += 1
                self.failures.append(f"valid request failed: {error!s}"[:300])


def add_version(repository: Path, model: str, source_version: int | None = None) -> int:
    """Copy a version folder (the newest by default) to the next version number; returns it."""
    versions = model_versions(repository / model)
    new = versions[-1] + 1
    shutil.copytree(repository / model / str(source_version or versions[-1]), repository / model / str(new))
    return new


def request_pool(spec: ModelSpec, count: int = 48, seed: int = 11) -> list[dict[str, np.ndarray]]:
    """Valid requests of 1..64 rows."""
    rng = np.random.default_rng(seed)
    return [
        generate(spec, int(rng.choice([1, 4, 16, 64])), seed=seed + i).to_wire(spec) for i in range(count)
    ]


def malformed(spec: ModelSpec, request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same request with a NaN in a present dense value (refused with INVALID_ARG).

    A spec without numeric features gets a categorical tensor one column short instead.
    """
    bad = {k: v.copy() for k, v in request.items()}
    if spec.dense is None:
        bad[spec.categorical.name] = bad[spec.categorical.name][:, :-1]
        return bad
    bad[spec.dense.name][0, 0], bad[spec.dense_missing_input][0, 0] = np.nan, False
    return bad


def infer_inputs(module: Any, inputs: dict[str, np.ndarray]) -> list[Any]:
    """``InferInput`` objects of ``module`` (tritonclient.grpc or .http) carrying the arrays as they are."""
    tensors = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def infer_request(model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str] = (PROBABILITY,)) -> Any:
    """A ready-to-send gRPC ``ModelInferRequest`` (raw binary contents; BYTES length-prefixed), built once.

    It asks for ``outputs`` only (the probabilities by default): a request naming no output gets
    every output of the model back.
    """
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name=model)
    for name in outputs:
        message.outputs.add(name=name)
    for name, array in inputs.items():
        tensor = message.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype))
        tensor.shape.extend(array.shape)
        message.raw_input_contents.append(
            serialize_byte_tensor(array).item() if array.dtype == object else array.tobytes()
        )
    return message


def _send(
    module: Any, client: Any, spec: ModelSpec, inputs: dict[str, np.ndarray]
) -> tuple[int, tuple[int, ...]]:
    """One request; the dense version and the table versions that served it (one row for the request)."""
    tensors = infer_inputs(module, inputs)
    outputs = [module.InferRequestedOutput(name) for name in (PROBABILITY, DENSE_VERSION, EMBEDDING_VERSION)]
    result = client.infer(spec.name, tensors, outputs=outputs)
    if result.as_numpy(PROBABILITY) is None:
        raise InferenceServerException("response without probability")
    embedding, dense = result.as_numpy(EMBEDDING_VERSION), result.as_numpy(DENSE_VERSION)
    if embedding.shape != (1, len(spec.table_names)) or dense.size != 1:
        raise InferenceServerException(
            f"versions are one row per request: got {list(dense.shape)} and {list(embedding.shape)}"
        )
    return int(dense.reshape(-1)[0]), tuple(int(v) for v in embedding[0])


def traffic_worker(
    server: TritonServer,
    spec: ModelSpec,
    protocol: str,
    stop: threading.Event,
    counts: TrafficCounts,
    bad_fraction: float,
    seed: int,
    pause_s: float = 0.005,
) -> None:
    """Closed-loop requests until ``stop``.

    A pause of ``pause_s`` between requests keeps the load moderate.
    """
    rng = random.Random(seed)
    pool = request_pool(spec, seed=seed)
    if protocol == "grpc":
        module, client = grpcclient, grpcclient.InferenceServerClient(server.grpc_url)
    else:
        module, client = httpclient, httpclient.InferenceServerClient(server.http_url, network_timeout=30)
    with client:
        while not stop.is_set():
            request = rng.choice(pool)
            bad = rng.random() < bad_fraction
            try:
                version, embedding_version = _send(
                    module, client, spec, malformed(spec, request) if bad else request
                )
                counts.record(bad, None, version, embedding_version)
            except InferenceServerException as exc:
                counts.record(bad, exc)
            stop.wait(pause_s)


def scratch_repository(source: Path, target: Path) -> Path:
    """A private copy of a built repository that updates may change."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def closed_loop(
    client: grpcclient.InferenceServerClient, model: str, requests: list[dict[str, np.ndarray]], count: int
) -> np.ndarray:
    """Milliseconds of ``count`` requests (cycling through ``requests``) sent one after another."""
    return interleaved(client, [model], requests, count)[model]


def interleaved(
    client: grpcclient.InferenceServerClient,
    models: list[str],
    requests: list[dict[str, np.ndarray]],
    count: int,
) -> dict[str, np.ndarray]:
    """Milliseconds of ``count`` requests to each model, one in flight, the models taking turns.

    Request by request, each turn starting one model further on, so that no model gains or loses
    from its place in the order: the machine's slow spells and whatever one model's stubs leave
    running fall on all of them alike.
    """
    latencies = {model: np.empty(count) for model in models}
    for i in range(count):
        inputs = infer_inputs(grpcclient, requests[i % len(requests)])
        turn = i % len(models)
        for model in (*models[turn:], *models[:turn]):
            started = time.perf_counter()
            client.infer(model, inputs)
            latencies[model][i] = time.perf_counter() - started
    return {model: values * 1e3 for model, values in latencies.items()}
