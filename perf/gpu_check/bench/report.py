"""The bench's figures for ``summary.json`` and its tables for ``summary.md`` (standard library only).

``gpu_bound_rows_per_s``: the in-process bound at its best batch. ``gpu_served_rows_per_s``: the
best served point in the id form (lists or rows) with p99 within :data:`~.common.P99_BOUND_MS` and
no refusal. ``gpu_served_vs_bound``: their ratio, both measured on the same card in the same call.
Every key is present in every summary (None where the step did not measure it), so a dry run checks
the same keys a GPU run fills.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..common import BENCH_PART, P99_BOUND_MS, SERVED_VS_BOUND_TARGET, TARGETS
from ..context import StepResult

FIGURES = (
    "gpu_device",
    "gpu_bound_rows_per_s",
    "gpu_bound_best",
    "gpu_served_rows_per_s",
    "gpu_served_best",
    "gpu_served_vs_bound",
    "gpu_served_bytes_rows_per_s",
    "gpu_ids_vs_bytes",
    "gpu_parity",
    "gpu_step_times",
    "gpu_bytes_per_row",
    "gpu_targets",
)


def served_points(results: Sequence[StepResult]) -> list[dict[str, Any]]:
    """Every measured served point of the bench's steps."""
    return [
        point
        for r in results
        if r.part == BENCH_PART and r.name != "bench-bound"
        for point in r.data.get("points", ())
        if "rows_per_s" in point
    ]


def best_within(
    points: Sequence[dict[str, Any]], p99_ms: float = P99_BOUND_MS, **match: Any
) -> dict[str, Any] | None:
    """The point with the most rows/s among those matching, with no refusal and p99 within ``p99_ms``."""
    within = [
        p
        for p in points
        if p["p99_ms"] <= p99_ms and not p["failures"] and all(p.get(k) == v for k, v in match.items())
    ]
    return max(within, key=lambda p: p["rows_per_s"], default=None)


