"""``recserve lab stages``: where one request's time goes, stage by stage, at batch 1 and 64.

One tritonserver serves the repository; requests of each size are sent one in flight from one gRPC
client, and Triton's statistics give each step's queue and compute (input, infer, output) per
request. The same code is then timed in process on the same rows, stage by stage (thread CPU time):
the client's encoding of the request, the feature transform, the store's lookup and the dense
forward (ONNX Runtime, the served bucket). A step's compute minus its in-process stages is its
hand-off: the Python backend's copies and wake-ups and the adapter's own work. What the steps do not
account for (gRPC, the ensemble's scheduling, the client's decoding) is the rest of the mean
latency (Triton's statistics are means).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import tritonclient.grpc as grpcclient

from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.core.names import DENSE, EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.stats import difference, snapshot
from recserve.perf.harness.traffic import closed_loop, infer_inputs
from recserve.server import Ports, TritonServer

MODEL = "ctr"
STEPS = (EMBEDDING_LOOKUP, DENSE)


def thread_us(call: Callable[[int], object], items: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the median thread CPU µs of ``call(i)`` for each of ``items``."""
    medians = []
    for _ in range(rounds):
        times = []
        for i in range(items):
            started = time.thread_time_ns()
            call(i)
            times.append(time.thread_time_ns() - started)
        medians.append(float(np.median(times)) / 1e3)
    return float(np.median(medians))


def in_process(spec: ModelSpec, repository: Path, pool: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """µs per request of each stage, in process, on the requests of ``pool``."""
    pipeline = reference_pipeline(spec, repository, "onnx")
    step = pipeline.embeddings
    features = [step.transform.transform(w) for w in pool]
    looked = [cast("dict[str, np.ndarray]", step(w)) for w in pool]  # on the host: the CPU path
    for i in range(len(pool)):  # warm: first calls allocate
        pipeline.predict(pool[i])
    n = len(pool)
    return {
        "client_encode": thread_us(lambda i: infer_inputs(grpcclient, pool[i]), n),
        "transform": thread_us(lambda i: step.transform.transform(pool[i]), n),
        "store_lookup": thread_us(lambda i: step.lookup.lookup(features[i]), n),
        "dense_forward": thread_us(lambda i: pipeline.dense(looked[i]), n),
    }


def served(server: TritonServer, pool: list[dict[str, np.ndarray]], requests: int) -> dict[str, Any]:
    """The pool's requests one in flight: the p50, the mean and each step's µs per request."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        closed_loop(client, MODEL, pool, 50)  # warm-up
        before = snapshot(server.http_url)
        latencies = closed_loop(client, MODEL, pool, requests) / 1e3  # seconds
        steps = difference(before, snapshot(server.http_url), STEPS)
    return {
        "p50_us": float(np.percentile(latencies, 50)) * 1e6,
        "mean_us": float(np.mean(latencies)) * 1e6,
        "steps": {
            s.model: {
                "queue": s.queue_us,
                "input": s.compute_input_us,
                "infer": s.compute_infer_us,
                "output": s.compute_output_us,
            }
            for s in steps
        },
    }


def budget(spec: ModelSpec, repository: Path, scratch: Path, batches: tuple[int, ...], requests: int) -> dict:
    """The stage budget at each batch size: served figures, in-process stages, hand-offs and the rest."""
    rows = generate(spec, 64 * max(batches), seed=5)
    pools = {b: [rows.take(slice(i * b, (i + 1) * b)).to_wire(spec) for i in range(64)] for b in batches}
    with TritonServer(repository, Ports.free(), log_path=scratch / "server.log") as server:
        measured = {b: served(server, pools[b], requests) for b in batches}
    result = {}
    for b in batches:
        stages = in_process(spec, repository, pools[b])
        steps = measured[b]["steps"]
        lookup, dense = steps[EMBEDDING_LOOKUP], steps[DENSE]
        accounted = sum(v for s in steps.values() for v in s.values())
        result[b] = {
            **{f"{k}_us": v for k, v in stages.items()},
            "p50_us": measured[b]["p50_us"],
            "steps_us": steps,
            "lookup_handoff_us": lookup["input"]
            + lookup["infer"]
            + lookup["output"]
            - stages["transform"]
            - stages["store_lookup"],
            "dense_handoff_us": dense["input"] + dense["infer"] + dense["output"] - stages["dense_forward"],
            "mean_us": measured[b]["mean_us"],
            # Triton's figures are means: the rest is taken from the mean, not the p50
            "rest_us": measured[b]["mean_us"] - accounted - stages["client_encode"],
        }
    return result


def format_budget(result: dict) -> str:
    """The budget as a table, one column per batch size."""
    batches = list(result)
    rows = [
        ("client encode", lambda r: r["client_encode_us"]),
        ("lookup queue", lambda r: r["steps_us"][EMBEDDING_LOOKUP]["queue"]),
        ("lookup: transform (in process)", lambda r: r["transform_us"]),
        ("lookup: store (in process)", lambda r: r["store_lookup_us"]),
        ("lookup: hand-off and adapter", lambda r: r["lookup_handoff_us"]),
        ("dense queue", lambda r: r["steps_us"][DENSE]["queue"]),
        ("dense: forward (in process)", lambda r: r["dense_forward_us"]),
        ("dense: hand-off and adapter", lambda r: r["dense_handoff_us"]),
        ("rest: gRPC, ensemble, client decode", lambda r: r["rest_us"]),
        ("served mean", lambda r: r["mean_us"]),
        ("served p50", lambda r: r["p50_us"]),
    ]
    lines = [f"{'stage (µs per request)':38s}" + "".join(f"{f'batch {b}':>12s}" for b in batches)]
    for name, pick in rows:
        lines.append(f"{name:38s}" + "".join(f"{pick(result[b]):12.0f}" for b in batches))
    return "\n".join(lines)


def stages_command(
    spec: ModelSpec, repository: Path, scratch: Path, requests: int, output: Path | None
) -> int:
    """CLI body of ``recserve lab stages``."""
    result = budget(spec, repository, scratch, (1, 64), requests)
    print(format_budget(result))
    if output is not None:
        output.write_text(json.dumps(result, indent=2) + "\n")
    return 0
