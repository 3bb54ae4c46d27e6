"""``recserve lab overload --access``: the open-loop spike of :mod:`recserve.perf.lab.overload`, via Envoy.

The access layer starts over the repository (Triton's queues as ``[access] queue_policy`` says,
``unbounded`` by default); capacity is measured closed-loop through the proxy with ``max_requests``
in flight, the most it admits, so that "2x" means twice what the access layer can serve whatever
the machine's mood; then the three open-loop phases (half capacity, the spike, half capacity) go to
the proxy's gRPC port. The proxy admits at most
``max_requests`` in flight and refuses the rest at once with UNAVAILABLE. The JSON summary holds the
two verdicts, ``served_p99_ratio`` and ``shed_p99_ms``, with the phases, the cap, the cores and the
load average.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from recserve.access import AccessLayer, ProxyPorts, behind_proxy
from recserve.build.synthetic import generate
from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.traffic import scratch_repository
from recserve.perf.lab.overload import Cores, OverloadReport, measure_capacity, pinned, run_overload


def run_access_overload(
    spec: ModelSpec,
    repository: Path,
    workdir: Path,
    rows: int = 8,
    spike_factor: float = 2.0,
    seconds: float = 5.0,
    recovery_window_s: float = 10.0,
    max_requests: int | None = None,
    cores: Cores | None = None,
    proxy_with_client: bool = False,
    proxy_priority: int = -10,
) -> tuple[OverloadReport, dict[str, object]]:
    """Measure capacity, then the spike, both through the proxy; the report and its summary.

    ``max_requests`` None: the spec's ``[access] max_requests``. Envoy runs on the server's cores
    (the load generator alone on the others), or with ``proxy_with_client`` on the generator's, at
    ``proxy_priority`` (a niceness increment: by default ahead of the servers on the shared core, so
    that a refusal does not wait behind a step's execution; skipped without the privilege).
    """
    cores = cores or Cores.split()
    access = spec.access
    if max_requests is not None:
        access = dataclasses.replace(access, max_requests=max_requests)
    access = dataclasses.replace(access, weights={"stable": 100}, shadow_fraction=0.0)
    root = scratch_repository(repository, workdir / "repository")
    proxy_cores = cores.client if proxy_with_client else cores.server
    served, config_name = behind_proxy(
        {"stable": root}, access.queue_policy, spec.serving.queue_policies, workdir
    )
    layer = AccessLayer(
        access,
        served,
        workdir / "access",
        ports=ProxyPorts.free(),
        config_name=config_name,
        server_cpus=cores.server,
        proxy_cpus=proxy_cores,
        proxy_priority=proxy_priority,
    )
    with layer:
        with pinned(cores.client):
            request = generate(spec, rows, seed=5).to_wire(spec)
            capacity = measure_capacity(layer.grpc_url, spec, request, concurrency=access.max_requests)
        report = run_overload(
            layer.servers["stable"][0],
            spec,
            rows,
            spike_factor,
            seconds,
            recovery_window_s,
            client_cores=cores.client,
            capacity_rps=capacity,
            url=layer.grpc_url,
        )
        overflow = layer.admin.cluster_stat("stable", "grpc", "upstream_rq_active_overflow")
    label = f"{access.queue_policy} behind Envoy, max_requests {access.max_requests}"
    report = dataclasses.replace(report, queue=label)
    summary = {
        **report.summary(),
        "queue": access.queue_policy,
        "access": {
            "max_requests": access.max_requests,
            "proxy_refused": overflow,
            "proxy_cores": sorted(proxy_cores) if proxy_cores else None,
            "proxy_priority": proxy_priority,
        },
        "rows": rows,
        "spike_factor": spike_factor,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    return report, summary


def access_overload_command(
    spec: ModelSpec,
    repository: Path,
    rows: int,
    spike_factor: float,
    seconds: float,
    json_path: Path | None = None,
    max_requests: int | None = None,
) -> int:
    """``recserve lab overload --access``: prints the tables, writes the JSON summary; 1 on other failures."""
    with tempfile.TemporaryDirectory(prefix="recserve-overload-access-") as scratch:
        report, summary = run_access_overload(
            spec, repository, Path(scratch), rows, spike_factor, seconds, max_requests=max_requests
        )
    print(report.table())
    print(json.dumps({k: summary[k] for k in ("served_p99_ratio", "shed_p99_ms", "failed", "access")}))
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if not report.failures else 1
