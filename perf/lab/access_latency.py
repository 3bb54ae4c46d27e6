"""What the access layer adds to a request: the same requests direct to tritonserver and through Envoy.

``python -m recserve.perf.lab.access_latency`` starts the access layer over the built repository (one
``stable`` server, Triton's queues as ``[access] queue_policy`` says, an in-flight cap high enough
that one client is never refused) and a second Envoy beside it with the same config but for the
front door's body scan (its Lua filter; the body limit and the header limit stay), on ports of its
own and in front of the same server. It sends closed-loop gRPC requests, one in flight, at each
batch size, to the server's own port, to the proxy and to the proxy without the scan in turns
(``rounds`` rounds of ``requests`` each). It prints one JSON line per batch size: the median over
rounds of p50 and p99 for each path, what the proxy adds, and what the scan adds to that.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from recserve.access import AccessLayer, ProxyPorts, behind_proxy
from recserve.access.config import cluster_name, write_config
from recserve.access.envoy import EnvoyProxy
from recserve.build.synthetic import generate
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from recserve.core.spec.types import DEFAULT_REPOSITORY
from recserve.perf.harness.traffic import closed_loop

#: The front door's body scan in an Envoy config (the Lua HTTP filter).
SCAN_FILTER = "envoy.filters.http.lua"


def without_scan(config: dict[str, Any], ports: ProxyPorts) -> dict[str, Any]:
    """``config`` on ``ports`` with the front door's scan taken out of every listener."""
    out = copy.deepcopy(config)
    for listener in out["static_resources"]["listeners"]:
        port = ports.grpc if listener["name"].endswith("grpc") else ports.http
        listener["address"]["socket_address"]["port_value"] = port
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                manager = network_filter["typed_config"]
                manager["http_filters"] = [f for f in manager["http_filters"] if f["name"] != SCAN_FILTER]
    out["admin"]["address"]["socket_address"]["port_value"] = ports.admin
    return out


def run(
    spec: ModelSpec, repository: Path, workdir: Path, batch_sizes: tuple[int, ...], requests: int, rounds: int
) -> list[dict[str, float]]:
    """Direct, proxied and proxied-without-the-scan p50/p99 per batch size (medians over rounds)."""
    access = dataclasses.replace(spec.access, weights={"stable": 100}, shadow_fraction=0.0, max_requests=64)
    served, config_name = behind_proxy(
        {"stable": repository}, access.queue_policy, spec.serving.queue_policies, workdir
    )
    results = []
    with AccessLayer(access, served, workdir / "access", ProxyPorts.free(), config_name) as layer:
        ports = ProxyPorts.free()
        unscanned = EnvoyProxy(
            write_config(without_scan(layer.config(), ports), workdir / "envoy-without-scan.json"),
            f"127.0.0.1:{ports.admin}",
            workdir / "envoy-without-scan.log",
            access.workers,
        ).start()
        try:
            unscanned.wait_healthy([cluster_name("stable", p) for p in ("grpc", "http")])
            paths = {
                "direct": layer.servers["stable"][0].grpc_url,
                "proxy": layer.grpc_url,
                "unscanned": f"127.0.0.1:{ports.grpc}",
            }
            for batch in batch_sizes:
                results.append(_batch(spec, paths, batch, requests, rounds))
        finally:
            unscanned.stop()
    return results


def _batch(
    spec: ModelSpec, paths: dict[str, str], batch: int, requests: int, rounds: int
) -> dict[str, float]:
    """One batch size's medians over rounds, each round the paths in turn."""
    rows = generate(spec, batch * 16, seed=batch)
    pool = [rows.take(slice(i * batch, (i + 1) * batch)).to_wire(spec) for i in range(16)]
    clients = {path: grpcclient.InferenceServerClient(url) for path, url in paths.items()}
    for client in clients.values():  # warm-up
        closed_loop(client, spec.name, pool, 20)
    figures: dict[str, list[float]] = {f"{path}_{q}": [] for path in clients for q in ("p50", "p99")}
    for _ in range(rounds):
        for path, client in clients.items():
            p50, p99 = np.percentile(closed_loop(client, spec.name, pool, requests), [50, 99])
            figures[f"{path}_p50"].append(float(p50))
            figures[f"{path}_p99"].append(float(p99))
    for client in clients.values():
        client.close()
    medians = {key: float(np.median(values)) for key, values in figures.items()}
    return {
        "batch_size": batch,
        **medians,
        "added_p50_ms": medians["proxy_p50"] - medians["direct_p50"],
        "added_p99_ms": medians["proxy_p99"] - medians["direct_p99"],
        "scan_p50_ms": medians["proxy_p50"] - medians["unscanned_p50"],
        "scan_p99_ms": medians["proxy_p99"] - medians["unscanned_p99"],
    }


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
