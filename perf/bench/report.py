"""Benchmark points, best-point selection under a p99 bound, headline ratios, files and plots.

Pure functions over :class:`Point` lists: ``recserve bench`` measures, this module decides and writes.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

LOGGER = logging.getLogger(__name__)

P99_BOUND_MS = 50.0

# configuration names
INPROCESS = "inprocess"
NAIVE = "triton-naive"
TUNED = "triton-tuned"
TORCHSERVE = "torchserve"
MONOLITH = "monolith"  # one Python-backend model for the whole path; systems "monolith-<instances>"

# load generators
PERF_ANALYZER = "perf_analyzer"
HTTP_LOADGEN = "http-loadgen"
DIRECT = "direct-call"
SDK = "sdk"

#: Targets of the headline ratios: (comparison, value).
TARGETS = {
    "ensemble_vs_inprocess": (">=", 0.8),
    "dynamic_batching_gain": (">=", 3.0),
    "vs_torchserve_throughput": (">=", 3.0),
    "vs_torchserve_p99": ("<=", 1.0),
    "vs_monolith_throughput": (">=", 1.0),
    "hop_floor_ratio": ("<=", 1.3),
    "candidate_list_gain": (">=", 3.0),
    "ids_vs_bytes": (">=", 1.0),
}


@dataclass(frozen=True)
class Point:
    """One measured load point of one configuration."""

    system: str  # INPROCESS, NAIVE, TUNED, TORCHSERVE, MONOLITH-<instances>
    generator: str  # PERF_ANALYZER, HTTP_LOADGEN, DIRECT
    protocol: str  # grpc, http, none
    client_batch: int
    concurrency: int
    rows_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    shared_memory: str = "none"
    failures: int = 0
    steps: tuple[dict[str, Any], ...] = field(default=(), compare=False)

    @property
    def configuration(self) -> str:
        """Name of the curve this point belongs to, e.g. ``triton-tuned grpc perf_analyzer``."""
        name = f"{self.system} {self.protocol} {self.generator}" if self.protocol != "none" else self.system
        return name + (f" shm={self.shared_memory}" if self.shared_memory != "none" else "")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict, with the configuration name."""
        return {**asdict(self), "steps": list(self.steps), "configuration": self.configuration}


CSV_FIELDS = [f.name for f in fields(Point) if f.name != "steps"]


def select(points: Iterable[Point], **match: Any) -> list[Point]:
    """Points whose attributes equal every ``match`` item."""
    return [p for p in points if all(getattr(p, k) == v for k, v in match.items())]


def best_under(points: Iterable[Point], p99_bound_ms: float = P99_BOUND_MS) -> Point | None:
    """The highest-throughput point whose p99 stays within the bound (and without failures)."""
    eligible = [p for p in points if p.p99_ms <= p99_bound_ms and p.failures == 0 and math.isfinite(p.p99_ms)]
    return max(eligible, key=lambda p: p.rows_per_s, default=None)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or not (math.isfinite(a) and math.isfinite(b)):
        return None  # not measured, or not measurable (an unstable point)
    return a / b


def _rows_per_s(point: Point | None) -> float | None:
    return None if point is None else point.rows_per_s


def _p99(point: Point | None) -> float | None:
    return None if point is None else point.p99_ms


def _brief(point: Point | None) -> dict[str, Any] | None:
    if point is None:
        return None
    keys = ("configuration", "client_batch", "concurrency", "rows_per_s", "p50_ms", "p99_ms")
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v  # an unstable point: no figure
        for k, v in point.as_dict().items()
        if k in keys
    }


