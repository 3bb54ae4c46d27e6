"""What the access layer adds to a request: the same requests direct to tritonserver and through Envoy.

``python -m recserve.perf.lab.access_latency`` starts the access layer over the built repository (one
``stable`` server, Triton's queues as ``[access] queue_policy`` says, an in-flight cap high enough
that one client is never refused) and sends closed-loop gRPC requests, one in flight, at each batch
size, to the server's own port and to the proxy's port in turns (``rounds`` rounds of ``requests``
each). It prints one JSON line per batch size: the median over rounds of p50 and p99 for both paths
and their difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from recserve.access import AccessLayer, ProxyPorts, behind_proxy
from recserve.build.synthetic import generate
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from recserve.core.spec.types import DEFAULT_REPOSITORY
from recserve.perf.harness.traffic import closed_loop


def run(
    spec: ModelSpec, repository: Path, workdir: Path, batch_sizes: tuple[int, ...], requests: int, rounds: int
) -> list[dict[str, float]]:
    """Direct and proxied p50/p99 per batch size (medians over rounds)."""
    access = dataclasses.replace(spec.access, weights={"stable": 100}, shadow_fraction=0.0, max_requests=64)
    served, config_name = behind_proxy(
        {"stable": repository}, access.queue_policy, spec.serving.queue_policies, workdir
    )
    results = []
    with AccessLayer(access, served, workdir / "access", ProxyPorts.free(), config_name) as layer:
        direct = layer.servers["stable"][0].grpc_url
        for batch in batch_sizes:
            rows = generate(spec, batch * 16, seed=batch)
            pool = [rows.take(slice(i * batch, (i + 1) * batch)).to_wire(spec) for i in range(16)]
            clients = {
                "direct": grpcclient.InferenceServerClient(direct),
                "proxy": grpcclient.InferenceServerClient(layer.grpc_url),
            }
            for client in clients.values():  # warm-up
                closed_loop(client, spec.name, pool, 20)
            figures: dict[str, list[float]] = {
                "direct_p50": [],
                "direct_p99": [],
                "proxy_p50": [],
                "proxy_p99": [],
            }
            for _ in range(rounds):
                for path, client in clients.items():
                    p50, p99 = np.percentile(closed_loop(client, spec.name, pool, requests), [50, 99])
                    figures[f"{path}_p50"].append(float(p50))
                    figures[f"{path}_p99"].append(float(p99))
            for client in clients.values():
                client.close()
            medians = {key: float(np.median(values)) for key, values in figures.items()}
            results.append(
                {
                    "batch_size": batch,
                    **medians,
                    "added_p50_ms": medians["proxy_p50"] - medians["direct_p50"],
                    "added_p99_ms": medians["proxy_p99"] - medians["direct_p99"],
                }
            )
    return results


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per batch size."""
    parser = argparse.ArgumentParser(prog="python -m recserve.perf.lab.access_latency", description=__doc__)
    parser.add_argument("--spec", default="ctr")
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batch_sizes.split(","))
    with tempfile.TemporaryDirectory(prefix="recserve-access-latency-") as workdir:
        for result in run(
            load_spec(args.spec), args.repository, Path(workdir), batches, args.requests, args.rounds
        ):
            print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
