"""The serving steps: ``recserve serve`` under perf_analyzer, with parity and dense instances.

Parity compares the served scores with the in-process PyTorch reference; the instance steps serve 1, 2
and 4 dense instances with and without MPS. ``cmd_parity`` and ``cmd_variant`` are the helper commands
they call in the venv (their third-party and recserve imports stay inside them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .common import INSTANCES, LOOKUP_INSTANCES, PERF_BATCHES, PERF_CONCURRENCY, tail
from .context import Context, Skip


class Server:
    """``recserve serve`` in the background on free loopback ports, stopped on exit."""

    def __init__(self, ctx: Context, name: str, args: Sequence[str], port: int) -> None:
        self.ctx, self.name, self.port = ctx, name, port
        command = ["recserve", "serve", *args, "--http-port", str(port), "--grpc-port", str(port + 1)]
        command += ["--metrics-port", str(port + 2)]
        self.log = open(ctx.logs / f"{name}.server.log", "w")  # noqa: SIM115 - closed in __exit__
        self.process = subprocess.Popen(
            command,
            cwd=ctx.root,
            env=ctx.env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def grpc(self) -> str:
        """host:port of gRPC."""
        return f"127.0.0.1:{self.port + 1}"

    @property
    def http(self) -> str:
        """host:port of HTTP (the health and statistics endpoints)."""
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        limit = time.monotonic() + min(240, max(self.ctx.remaining() - 30, 10))
        while time.monotonic() < limit:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"server not ready in time:\n{self.log_tail()}")

    def log_tail(self) -> str:
        """The end of the server's log."""
        self.log.flush()
        return tail((self.ctx.logs / f"{self.name}.server.log").read_text(errors="replace"))

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()


def perf_points(
    ctx: Context, name: str, server: Server, batch: int, levels: Iterable[int]
) -> list[dict[str, Any]]:
    """perf_analyzer at each concurrency: rows/s (= user-item pairs/s: one candidate per row), p50, p99."""
    points = []
    for level in levels:
        csv_path = ctx.logs / f"{name}-b{batch}-c{level}.csv"
        command = ["recserve", "perf", "--url", server.grpc, "--batch-size", str(batch)]
        command += ["--concurrency", f"{level}:{level}", "--measurement-ms", "1500", "--no-inprocess"]
        ctx.sh(name, [*command, "--output", str(csv_path)], 90)
        for row in csv_path.read_text().splitlines()[1:]:
            b, c, rows, p50, _p95, p99 = row.split(",")
            points.append(
                {
                    "batch": int(b),
                    "concurrency": int(c),
                    "rows_per_s": float(rows),
                    "pairs_per_s": float(rows),
                }
                | {"p50_ms": float(p50) / 1e3, "p99_ms": float(p99) / 1e3}
            )
    return points


def parity(ctx: Context, name: str, server: Server, tolerance: float) -> dict[str, Any]:
    """Served scores against the in-process PyTorch reference on the same rows."""
    out = ctx.sh(
        name,
        [
            ctx.python,
            "-m",
            "recserve.perf.gpu_check",
            "parity",
            "--url",
            server.grpc,
            "--tolerance",
            str(tolerance),
        ],
        180,
    )
    return json.loads(out.strip().splitlines()[-1])


def serve_profile(ctx: Context, profile: str, port: int) -> tuple[str, dict[str, Any]]:
    """Serve one GPU profile, measure it with perf_analyzer and check parity."""
    name = f"serve-{profile}"
    with Server(ctx, name, ["--profile", profile], port) as server:
        check = parity(ctx, name, server, 1e-4 if profile == "cuda" else 1e-3)
        points = [
            p for batch in PERF_BATCHES for p in perf_points(ctx, name, server, batch, PERF_CONCURRENCY)
        ]
    best = max(points, key=lambda p: p["rows_per_s"])
    detail = (
        f"parity max |diff| {check['max_abs_diff']:.2e} over {check['rows']} rows "
        f"({'ok' if check['ok'] else 'FAILED'}); best {best['rows_per_s']:.0f} rows/s "
        f"(batch {best['batch']}, concurrency {best['concurrency']}, p99 {best['p99_ms']:.1f} ms)"
    )
    if not check["ok"]:
        raise RuntimeError(detail)
    return detail, {"perf": points, "parity": check}


def step_serve_cuda(ctx: Context) -> tuple[str, dict[str, Any]]:
    """``serve --profile cuda`` with perf_analyzer and parity."""
    return serve_profile(ctx, "cuda", 18100)


def step_serve_gpu(ctx: Context) -> tuple[str, dict[str, Any]]:
    """``serve --profile gpu`` (TensorRT dense) with perf_analyzer and parity."""
    return serve_profile(ctx, "gpu", 18200)