def summarize(
    points: Sequence[Point],
    p99_bound_ms: float = P99_BOUND_MS,
    hops: dict[str, Any] | None = None,
    candidates: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The headline ratios, the points they were read from, and whether each target is met.

    * ``ensemble_vs_inprocess``: the tuned ensemble's best rows/s (perf_analyzer, gRPC) over the
      in-process bound's best rows/s, both under the p99 bound.
    * ``dynamic_batching_gain``: tuned over naive rows/s with batch-1 clients and 16 in flight
      (``dynamic_batching_p99_ratio``: tuned p99 over naive p99 there; <= 1 is "no worse").
    * ``vs_torchserve_throughput``: Triton HTTP over TorchServe, best rows/s of each under the bound,
      same load generator.
    * ``vs_torchserve_p99``: Triton's p99 over TorchServe's at TorchServe's best point (same client
      batch and concurrency: the same offered load).
    * ``vs_monolith_throughput``: the tuned ensemble's best rows/s over the monolith's (its better
      instance count), both perf_analyzer gRPC under the bound; ``vs_monolith_p99``: the ensemble's
      p99 over the monolith's at the monolith's best point (same client batch and concurrency).
    * ``hop_floor_ratio``: from ``hops`` (the summary of :func:`recserve.perf.bench.hops.run_hops`), served
      p50 minus in-process p50 over the p50 of an echo ensemble of the served shape, at batch 1.
    * ``candidate_list_gain``: from ``candidates`` (:func:`recserve.perf.bench.candidates.measure`), candidate
      rows/s of one user's list over the same rows sent as rows, each at its best within the bound.
    * ``ids_vs_bytes``: from ``candidates`` too, candidate rows/s of the list in the id form of the wire
      over the same list in the bytes form, each at its best within the bound.

    When TorchServe meets the bound at no point, the bound cannot pick its point: both servers are
    then compared at TorchServe's highest-rate point (the same offered load) and
    ``torchserve_within_p99_bound`` is false.
    """
    grpc = select(points, system=TUNED, generator=PERF_ANALYZER, protocol="grpc", shared_memory="none")
    bound = best_under(select(points, system=INPROCESS), p99_bound_ms)
    served = best_under(grpc, p99_bound_ms)
    tuned_b1 = next(iter(select(grpc, client_batch=1, concurrency=16)), None)
    naive_b1 = next(
        iter(
            select(
                points, system=NAIVE, generator=PERF_ANALYZER, protocol="grpc", client_batch=1, concurrency=16
            )
        ),
        None,
    )
    triton_http = select(points, system=TUNED, generator=HTTP_LOADGEN)
    torchserve_points = select(points, system=TORCHSERVE, generator=HTTP_LOADGEN)
    torchserve = best_under(torchserve_points, p99_bound_ms)
    torchserve_within_bound = torchserve is not None
    if torchserve is None:  # never within the bound: compare with its best rate, whatever its p99
        torchserve = max(
            (p for p in torchserve_points if p.failures == 0), key=lambda p: p.rows_per_s, default=None
        )
    triton_best = best_under(triton_http, p99_bound_ms)
    matched = (
        next(
            iter(
                select(triton_http, client_batch=torchserve.client_batch, concurrency=torchserve.concurrency)
            ),
            None,
        )
        if torchserve
        else None
    )
    monolith = best_under(
        [p for p in points if p.system.startswith(MONOLITH) and p.generator == PERF_ANALYZER], p99_bound_ms
    )
    at_monolith = (
        next(iter(select(grpc, client_batch=monolith.client_batch, concurrency=monolith.concurrency)), None)
        if monolith
        else None
    )
    ratios = {
        "ensemble_vs_inprocess": _ratio(_rows_per_s(served), _rows_per_s(bound)),
        "dynamic_batching_gain": _ratio(_rows_per_s(tuned_b1), _rows_per_s(naive_b1)),
        "dynamic_batching_p99_ratio": _ratio(_p99(tuned_b1), _p99(naive_b1)),
        "vs_torchserve_throughput": (
            _ratio(_rows_per_s(triton_best), _rows_per_s(torchserve))
            if torchserve_within_bound
            else _ratio(_rows_per_s(matched), _rows_per_s(torchserve))
        ),
        "vs_torchserve_p99": _ratio(_p99(matched), _p99(torchserve)),
        "vs_monolith_throughput": _ratio(_rows_per_s(served), _rows_per_s(monolith)),
        "vs_monolith_p99": _ratio(_p99(at_monolith), _p99(monolith)),
        "hop_floor_ratio": hops.get("hop_floor_ratio") if hops else None,
        "candidate_list_gain": candidates.get("candidate_list_gain") if candidates else None,
        "ids_vs_bytes": candidates.get("ids_vs_bytes") if candidates else None,
    }
    targets = {}
    for name, (op, goal) in TARGETS.items():
        value = ratios[name]
        met = None if value is None else (value >= goal if op == ">=" else value <= goal)
        targets[name] = {"target": f"{op} {goal}", "value": value, "met": met}
    return {
        **ratios,
        "p99_bound_ms": p99_bound_ms,
        "torchserve_within_p99_bound": torchserve_within_bound if torchserve_points else None,
        "targets": targets,
        "points": {
            "inprocess_best": _brief(bound),
            "ensemble_best": _brief(served),
            "tuned_batch1_c16": _brief(tuned_b1),
            "naive_batch1_c16": _brief(naive_b1),
            "triton_http_best": _brief(triton_best),
            "triton_http_at_torchserve_best": _brief(matched),
            "torchserve_best": _brief(torchserve),
            "monolith_best": _brief(monolith),
            "ensemble_at_monolith_best": _brief(at_monolith),
        },
    }


def overheads(points: Sequence[Point]) -> dict[str, Any]:
    """Throughput and latency ratios at the same load with one thing changed.

    HTTP over gRPC and system shared memory over none (perf_analyzer), and the client SDK with
    system shared memory over without (one client, closed loop).
    """
    result: dict[str, Any] = {}
    grpc = {
        (p.client_batch, p.concurrency): p
        for p in select(points, system=TUNED, generator=PERF_ANALYZER, protocol="grpc", shared_memory="none")
    }
    for label, match in (
        ("http_over_grpc", {"protocol": "http", "shared_memory": "none"}),
        ("system_shm_over_grpc", {"protocol": "grpc", "shared_memory": "system"}),
    ):
        rows = []
        for p in select(points, system=TUNED, generator=PERF_ANALYZER, **match):
            base = grpc.get((p.client_batch, p.concurrency))
            if base:
                rows.append({
                    "client_batch": p.client_batch, "concurrency": p.concurrency,
                    "throughput_ratio": p.rows_per_s / base.rows_per_s,
                    "p50_ratio": p.p50_ms / base.p50_ms, "p99_ratio": p.p99_ms / base.p99_ms,
                })  # fmt: skip
        result[label] = rows
    sdk = {(p.client_batch, p.shared_memory): p for p in select(points, generator=SDK)}
    result["sdk_system_shm_over_wire"] = [
        {
            "client_batch": batch, "concurrency": 1,
            "throughput_ratio": shm.rows_per_s / wire.rows_per_s, "p50_ratio": shm.p50_ms / wire.p50_ms,
            "p99_ratio": shm.p99_ms / wire.p99_ms,
        }
        for (batch, mode), shm in sorted(sdk.items())
        if mode == "system" and (wire := sdk.get((batch, "none")))
    ]  # fmt: skip
    return result


def read_points(folder: Path) -> list[Point]:
    """The points of a results folder, as :func:`write_points` wrote them."""
    rows = json.loads((folder / "points.json").read_text())
    return [
        Point(**{**{k: v for k, v in row.items() if k != "configuration"}, "steps": tuple(row["steps"])})
        for row in rows
    ]


def write_points(points: Sequence[Point], folder: Path) -> None:
    """``points.csv`` (one row per point) and ``points.json`` (with per-step breakdowns)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "points.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["configuration", *CSV_FIELDS])
        writer.writeheader()
        for p in points:
            row = p.as_dict()
            writer.writerow({k: row[k] for k in writer.fieldnames})
    (folder / "points.json").write_text(json.dumps([p.as_dict() for p in points], indent=1))


