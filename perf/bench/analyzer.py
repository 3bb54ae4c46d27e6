"""``recserve perf``: run the real perf_analyzer against the ``ctr`` ensemble and print its table."""

from __future__ import annotations

import csv
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from recserve.core.spec.model import ModelSpec
from recserve.perf.bench.input_data import write_input_data

LOGGER = logging.getLogger(__name__)

#: A stability percentage that accepts perf_analyzer's first three windows: on a shared 2-core machine
#: strict stability is rarely reached, so each point is the mean of three windows.
LOOSE_STABILITY = 1000
#: What perf_analyzer prints when its windows never agree (it is then rerun with longer windows).
UNSTABLE = "Failed to obtain stable measurement"


class PerfError(RuntimeError):
    """perf_analyzer is missing or failed."""


@dataclass(frozen=True)
class PerfPoint:
    """One concurrency level of a perf_analyzer run."""

    concurrency: int
    rows_per_s: float  # perf_analyzer's infer/sec counts rows (requests x batch size)
    p50_us: float
    p95_us: float
    p99_us: float


def perf_analyzer_binary() -> Path:
    """The perf_analyzer installed by tritonclient 2.50 into this environment's ``bin/``."""
    candidate = Path(sys.executable).parent / "perf_analyzer"
    found = candidate if candidate.is_file() else shutil.which("perf_analyzer")
    if not found:
        raise PerfError("perf_analyzer not found; install tritonclient==2.50.0 (see README)")
    return Path(found)


def perf_env() -> dict[str, str]:
    """Environment with the CUDA runtime perf_analyzer links against on LD_LIBRARY_PATH."""
    import nvidia.cuda_runtime

    lib = Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def perf_command(
    spec: ModelSpec,
    url: str,
    protocol: str,
    batch_size: int,
    concurrency: str,
    measurement_ms: int,
    data: Path,
    csv_path: Path,
    shared_memory: str = "none",
    stability_percentage: int = 50,
    model: str = "",
) -> list[str]:
    """The perf_analyzer command line (``shared_memory``: ``none`` or ``system``, ``cuda`` on a GPU).

    ``model`` is the ensemble measured: the spec's own (rows) by default.
    """
    return [
        str(perf_analyzer_binary()),
        "-m", model or spec.name,
        "-u", url,
        "-i", protocol,
        "-b", str(batch_size),
        "--concurrency-range", concurrency,
        "--input-data", str(data),
        "--measurement-interval", str(measurement_ms),
        "--percentile", "99",
        "--max-trials", "5",
        "--stability-percentage", str(stability_percentage),
        "-f", str(csv_path),
        "--verbose-csv",
        "--shared-memory", shared_memory,
    ]  # fmt: skip