def instance_sweep(
    ctx: Context, step: str, counts: Iterable[int], flag: str, mps: bool, port: int
) -> list[dict[str, Any]]:
    """perf_analyzer (batch 64, concurrency 4 and 16) over cuda-profile variants, one per count of a step."""
    rows = []
    for count in counts:
        name = f"{step}-{count}{'-mps' if mps else ''}"
        variant = ctx.work / f"variant-{name}"
        make = [ctx.python, "-m", "recserve.perf.gpu_check", "variant", flag, str(count)]
        ctx.sh(step, [*make, "--target", str(variant)], 60)
        args = ["--repository", str(variant), "--profile", "cuda", *(["--mps"] if mps else [])]
        with Server(ctx, name, args, port + 10 * count) as server:
            for point in perf_points(ctx, name, server, 64, (4, 16)):
                rows.append({"instances": count, "mps": mps, **point})
    return rows


def step_instances(ctx: Context, mps: bool) -> tuple[str, dict[str, Any]]:
    """1, 2 and 4 instances of the dense step (cuda profile), batch 64 at concurrency 4 and 16."""
    if mps and not shutil.which("nvidia-cuda-mps-control"):
        raise Skip("nvidia-cuda-mps-control is not installed")
    rows = instance_sweep(ctx, "instances", INSTANCES, "--dense-instances", mps, 18305 if mps else 18300)
    best = max(rows, key=lambda p: p["rows_per_s"])
    return f"best {best['rows_per_s']:.0f} rows/s with {best['instances']} instances", {"instances": rows}


def step_lookup_instances(ctx: Context) -> tuple[str, dict[str, Any]]:
    """1, 2, 4 and 8 instances of the lookup step with one dense instance (cuda profile)."""
    rows = instance_sweep(ctx, "lookup-instances", LOOKUP_INSTANCES, "--lookup-instances", False, 18400)
    best = max(rows, key=lambda p: p["rows_per_s"])
    return (
        f"best {best['rows_per_s']:.0f} rows/s with {best['instances']} lookup instances",
        {"lookup-instances": rows},
    )


def step_instances_plain(ctx: Context) -> tuple[str, dict[str, Any]]:
    """Dense instances without MPS."""
    return step_instances(ctx, mps=False)


def step_instances_mps(ctx: Context) -> tuple[str, dict[str, Any]]:
    """Dense instances with MPS."""
    return step_instances(ctx, mps=True)


def cmd_parity(args: argparse.Namespace) -> int:
    """Served scores (gRPC) against the in-process PyTorch reference on the same generated rows."""
    import numpy as np

    from recserve.build.repository import reference_pipeline
    from recserve.build.synthetic import generate
    from recserve.clients import CTRClient
    from recserve.core.spec.parse import load_spec
    from recserve.core.spec.types import DEFAULT_REPOSITORY, DEFAULT_SPEC

    spec = load_spec(DEFAULT_SPEC)
    reference = reference_pipeline(spec, Path(DEFAULT_REPOSITORY), runtime="torch")
    worst, rows = 0.0, 0
    with CTRClient(args.url, protocol="grpc", spec=spec) as client:
        for batch, seed in ((1, 1), (7, 2), (64, 3), (256, 4)):
            wire_inputs = generate(spec, batch, seed).to_wire(spec)
            served = client.predict_inputs(wire_inputs)
            expected = np.asarray(reference.predict(wire_inputs)).reshape(-1)
            worst = max(worst, float(np.abs(served - expected).max()))
            rows += batch
    print(
        json.dumps(
            {"rows": rows, "max_abs_diff": worst, "tolerance": args.tolerance, "ok": worst <= args.tolerance}
        )
    )
    return 0


def cmd_variant(args: argparse.Namespace) -> int:
    """A cuda-profile variant of the built repository with other dense or lookup instance counts."""
    from recserve.build.configs import ServingPlan, write_variant
    from recserve.core.names import DENSE, EMBEDDING_LOOKUP
    from recserve.core.spec.parse import load_spec
    from recserve.core.spec.types import DEFAULT_REPOSITORY, DEFAULT_SPEC

    spec = load_spec(DEFAULT_SPEC)
    plan = ServingPlan.from_spec(spec)
    plan = ServingPlan(
        plan.max_queue_delay_microseconds,
        plan.preferred_batch_sizes,
        {
            **plan.instances,
            DENSE: args.dense_instances or 1,
            EMBEDDING_LOOKUP: args.lookup_instances or plan.instances[EMBEDDING_LOOKUP],
        },
    )
    print(write_variant(spec, Path(DEFAULT_REPOSITORY), args.target, profile="cuda", plan=plan))
    return 0
