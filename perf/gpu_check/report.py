"""The outputs of a call: summary.md, summary.json, logs.tar.gz; and the calls printed by ``prepare``."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .bench.report import bench_figures, bench_markdown
from .common import BENCH_PART, KIT, PARTS
from .context import Context, StepResult


def cell(text: str) -> str:
    """Text fit for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def summary_markdown(results: Sequence[StepResult], header: str, figures: dict[str, Any]) -> str:
    """The summary: one row per step, the bench's figures and tables, then the parts' tables."""
    lines = [
        f"# GPU check: {header}",
        "",
        "| step | part | status | s | detail |",
        "| --- | ---: | --- | ---: | --- |",
    ]
    for r in results:
        lines.append(f"| {r.name} | {r.part} | {r.status} | {r.seconds:.1f} | {cell(r.detail)} |")
    lines += bench_markdown(results, figures)
    for r in results:
        points = r.data.get("perf") or r.data.get("instances") or r.data.get("lookup-instances")
        if not points:
            continue
        lines += ["", f"## {r.name}", ""]
        keys = [k for k in ("instances", "mps", "batch", "concurrency") if k in points[0]]
        lines.append("| " + " | ".join(keys) + " | rows/s | user-item pairs/s | p50 ms | p99 ms |")
        lines.append("|" + " --- |" * (len(keys) + 4))
        for p in points:
            head = " | ".join(str(p[k]) for k in keys)
            lines.append(
                f"| {head} | {p['rows_per_s']:.0f} | {p['pairs_per_s']:.0f} "
                f"| {p['p50_ms']:.2f} | {p['p99_ms']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def write_outputs(
    ctx: Context, results: Sequence[StepResult], header: str, extra: dict[str, Any], logs: bool = True
) -> str:
    """summary.md, summary.json and (``logs``) logs.tar.gz under the output folder; return the Markdown.

    Each file is written aside and renamed into place, so a call killed mid-write leaves the previous one.
    """
    ctx.output.mkdir(parents=True, exist_ok=True)
    figures = bench_figures(results)
    text = summary_markdown(results, header, figures)
    document = {"header": header, **figures, "steps": [asdict(r) for r in results], **extra}
    replace(ctx.output / "summary.md", text.encode())
    replace(ctx.output / "summary.json", (json.dumps(document, indent=2, default=str) + "\n").encode())
    if logs:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            tar.add(ctx.logs, arcname="logs")
        replace(ctx.output / "logs.tar.gz", buffer.getvalue())
    return text


def replace(path: Path, content: bytes) -> None:
    """Write ``content`` to ``path`` through a file beside it renamed into place."""
    aside = path.with_name(f".{path.name}.partial")
    aside.write_bytes(content)
    aside.replace(path)


def print_calls(kit_table: str) -> None:
    """What to run on the GPU machine."""
    print(kit_table)
    print(f'\ncarry: ["{KIT}"]  (the same for every call)')
    print("the bench, one call of at most 8 minutes: python3 -m perf.gpu_check run")
    for part in PARTS:
        if part != BENCH_PART:
            print(f"the longer checks, call {part}: python3 -m perf.gpu_check run --part {part}")
