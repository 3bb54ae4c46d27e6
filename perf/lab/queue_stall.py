"""``recserve lab queue-stall``: the served configs against the spec's queue policies, closed loop.

With any queue policy tritonserver's dynamic batcher forms a batch only while an instance waits for
one, and can miss an instance's return and sleep up to 500 ms (docs/design/serving.md#queue-policies).
This measures how often that happens where it hurts most: batch-1 clients, all of them waiting. One
server per configuration (``config.pbtxt``, then each named profile), started side by side on free
loopback ports; rounds of closed-loop HTTP load against each in turn, each round starting one
configuration further on. Per round and configuration: rows/s, p50, p99, max and the requests over
:data:`~recserve.perf.harness.loadgen.STALL_MS`.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.loadgen import STALL_MS, run_load, sample_batches, triton_target
from recserve.server import Ports, TritonServer

SERVED = "served"  # the configuration name of the repository's own config.pbtxt


def run_queue_stall(
    spec: ModelSpec,
    repository: Path,
    policies: tuple[str, ...],
    concurrency: int,
    seconds: float,
    rounds: int,
    logs: Path,
) -> dict[str, Any]:
    """Rounds of batch-1 closed-loop load against the served configs and each profile, in turns."""
    unknown = sorted(set(policies) - set(spec.serving.queue_policies))
    if unknown:
        raise ValueError(
            f"unknown queue policy(s) {unknown}; the spec has {sorted(spec.serving.queue_policies)}"
        )
    names = (SERVED, *policies)
    batches = sample_batches(spec, 1, count=64)
    rounds_seen: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(
                TritonServer(
                    repository,
                    Ports.free(),
                    log_path=logs / f"{name}.log",
                    config_name=None if name == SERVED else name,
                )
            )
            for name in names
        }
        targets = {name: triton_target(server.http_url, spec, batches) for name, server in servers.items()}
        for index in range(rounds):
            turn = index % len(names)
            for name in (*names[turn:], *names[:turn]):
                result = run_load(targets[name], concurrency, seconds=seconds, warmup_s=0.5)
                rounds_seen.append({"round": index, "configuration": name, **vars(result)})
    return summarize(rounds_seen, names)


def summarize(rounds: list[dict[str, Any]], names: tuple[str, ...]) -> dict[str, Any]:
    """Per configuration: rounds with a stall, stalled requests, median rows/s and p99 over rounds."""
    totals = {}
    for name in names:
        mine = [r for r in rounds if r["configuration"] == name]
        totals[name] = {
            "rounds": len(mine),
            "rounds_with_a_stall": sum(r["stalled"] > 0 for r in mine),
            "stalled_requests": sum(r["stalled"] for r in mine),
            "median_rows_per_s": float(np.median([r["rows_per_s"] for r in mine])),
            "median_p99_ms": float(np.median([r["p99_ms"] for r in mine])),
            "failures": sum(r["failures"] for r in mine),
        }
    return {"stall_ms": STALL_MS, "rounds": rounds, "configurations": totals}


def format_report(summary: dict[str, Any]) -> str:
    """One line per round and configuration, then the totals."""
    header = ("round", "configuration", "rows/s", "p50 ms", "p99 ms", "max ms", "stalled")
    lines = ["{:>5} {:<18} {:>8} {:>8} {:>8} {:>8} {:>7}".format(*header)]
    for r in summary["rounds"]:
        lines.append(
            f"{r['round']:>5} {r['configuration']:<18} {r['rows_per_s']:>8.0f} {r['p50_ms']:>8.1f} "
            f"{r['p99_ms']:>8.1f} {r['max_ms']:>8.0f} {r['stalled']:>7}"
        )
    lines.append(f"requests over {summary['stall_ms']:.0f} ms count as stalled")
    for name, t in summary["configurations"].items():
        lines.append(
            f"{name:<18} {t['rounds_with_a_stall']} of {t['rounds']} rounds stalled "
            f"({t['stalled_requests']} requests), median {t['median_rows_per_s']:.0f} rows/s, "
            f"p99 {t['median_p99_ms']:.1f} ms, {t['failures']} failed"
        )
    return "\n".join(lines)


def queue_stall_command(
    spec: ModelSpec,
    repository: Path,
    policies: tuple[str, ...],
    concurrency: int,
    seconds: float,
    rounds: int,
    output: Path | None,
) -> int:
    """Print the report; write the summary as JSON to ``output`` if given."""
    with tempfile.TemporaryDirectory(prefix="recserve-queues-") as scratch:
        summary = run_queue_stall(spec, repository, policies, concurrency, seconds, rounds, Path(scratch))
    print(format_report(summary))
    if output is not None:
        output.write_text(json.dumps(summary, indent=2) + "\n")
    return 0
