"""Where the time goes inside the server: per-model queue and compute from Triton's statistics.

Triton keeps cumulative counters per model (``/v2/models/stats``). A snapshot before and after a
measurement gives, for every ensemble step, the mean queue and compute time per request and the
mean number of requests merged into one execution (the dynamic batch size). This works for any
load generator, not just perf_analyzer.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from dataclasses import asdict, dataclass

LOGGER = logging.getLogger(__name__)

_DURATIONS = ("queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class StepTimes:
    """Mean microseconds per request in one model, over a measurement."""

    model: str
    requests: int
    executions: int
    queue_us: float
    compute_input_us: float
    compute_infer_us: float
    compute_output_us: float
    failed: int = 0

    @property
    def compute_us(self) -> float:
        """Input + infer + output time per request."""
        return self.compute_input_us + self.compute_infer_us + self.compute_output_us

    @property
    def requests_per_execution(self) -> float:
        """Mean number of requests one execution served (dynamic batching at work when > 1)."""
        return self.requests / self.executions if self.executions else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        """Plain dict with the derived values, for JSON."""
        return {
            **asdict(self),
            "compute_us": self.compute_us,
            "requests_per_execution": self.requests_per_execution,
        }


Snapshot = dict[str, dict[str, int]]


def snapshot(http_url: str, timeout_s: float = 10.0) -> Snapshot:
    """Cumulative counters of every model.

    ``{model: {"requests", "failed", "executions", "<duration>_ns"}}``.
    """
    with urllib.request.urlopen(f"http://{http_url}/v2/models/stats", timeout=timeout_s) as response:
        document = json.load(response)
    result: Snapshot = {}
    for model in document.get("model_stats", []):
        stats = model["inference_stats"]
        entry = {
            "requests": int(stats["success"]["count"]),
            "failed": int(stats["fail"]["count"]),
            "executions": int(model.get("execution_count", 0)),
        }
        for name in _DURATIONS:
            entry[f"{name}_ns"] = int(stats[name]["ns"])
        result[model["name"]] = entry
    return result


def difference(before: Snapshot, after: Snapshot, models: tuple[str, ...]) -> list[StepTimes]:
    """Mean times per request of ``models`` between two snapshots.

    Models that neither served nor failed are left out.
    """
    steps = []
    for model in models:
        old, new = before.get(model), after.get(model)
        if old is None or new is None:
            continue
        requests = new["requests"] - old["requests"]
        failed = new["failed"] - old["failed"]
        if requests <= 0 and failed <= 0:
            continue
        requests = max(requests, 0)
        per_request = {
            name: (new[f"{name}_ns"] - old[f"{name}_ns"]) / max(requests, 1) / 1e3 for name in _DURATIONS
        }
        steps.append(
            StepTimes(
                model=model,
                requests=requests,
                executions=new["executions"] - old["executions"],
                queue_us=per_request["queue"],
                compute_input_us=per_request["compute_input"],
                compute_infer_us=per_request["compute_infer"],
                compute_output_us=per_request["compute_output"],
                failed=failed,
            )
        )
    return steps


def describe(steps: list[StepTimes]) -> str:
    """One line per step: queue, compute and requests per execution."""
    return "\n".join(
        f"  {s.model:<18} queue {s.queue_us / 1e3:7.2f} ms  compute {s.compute_us / 1e3:7.2f} ms "
        f"(in {s.compute_input_us / 1e3:.2f}, infer {s.compute_infer_us / 1e3:.2f}, "
        f"out {s.compute_output_us / 1e3:.2f})"
        f"  {s.requests_per_execution:5.1f} requests/execution"
        for s in steps
    )