def table(points: Sequence[Point]) -> str:
    """A short text table: every point, grouped by configuration."""
    lines = [
        f"{'configuration':<44} {'batch':>5} {'conc':>4} {'rows/s':>9} "
        f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7}"
    ]
    for p in sorted(points, key=lambda p: (p.configuration, p.client_batch, p.concurrency)):
        lines.append(
            f"{p.configuration:<44} {p.client_batch:>5} {p.concurrency:>4} {p.rows_per_s:>9.0f} "
            f"{p.p50_ms:>7.2f} {p.p95_ms:>7.2f} {p.p99_ms:>7.2f}"
            + (f"  ({p.failures} failed)" if p.failures else "")
        )
    return "\n".join(lines)


def describe_summary(summary: dict[str, Any]) -> str:
    """The headline ratios against their targets, one per line."""
    lines = ["(n/a: not measured, or no point of that configuration within the p99 bound)"]
    for name, target in summary["targets"].items():
        value = target["value"]
        shown = "n/a" if value is None else f"{value:.2f}"
        verdict = {True: "met", False: "MISSED", None: ""}[target["met"]]
        lines.append(f"{name:<26} {shown:>12}  (target {target['target']}) {verdict}")
    monolith_p99 = summary.get("vs_monolith_p99")
    if monolith_p99 is not None:
        lines.append(
            f"{'vs_monolith_p99':<26} {monolith_p99:>12.2f}  (ensemble p99 / monolith p99 at its best point)"
        )
    p99 = summary.get("dynamic_batching_p99_ratio")
    if p99 is not None:
        lines.append(
            f"{'dynamic_batching_p99_ratio':<26} {p99:>12.2f}  "
            "(tuned p99 / naive p99 at batch 1, 16 in flight)"
        )
    return "\n".join(lines)


