"""What ``recserve bench-longseq`` reports: ``summary.json`` and the table it prints."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from recserve.core.spec.model import ModelSpec

#: The summary's ratios (of the highest load point), medians of the per-round ratios.
RATIO_KEYS = (
    "longseq_p99_ratio",
    "longseq_aa_p99_ratio",
    "longseq_throughput_ratio",
    "longseq_aa_throughput_ratio",
)


def hit_rate(outcomes: dict[str, float]) -> float | None:
    """The share of ``hit`` among a server's state outcomes (None: none counted)."""
    total = sum(outcomes.values())
    return outcomes.get("hit", 0.0) / total if total else None


def summary(results: dict[str, Any], grid: Any, base: ModelSpec, seconds: float) -> dict[str, Any]:
    """``summary.json``: the highest load point's ratios, every point, the outcomes, builder and error.

    ``grid``: the run's ``LongseqGrid``; ``seconds``: the run's length.
    """
    last = results["points"][-1]
    error = results["error"]
    met = [p["targets_met"] for p in results["points"]]
    return {
        **{k: last[k] for k in RATIO_KEYS},
        "longseq_exact_max_abs": error["longseq_exact_max_abs"],
        "longseq_targets_met": None if None in met else all(met),
        "longseq_hit_rate": {name: hit_rate(o) for name, o in results["outcomes"].items()},
        "longseq_builder_lag_p50_s": (results["builder"] or {}).get("lag_p50_s"),
        "longseq_builder_lag_p99_s": (results["builder"] or {}).get("lag_p99_s"),
        # users rebuilt per second of the builder's own work (it is paused between its phases)
        "longseq_builder_users_per_s": (results["builder"] or {})
        .get("report", {})
        .get("rebuilds_per_busy_s"),
        "clustered_error": error["clustered"],
        "error": error,
        "points": results["points"],
        "outcomes": results["outcomes"],
        "builder": results["builder"],
        "notes": results["notes"],
        "run": {
            "spec": base.name,
            "grid": asdict(grid),
            "seconds": round(seconds, 1),
            "cpus": len(os.sched_getaffinity(0)),
            "load_average_at_end": os.getloadavg(),
        },
    }


def describe_point(point: dict[str, Any]) -> str:
    """One line per load point: each workload's p99 and rows/s."""
    parts = []
    for name, w in point["workloads"].items():
        p99 = w["p99_ms"]
        parts.append(
            f"{name} p99 {'n/a' if p99 is None else f'{p99:.1f}'} ms {w['rows_per_s'] or 0:.0f} rows/s"
        )
    return "; ".join(parts)


def _figure(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def describe(summary: dict[str, Any]) -> str:
    """A table per load point, the ratios, the hit rate, the builder's lag and the measured error."""
    lines = []
    for point in summary["points"]:
        lines += [
            f"offered {point['rate']:g} requests/s ({point['offered_rows_per_s']:g} rows/s):",
            "| workload | p50 ms | p99 ms | rows/s | request bytes | failed |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, w in point["workloads"].items():
            figures = [_figure(w[k], d) for k, d in (("p50_ms", 1), ("p99_ms", 1), ("rows_per_s", 0))]
            figures += [_figure(w["request_bytes"], 0), _figure(w["failed"], 0)]
            lines.append(f"| {name} | {' | '.join(figures)} |")
    ratios = ", ".join(f"{key} {_figure(summary[key])}" for key in RATIO_KEYS)
    lines.append(f"{ratios}; targets met: {summary['longseq_targets_met']}")
    lag = [_figure(summary[f"longseq_builder_lag_{q}_s"], 3) for q in ("p50", "p99")]
    lines.append(f"hit rate {summary['longseq_hit_rate']}; builder lag p50 {lag[0]} s, p99 {lag[1]} s")
    c = summary["clustered_error"]
    spread = {
        name: " ".join(f"{q} {c[name][q]:.4f}" for q in ("p50", "p99", "max"))
        for name in ("state_vs_full", "truncated_vs_full")
    }
    auc = ", ".join(f"{name} {_figure(value, 4)}" for name, value in c["auc"].items())
    lines += [
        f"exact mode: max |dp| against the full-length attention {summary['longseq_exact_max_abs']:.1e}",
        f"clustered ({c['clustered_share']:.0%} of {c['users']} held-out users): |dp| against the full "
        f"length {spread['state_vs_full']}; truncation to 256: {spread['truncated_vs_full']}; AUC {auc}",
    ]
    return "\n".join(lines)
