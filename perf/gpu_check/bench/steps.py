"""The bench's steps (part 0, one call): its repository, the in-process bound, the served paths.

Each step calls a helper of this package in the venv (``bench-spec``, ``bound``, ``served``) and
keeps its own time limit; the served steps share one server, started by ``bench-serve`` and stopped
when the call's steps are done. The served helpers append each point to a JSON-lines file as they
measure it; the runner rewrites the outputs with the points so far every few seconds, so a call cut
short still reports them. In a dry run the same steps run on the CPU (``device="cpu"``, the
``cpu`` profile, :data:`~.common.BENCH_DRY`'s tiny sizes); on a GPU, the ``cuda`` profile.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..common import BENCH, BENCH_DRY, BenchSizes, tail
from ..context import Context, Failed, Skip
from ..serve import Server

BENCH_PORT = 18500
#: the served helpers' groups, by step
GROUPS = {"bench-ids-lists": "ids-lists", "bench-ids-rows": "ids-rows", "bench-bytes": "bytes"}


def sizes_of(ctx: Context) -> BenchSizes:
    """Full sizes on a GPU, tiny ones in a dry run."""
    return BENCH_DRY if ctx.dry_run else BENCH


def helper(ctx: Context, command: str, *args: str) -> list[str]:
    """The command line of one of this package's helpers, run in the venv (``--dry``: the tiny sizes)."""
    return [ctx.python, "-m", "recserve.perf.gpu_check", command, *args, *(["--dry"] if ctx.dry_run else [])]


def bench_dir(ctx: Context) -> Path:
    """The bench's spec and repository (ignored; a warm machine's is reused when built from this spec)."""
    return ctx.work / "bench"


def spec_path(ctx: Context) -> Path:
    """The bench spec (JSON)."""
    return bench_dir(ctx) / "spec.json"


def repository(ctx: Context) -> Path:
    """The bench's repository."""
    return bench_dir(ctx) / "repository"


def step_bench_build(ctx: Context) -> tuple[str, dict[str, Any]]:
    """The bench spec (fewer training rows) and its repository (``recserve build --if-missing``)."""
    instances = [] if ctx.lookup_instances is None else ["--lookup-instances", str(ctx.lookup_instances)]
    out = ctx.sh("bench-build", helper(ctx, "bench-spec", "--target", str(spec_path(ctx)), *instances), 120)
    changes = json.loads(out.strip().splitlines()[-1])
    recserve = str(ctx.venv / "bin" / "recserve")
    command = [recserve, "--spec", str(spec_path(ctx)), "build", "--repository", str(repository(ctx))]
    ctx.sh("bench-build", [*command, "--if-missing"], 400)
    return f"built from the default spec with {'; '.join(changes)}", {"changes": changes}


def step_bench_bound(ctx: Context) -> tuple[str, dict[str, Any]]:
    """The in-process bound on the device at each batch of the sweep."""
    target = ctx.logs / "bench-bound.json"
    target.unlink(missing_ok=True)
    device = "cuda" if ctx.gpus else "cpu"
    args = ["--spec", str(spec_path(ctx)), "--repository", str(repository(ctx)), "--device", device]
    ctx.sh("bench-bound", helper(ctx, "bound", *args, "--json", str(target)), 300)
    data = json.loads(target.read_text())
    best = data["best"]
    copied = best["h2d_bytes_per_row"]
    return (
        f"best {best['rows_per_s']:.0f} rows/s at {best['users']} x {best['candidates']} rows "
        f"(p99 {best['p99_ms']:.2f} ms) on {data['device']}; parity max |diff| "
        f"{data['parity']['max_abs_diff']:.1e}; host to device "
        f"{'n/a' if copied is None else f'{copied:.0f}'} B/row"
    ), data


def step_bench_serve(ctx: Context) -> tuple[str, dict[str, Any]]:
    """Serve the bench repository (``cuda`` profile; ``cpu`` in a dry run) and check parity."""
    profile = "cuda" if ctx.gpus else "cpu"
    args = ["--repository", str(repository(ctx)), "--spec", str(spec_path(ctx)), "--profile", profile]
    server = ctx.stack.enter_context(Server(ctx, "bench-serve", args, BENCH_PORT))
    ctx.shared["server"] = server
    points = served(ctx, "bench-serve", "parity")
    check = points[-1]["parity"]
    detail = (
        f"--profile {profile}; parity max |diff| {check['max_abs_diff']:.2e} against PyTorch "
        f"(rows and a list, ids and bytes; ids vs bytes {check['list_ids_vs_bytes_max_abs_diff']:.1e})"
    )
    if not check["ok"]:
        raise Failed(detail, {"parity": check, "profile": profile})
    return detail, {"parity": check, "profile": profile}


def served(ctx: Context, name: str, group: str) -> list[dict[str, Any]]:
    """Run one group of the served helper against the bench's server, within the step's time; its JSON lines.

    Raises:
        Skip: the server did not start.
        Failed: the helper failed or ran out of time (with the points it measured).
    """
    server = ctx.shared.get("server")
    if server is None:
        raise Skip("the bench's server did not start (bench-serve)")
    jsonl = ctx.logs / f"{name}.jsonl"
    jsonl.unlink(missing_ok=True)
    timeout = ctx.remaining()
    seconds = max(timeout - 15, 1)  # the helper's own start (imports, requests) comes first
    args = ["--group", group, "--spec", str(spec_path(ctx)), "--repository", str(repository(ctx))]
    args += [
        "--grpc",
        server.grpc,
        "--http",
        server.http,
        "--seconds",
        f"{seconds:.0f}",
        "--jsonl",
        str(jsonl),
    ]
    try:
        ctx.watch(
            name, helper(ctx, "served", *args), timeout, lambda: ctx.partial(name, {"points": lines(jsonl)})
        )
    except RuntimeError as exc:
        raise Failed(f"{exc}\n{tail(server.log_tail(), 5)}", {"points": lines(jsonl)}) from exc
    return lines(jsonl)


def lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines written so far (a line being written is left out)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def step_served_group(ctx: Context, name: str) -> tuple[str, dict[str, Any]]:
    """One group of served points; the detail names the fastest."""
    points = served(ctx, name, GROUPS[name])
    measured = [p for p in points if "rows_per_s" in p]
    skipped = len(points) - len(measured)
    if not measured:
        reasons = sorted({p.get("skipped", "") for p in points})
        raise Skip("; ".join(reasons) or "no point measured")
    best = max(measured, key=lambda p: p["rows_per_s"])
    return (
        f"{len(measured)} points ({skipped} skipped); most {best['rows_per_s']:.0f} rows/s: "
        f"{best['form']} {best['shape']} of {best['candidates']}, {best['concurrency']} in flight, "
        f"p99 {best['p99_ms']:.1f} ms"
    ), {"points": points}


def step_bench_ids_lists(ctx: Context) -> tuple[str, dict[str, Any]]:
    """Candidate lists in the id form at 1-16 in flight."""
    return step_served_group(ctx, "bench-ids-lists")


def step_bench_ids_rows(ctx: Context) -> tuple[str, dict[str, Any]]:
    """Row-form requests in the id form at 1-16 in flight."""
    return step_served_group(ctx, "bench-ids-rows")


def step_bench_bytes(ctx: Context) -> tuple[str, dict[str, Any]]:
    """Lists and rows in the BYTES form, for comparison."""
    return step_served_group(ctx, "bench-bytes")