def parse_csv(path: Path) -> list[PerfPoint]:
    """Read perf_analyzer's ``-f`` CSV."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return [
        PerfPoint(
            concurrency=int(row["Concurrency"]),
            rows_per_s=float(row["Inferences/Second"]),
            p50_us=float(row["p50 latency"]),
            p95_us=float(row["p95 latency"]),
            p99_us=float(row["p99 latency"]),
        )
        for row in rows
    ]


def measure(
    spec: ModelSpec,
    url: str | None = None,
    protocol: str = "grpc",
    batch_size: int = 1,
    concurrency: str = "1:4",
    measurement_ms: int = 3000,
    workdir: Path | None = None,
    data: Path | None = None,
    shared_memory: str = "none",
    stability_percentage: int = LOOSE_STABILITY,
    candidates: int = 0,
    model: str = "",
) -> tuple[list[PerfPoint], str]:
    """Run perf_analyzer once; return the parsed points and its printed output.

    ``data`` reuses an input-data file written by :func:`write_input_data` (else one is written).
    The default :data:`LOOSE_STABILITY` accepts the first three windows (shared, noisy machines);
    pass e.g. 50 to let perf_analyzer insist on stable windows. With ``candidates``, every request
    is one user's list of that many candidates to the candidates ensemble (``batch_size`` 1), and
    ``rows_per_s`` counts the candidates scored. ``model``: another row ensemble of the server
    than the spec's (e.g. :func:`recserve.build.configs.single_form_ensemble`'s).
    """
    url = url or ("127.0.0.1:8001" if protocol == "grpc" else "127.0.0.1:8000")
    model = model or spec.name
    if candidates:
        if spec.candidates_model is None or batch_size != 1:
            raise PerfError(f"candidate lists need a spec with a sequence and batch size 1 ({spec.name!r})")
        model = spec.candidates_model
    with tempfile.TemporaryDirectory() as tmp:
        root = workdir or Path(tmp)
        data = data or write_input_data(spec, root / "input_data.json", candidates=candidates)
        csv_path = root / "perf.csv"
        command = perf_command(
            spec,
            url,
            protocol,
            batch_size,
            concurrency,
            measurement_ms,
            data,
            csv_path,
            shared_memory,
            stability_percentage,
            model,
        )
        wanted = len(concurrency_levels(concurrency))
        for attempt in range(3):
            if attempt:  # perf_analyzer's own advice when windows disagree: measure longer
                measurement_ms *= 2
                command[command.index("--measurement-interval") + 1] = str(measurement_ms)
            csv_path.unlink(missing_ok=True)
            done = subprocess.run(command, env=perf_env(), capture_output=True, text=True, timeout=600)
            points = parse_csv(csv_path) if done.returncode == 0 and csv_path.exists() else []
            if done.returncode == 0 and len(points) == wanted:
                per_request = max(candidates, 1)  # the candidates ensemble counts requests
                return [replace(p, rows_per_s=p.rows_per_s * per_request) for p in points], done.stdout
            # it may also end a sweep early with exit code 0 (fewer points than levels): retried alike
            if done.returncode != 0 and UNSTABLE not in done.stdout + done.stderr:
                break
        if done.returncode == 0:
            raise PerfError(
                f"perf_analyzer measured {len(points)} of {wanted} concurrency levels {concurrency}:\n"
                f"{done.stdout[-3000:]}{done.stderr[-2000:]}"
            )
        raise PerfError(
            f"perf_analyzer exited with {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
        )


def measure_point(
    spec: ModelSpec,
    url: str,
    protocol: str,
    batch_size: int,
    concurrency: int,
    measurement_ms: int,
    **options: Any,
) -> PerfPoint | None:
    """One load point with :func:`measure`; None when perf_analyzer found no stable windows.

    That happens when the server stalls for about a window (no request completes in one): the
    point has no figures, and a sweep goes on rather than ending there.
    """
    try:
        return measure(spec, url, protocol, batch_size, str(concurrency), measurement_ms, **options)[0][-1]
    except PerfError as exc:
        if UNSTABLE not in str(exc):
            raise
        LOGGER.warning("batch %d x %d on %s: %s", batch_size, concurrency, url, UNSTABLE)
        return None


def concurrency_levels(concurrency: str) -> list[int]:
    """The levels of a ``--concurrency-range`` ``start[:end[:step]]`` (perf_analyzer's default step is 1)."""
    parts = [int(part) for part in concurrency.split(":")]
    start, end, step = parts[0], parts[1] if len(parts) > 1 else parts[0], parts[2] if len(parts) > 2 else 1
    return list(range(start, end + 1, step))


def format_table(points: list[PerfPoint], batch_size: int) -> str:
    """A compact table of throughput and latency percentiles."""
    lines = [
        f"{'concurrency':>11} {'requests/s':>10} {'rows/s':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}"
    ]
    for p in points:
        lines.append(
            f"{p.concurrency:>11} {p.rows_per_s / batch_size:>10.1f} {p.rows_per_s:>9.0f} "
            f"{p.p50_us / 1e3:>8.2f} {p.p95_us / 1e3:>8.2f} {p.p99_us / 1e3:>8.2f}"
        )
    return "\n".join(lines)


def run_perf(
    spec: ModelSpec,
    url: str | None,
    protocol: str,
    batch_size: int,
    concurrency: str,
    measurement_ms: int,
    output: Path | None,
    inprocess_repository: Path | None = None,
    candidates: int = 0,
) -> int:
    """CLI body: measure, print perf_analyzer's own report, the summary table and the in-process rate.

    With ``candidates``, each request is one user's candidate list (no in-process comparison).
    """
    try:
        points, report = measure(
            spec, url, protocol, batch_size, concurrency, measurement_ms, candidates=candidates
        )
    except PerfError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report)
    if candidates:
        print(f"{spec.candidates_model} over {protocol}, one user's {candidates} candidates per request:")
        print(format_table(points, candidates))
    else:
        print(f"{spec.name} over {protocol}, client batch {batch_size}:")
        print(format_table(points, batch_size))
    if inprocess_repository is not None and not candidates:
        from recserve.perf.harness.inprocess import measure_inprocess

        rate = measure_inprocess(spec, inprocess_repository, batch_size, seconds=measurement_ms / 1000)
        print(
            f"in-process (no server, 1 thread), batch {batch_size}: {rate.rows_per_s:.0f} rows/s, "
            f"p50 {rate.p50_ms:.2f} ms, p99 {rate.p99_ms:.2f} ms per batch"
        )
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(output, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["batch_size", "concurrency", "rows_per_s", "p50_us", "p95_us", "p99_us"])
            for p in points:
                writer.writerow([batch_size, p.concurrency, p.rows_per_s, p.p50_us, p.p95_us, p.p99_us])
    return 0
