"""The tables of ``recserve lab dense-bench`` as Markdown.

The rows are measured by :mod:`recserve.perf.lab.dense_bench`; this module only lays them out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketRow:
    """Table 1: one bucket."""

    rows: int
    length: int
    dynamic_rows_per_s: float  # best round of each
    bare_bucket_rows_per_s: float
    runner_rows_per_s: float
    overhead: float  # runner time / bare compiled time - 1
    speedup: float  # dynamic time / runner time
    bookkeeping_us: float  # the runner around a graph that does nothing (policy, counters, padding)
    bookkeeping_share: float  # of the runner's time


def format_report(
    name: str,
    buckets: list[BucketRow],
    off: list[dict[str, float | str]],
    realistic: list[dict[str, float]],
    unseen: dict[str, float],
) -> str:
    """The four tables as Markdown."""
    lines = [
        f"## dense step: {name}",
        "",
        "| bucket | dynamic graph rows/s | bare bucket graph rows/s | runner rows/s | runner vs bare "
        "| runner bookkeeping µs (share) | runner speed-up |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in buckets:
        lines.append(
            f"| {row.rows}x{row.length} | {row.dynamic_rows_per_s:,.0f} | "
            f"{row.bare_bucket_rows_per_s:,.0f} | "
            f"{row.runner_rows_per_s:,.0f} | {row.overhead:+.1%} | {row.bookkeeping_us:.1f} "
            f"({row.bookkeeping_share:.1%}) | {row.speedup:.2f}x |"
        )
    overheads = sorted(row.overhead for row in buckets)
    shares = sorted(row.bookkeeping_share for row in buckets)
    speedups = sorted(row.speedup for row in buckets)
    lines += [
        "",
        f"runner vs bare bucket graph: median {statistics.median(overheads):+.1%}, "
        f"worst {overheads[-1]:+.1%}; "
        f"runner bookkeeping share: median {statistics.median(shares):.1%}, worst {shares[-1]:.1%}; "
        f"runner speed-up (vs dynamic graph): median "
        f"{statistics.median(speedups):.2f}x, range {speedups[0]:.2f}x..{speedups[-1]:.2f}x",
        "",
        "| shape (rows x length) | served by | dynamic graph rows/s | runner rows/s | runner speed-up |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for shape in off:
        lines.append(
            f"| {shape['rows']}x{shape['length']} | {shape['bucket']} | {shape['dynamic_rows_per_s']:,.0f} | "
            f"{shape['runner_rows_per_s']:,.0f} | {shape['speedup']:.2f}x |"
        )
    lines += [
        "",
        "| generated requests, client batch | mean positions | dynamic graph rows/s | runner rows/s "
        "| runner speed-up |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for request in realistic:
        lines.append(
            f"| {request['batch_size']} | {request['mean_positions']:.0f} | "
            f"{request['dynamic_rows_per_s']:,.0f} | {request['runner_rows_per_s']:,.0f} | "
            f"{request['speedup']:.2f}x |"
        )
    lines += [
        "",
        f"| unseen shape {unseen['rows']}x{unseen['length']} | ms |",
        "| --- | ---: |",
        f"| first request (generic graph, compile scheduled) | {unseen['first_request_ms']:.2f} |",
        f"| median request on the generic graph until the swap | {unseen['fallback_median_ms']:.2f} |",
        f"| steady state on the compiled bucket | {unseen['steady_state_ms']:.2f} |",
        f"| first miss until the compiled bucket takes over | {unseen['takeover_ms']:.1f} |",
        f"| requests served by the generic graph meanwhile | {unseen['requests_before_takeover']} |",
    ]
    return "\n".join(lines)