def ratio(a: float | None, b: float | None) -> float | None:
    """The ratio of ``a`` to ``b``; None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def bench_figures(results: Sequence[StepResult]) -> dict[str, Any]:
    """The summary's bench keys from the steps' data."""
    by_name = {r.name: r for r in results}
    bound = by_name["bench-bound"].data if "bench-bound" in by_name else {}
    points = served_points(results)
    served = best_within(points, form="ids")
    served_bytes = best_within(points, form="bytes")
    bound_rate = bound.get("rows_per_s")
    served_rate = served["rows_per_s"] if served else None
    targets = []
    for key, what, candidates, p99_ms, least in TARGETS:
        best = best_within(points, p99_ms, form="ids", shape="list", candidates=candidates)
        measured = best["rows_per_s"] if best else None
        targets.append(
            {
                "key": key,
                "what": what,
                "target": least,
                "measured": measured,
                "met": bool(measured and measured >= least),
            }
        )
    vs_bound = ratio(served_rate, bound_rate)
    targets.append(
        {
            "key": "served_vs_bound",
            "what": "gpu_served_vs_bound",
            "target": SERVED_VS_BOUND_TARGET,
            "measured": vs_bound,
            "met": bool(vs_bound and vs_bound >= SERVED_VS_BOUND_TARGET),
        }
    )
    same_bytes = served_bytes and best_within(
        points, form="ids", shape=served_bytes["shape"], candidates=served_bytes["candidates"]
    )
    best_bound = bound.get("best") or {}
    serve = by_name["bench-serve"].data if "bench-serve" in by_name else {}
    return {
        "gpu_device": bound.get("gpu") or bound.get("device"),
        "gpu_bound_rows_per_s": bound_rate,
        "gpu_bound_best": best_bound or None,
        "gpu_served_rows_per_s": served_rate,
        "gpu_served_best": served,
        "gpu_served_vs_bound": vs_bound,
        "gpu_served_bytes_rows_per_s": served_bytes["rows_per_s"] if served_bytes else None,
        # the id form over the BYTES form, same shape and list length, each at its best within the bound
        "gpu_ids_vs_bytes": ratio(same_bytes["rows_per_s"], served_bytes["rows_per_s"])
        if same_bytes and served_bytes
        else None,
        "gpu_parity": {"served": serve.get("parity"), "bound": bound.get("parity")},
        "gpu_step_times": served.get("steps") if served else None,
        "gpu_bytes_per_row": {
            "bound_h2d": best_bound.get("h2d_bytes_per_row"),
            "bound_d2h": best_bound.get("d2h_bytes_per_row"),
            "served_pcie_h2d": served.get("pcie_h2d_bytes_per_row") if served else None,
            "served_pcie_d2h": served.get("pcie_d2h_bytes_per_row") if served else None,
        },
        "gpu_targets": targets,
    }


def number(value: float | None, digits: int = 0) -> str:
    """A figure for a table; n/a when missing."""
    return "n/a" if value is None else f"{value:,.{digits}f}"


def steps_cell(point: dict[str, Any]) -> str:
    """Each model's ``queue / compute`` ms per request at a point, from Triton's statistics."""
    return "<br>".join(
        f"{s['model']} {s['queue_us'] / 1e3:.2f} / {s['compute_us'] / 1e3:.2f}"
        for s in point.get("steps", ())
    )


def bench_markdown(results: Sequence[StepResult], figures: dict[str, Any]) -> list[str]:
    """The bench's section of ``summary.md``: headline, targets, the bound, every served point."""
    bound = next((r.data for r in results if r.name == "bench-bound"), {})
    points = [
        p
        for r in results
        if r.part == BENCH_PART and r.name != "bench-bound"
        for p in r.data.get("points", ())
    ]
    if not bound and not points:
        return []
    lines = [
        "",
        f"## The bench ({figures['gpu_device'] or 'no device'})",
        "",
        f"- bound: {number(figures['gpu_bound_rows_per_s'])} rows/s; served (id form, p99 <= "
        f"{P99_BOUND_MS:g} ms): {number(figures['gpu_served_rows_per_s'])} rows/s; served / bound "
        f"{number(figures['gpu_served_vs_bound'], 3)}; BYTES form "
        f"{number(figures['gpu_served_bytes_rows_per_s'])} rows/s "
        f"(ids / bytes {number(figures['gpu_ids_vs_bytes'], 2)})",
        "",
        "| target | at least | measured | met |",
        "| --- | ---: | ---: | --- |",
    ]
    for t in figures["gpu_targets"]:
        digits = 2 if t["key"] == "served_vs_bound" else 0
        lines.append(
            f"| {t['what']} | {number(t['target'], digits)} | {number(t['measured'], digits)} | {t['met']} |"
        )
    if bound.get("points"):
        lines += ["", "| bound: users x candidates | rows/s | p50 ms | p99 ms | H2D B/row | D2H B/row |"]
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for p in bound["points"]:
            lines.append(
                f"| {p['users']} x {p['candidates']} | {number(p['rows_per_s'])} | {p['p50_ms']:.2f} "
                f"| {p['p99_ms']:.2f} | {number(p['h2d_bytes_per_row'], 1)} "
                f"| {number(p['d2h_bytes_per_row'], 1)} |"
            )
    if points:
        lines += [
            "",
            "| form | shape | rows/request | in flight | rows/s | p50 ms | p99 ms | refused | client cores "
            "| queue / compute ms per request | PCIe H2D B/row |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
        ]
        for p in points:
            head = "| " + " | ".join(
                str(p.get(k, "")) for k in ("form", "shape", "candidates", "concurrency")
            )
            if "rows_per_s" not in p:
                if "skipped" in p:
                    lines.append(f"{head} | skipped: {p['skipped']} |" + " |" * 6)
                continue
            lines.append(
                f"{head} | {number(p['rows_per_s'])} | {p['p50_ms']:.2f} | {p['p99_ms']:.2f} "
                f"| {p['failures']} | {p['client_cpu']:.2f} | {steps_cell(p)} "
                f"| {number(p['pcie_h2d_bytes_per_row'], 0)} |"
            )
    return lines