def plot(points: Sequence[Point], folder: Path, p99_bound_ms: float = P99_BOUND_MS) -> list[Path]:
    """PNG plots of latency against throughput: one per configuration, and all of them together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    configurations = sorted({p.configuration for p in points})
    colors = {name: f"C{i % 10}" for i, name in enumerate(configurations)}  # one colour per configuration
    points = [p for p in points if math.isfinite(p.rows_per_s) and math.isfinite(p.p99_ms)]
    served = [p for p in points if p.system != INPROCESS]
    batches = sorted({p.client_batch for p in served})
    fig, axes = plt.subplots(1, max(len(batches), 1), figsize=(6 * max(len(batches), 1), 4.5), squeeze=False)
    # with no batches there is still one (empty) axis: the lengths differ then
    for ax, batch in zip(axes[0], batches, strict=False):
        for name in configurations:
            curve = sorted(
                (p for p in served if p.client_batch == batch and p.configuration == name),
                key=lambda p: p.concurrency,
            )
            if curve:
                ax.plot(
                    [p.rows_per_s for p in curve],
                    [p.p99_ms for p in curve],
                    marker="o",
                    color=colors[name],
                    label=name,
                )
        bound = best_under(select(points, system=INPROCESS), p99_bound_ms)
        if bound:
            ax.axvline(
                bound.rows_per_s,
                color="grey",
                linestyle=":",
                label=f"in-process bound (batch {bound.client_batch})",
            )
        ax.axhline(p99_bound_ms, color="red", linestyle="--", linewidth=0.8)
        ax.set(title=f"client batch {batch}", xlabel="rows/s", ylabel="p99 latency (ms)", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    overview = folder / "latency_vs_throughput.png"
    fig.savefig(overview, dpi=110)
    plt.close(fig)
    written.append(overview)
    for name in configurations:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        chosen = [p for p in points if p.configuration == name]
        for batch in sorted({p.client_batch for p in chosen}):
            curve = sorted((p for p in chosen if p.client_batch == batch), key=lambda p: p.concurrency)
            line = ax.plot(
                [p.rows_per_s for p in curve],
                [p.p99_ms for p in curve],
                marker="o",
                label=f"batch {batch} p99",
            )
            ax.plot(
                [p.rows_per_s for p in curve],
                [p.p50_ms for p in curve],
                linestyle="--",
                color=line[0].get_color(),
                label=f"batch {batch} p50",
            )
            for p in curve:
                ax.annotate(str(p.concurrency), (p.rows_per_s, p.p99_ms), fontsize=6)
        ax.axhline(p99_bound_ms, color="red", linestyle="--", linewidth=0.8)
        ax.set(title=name, xlabel="rows/s", ylabel="latency (ms)", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / f"{name.replace(' ', '_').replace('=', '-')}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
