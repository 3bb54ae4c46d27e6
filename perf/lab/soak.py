"""``recserve lab soak``: bounded mixed traffic with periodic updates, watched by a leak detector.

The soak starts tritonserver on free loopback ports over a scratch copy of the repository, sends
valid requests (gRPC and HTTP, batch 1..64) mixed with a small share of malformed ones, calls an
*updater* every few seconds (by default: a new ``dense`` version goes live through the
model-repository API), and samples the resident memory and open file descriptors of tritonserver
and of each model's stub processes. The detector compares the start and the end of the second half:
memory must grow by at most ``max_rss_growth_mb`` and descriptors by at most ``max_fd_growth`` per
process group, and no valid request may fail.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from recserve.backends.base.artifacts import model_versions
from recserve.core.names import DENSE, EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.traffic import (
    TrafficCounts,
    add_version,
    scratch_repository,
    traffic_worker,
)
from recserve.server import Ports, Security, TritonServer, expected_stubs

LOGGER = logging.getLogger(__name__)

SERVER = "tritonserver"
#: An updater makes one change to the served models and says what it did.
Updater = Callable[[], str]


# ---- resources ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResourceSample:
    """Resident memory (MB) and open descriptors of tritonserver and of each model's serving stubs.

    ``replaced`` counts, per model, the stubs beyond its instance count: those of a version being
    replaced, on their way out (they are not added to the model's memory). ``generation`` names,
    per model, its newest stub (its start time): it changes when a new version goes live.
    """

    at_s: float
    rss_mb: dict[str, float]
    fds: dict[str, int]
    replaced: dict[str, int] = field(default_factory=dict)
    generation: dict[str, int] = field(default_factory=dict)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _started(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def sample_resources(
    server: TritonServer, at_s: float, instances: dict[str, int] | None = None
) -> ResourceSample:
    """Memory and descriptors now: tritonserver, and per model its newest ``instances[model]`` stubs."""
    assert server.process is not None
    groups: dict[str, list[int]] = {}
    for pid, model in server.stubs().items():
        groups.setdefault(model, []).append(pid)
    replaced, newest = {}, {}
    for model, pids in groups.items():
        keep = (instances or {}).get(model, len(pids))
        started = {pid: _started(pid) for pid in pids}
        pids.sort(key=started.__getitem__, reverse=True)
        groups[model], replaced[model], newest[model] = (
            pids[:keep],
            max(0, len(pids) - keep),
            started[pids[0]],
        )
    groups[SERVER] = [server.process.pid]
    rss: dict[str, float] = {}
    fds: dict[str, int] = {}
    for name, pids in groups.items():
        rss[name], fds[name] = 0.0, 0
        for pid in pids:
            try:
                rss[name] += _rss_mb(pid)
                fds[name] += len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:  # a stub that just exited
                continue
    return ResourceSample(at_s, rss, fds, replaced, newest)


def detect_leaks(
    samples: list[ResourceSample], max_rss_growth_mb: float = 50.0, max_fd_growth: int = 16, window: int = 3
) -> tuple[dict[str, tuple[float, int]], list[str]]:
    """Growth over the second half of a run, and what breaks the limits.

    The end of the second half is the median of its last ``window`` samples, so a short spike does
    not count as growth. It is compared with the median of the half's first ``window`` samples
    when the same stubs served throughout; when a new version went live in between, with the most
    the model held before the half (its earlier versions' high-water mark): a new version's stub
    starts small and grows as it compiles the shapes it serves, so its memory at one age is not
    comparable with an older stub's at another. Stubs of a replaced version are not part of a
    model's memory; more than one of them still running through the last window is a problem of
    its own.

    Returns:
        ``({group: (rss growth MB, fd growth)}, [problems])``.
    """
    if not samples:
        return {}, ["no samples to judge memory"]
    half_at = samples[-1].at_s / 2
    half = [s for s in samples if s.at_s >= half_at]
    before = [s for s in samples if s.at_s < half_at] or half[:window]
    if len(half) < 2 * window:
        return {}, [f"too few samples in the second half ({len(half)}) to judge memory"]
    first, last = half[:window], half[-window:]
    growth, problems = {}, []
    for name in sorted(set().union(*(s.rss_mb.keys() for s in half))):
        end_rss = statistics.median(s.rss_mb.get(name, 0.0) for s in last)
        end_fds = statistics.median(s.fds.get(name, 0) for s in last)
        if first[0].generation.get(name) == last[-1].generation.get(name):
            start_rss = statistics.median(s.rss_mb.get(name, 0.0) for s in first)
            start_fds = statistics.median(s.fds.get(name, 0) for s in first)
        else:
            start_rss = max(s.rss_mb.get(name, 0.0) for s in before)
            start_fds = max(s.fds.get(name, 0) for s in before)
        rss, fds = end_rss - start_rss, int(end_fds - start_fds)
        growth[name] = (rss, fds)
        lingering = min(s.replaced.get(name, 0) for s in half[-window:])
        if lingering > 1:
            problems.append(f"{name}: {lingering} replaced versions' stubs are still running at the end")
        if rss > max_rss_growth_mb:
            problems.append(
                f"{name}: resident memory grew {rss:.1f} MB over the second half "
                f"(limit {max_rss_growth_mb:.0f})"
            )
        if fds > max_fd_growth:
            problems.append(
                f"{name}: {fds} more open file descriptors over the second half (limit {max_fd_growth})"
            )
    return growth, problems


# ---- updates -----------------------------------------------------------------------------------
class DenseVersionUpdater:
    """Each call puts a new ``dense`` version live (copy of the newest) and drops the replaced one."""

    def __init__(self, repository: Path, grpc_url: str, headers: dict[str, str], model: str = DENSE) -> None:
        self.repository = repository
        self.grpc_url = grpc_url
        self.headers = headers
        self.model = model

    def __call__(self) -> str:
        """Load the next version through the model-repository API."""
        old = model_versions(self.repository / self.model)
        new = add_version(self.repository, self.model)
        with grpcclient.InferenceServerClient(self.grpc_url) as client:
            client.load_model(self.model, headers=self.headers)
        for version in old:  # unloaded by the version policy (latest 1): keep the disk bounded
            shutil.rmtree(self.repository / self.model / str(version), ignore_errors=True)
        return f"{self.model} version {new} live"


class EmbeddingDeltaUpdater:
    """Each call publishes new rows for some keys of one table, or rolls the table back to its base.

    Goes through the update log the servers watch (what ``recserve update``/``rollback`` write), so
    the running store applies it without a restart.
    """

    def __init__(self, spec: ModelSpec, repository: Path, table: str | None = None, rows: int = 256) -> None:
        from recserve.backends.store.served import updates_dir
        from recserve.backends.store.tiered import TieredStore
        from recserve.backends.store.updates.versions import UpdateLog

        folder = repository / EMBEDDING_LOOKUP / str(spec.version)
        store = TieredStore.load(folder, spec)
        self.table = table or spec.attention("the soak's update stream")[0].table
        self.keys = store.table_arrays(self.table).keys[:rows]
        self.dim = store.dim
        self.log = UpdateLog(updates_dir(folder), store.base_version)
        self.rng = np.random.default_rng(0)
        self.calls = 0

    def __call__(self) -> str:
        """Publish a delta (odd calls) or roll back to the base version (even calls)."""
        self.calls += 1
        if self.calls % 2:
            vectors = self.rng.normal(0, 0.1, size=(len(self.keys), self.dim)).astype(np.float32)
            return (
                f"{self.table} version {self.log.publish(self.table, self.keys, vectors, self.dim)} published"
            )
        return f"{self.table} version {self.log.rollback(self.table, self.log.base_version)}: back to base"


def alternate(*updaters: Updater) -> Updater:
    """One updater that calls the given ones in turn."""
    turn = itertools.cycle(updaters)
    return lambda: next(turn)()


# ---- the soak ----------------------------------------------------------------------------------
@dataclass
class SoakReport:
    """Outcome of one soak."""

    duration_s: float
    counts: TrafficCounts
    updates: list[str]
    samples: list[ResourceSample]
    growth: dict[str, tuple[float, int]]
    problems: list[str]

    @property
    def passed(self) -> bool:
        """No leak and no failed valid request."""
        return not self.problems

    def table(self) -> str:
        """Markdown summary."""
        first, last = self.samples[0], self.samples[-1]
        lines = [
            f"soak {self.duration_s:.0f} s: {self.counts.valid_ok} valid ok, "
            f"{self.counts.valid_failed} valid failed, "
            f"{self.counts.bad_refused} malformed refused, {self.counts.bad_accepted} malformed not refused, "
            f"{len(self.updates)} updates, dense versions served {sorted(self.counts.versions)}, "
            f"{len(self.counts.embedding_versions)} embedding snapshots (sets of table versions) served",
            "",
            "| process | RSS start MB | RSS end MB | RSS growth 2nd half MB | fds start | fds end "
            "| fd growth 2nd half |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, (rss, fds) in self.growth.items():
            lines.append(
                f"| {name} | {first.rss_mb.get(name, 0):.1f} | {last.rss_mb.get(name, 0):.1f} | {rss:+.1f} | "
                f"{first.fds.get(name, 0)} | {last.fds.get(name, 0)} | {fds:+d} |"
            )
        lines.append("")
        lines.append("PASS" if self.passed else "FAIL: " + "; ".join(self.problems))
        return "\n".join(lines)


def run_soak(
    server: TritonServer,
    spec: ModelSpec,
    duration_s: float,
    updater: Updater | None = None,
    update_every_s: float = 10.0,
    bad_fraction: float = 0.01,
    sample_every_s: float = 1.0,
    protocols: tuple[str, ...] = ("grpc", "grpc", "http"),
    max_rss_growth_mb: float = 50.0,
    max_fd_growth: int = 16,
    pause_s: float = 0.005,
) -> SoakReport:
    """Run traffic, updates and sampling for ``duration_s`` against a started server; judge the result."""
    stop, counts = threading.Event(), TrafficCounts()
    workers = [
        threading.Thread(
            target=traffic_worker,
            args=(server, spec, p, stop, counts, bad_fraction, 100 + i, pause_s),
            daemon=True,
        )
        for i, p in enumerate(protocols)
    ]
    for worker in workers:
        worker.start()
    samples: list[ResourceSample] = []
    updates: list[str] = []
    instances = expected_stubs(server.repository)
    started = time.monotonic()
    next_update = started + update_every_s
    try:
        while (now := time.monotonic()) - started < duration_s:
            samples.append(sample_resources(server, now - started, instances))
            if updater is not None and now >= next_update:
                updates.append(updater())
                LOGGER.info("%s", updates[-1])
                next_update = (
                    now + update_every_s
                )  # from the start of this update: a slow one does not thin the rest out
            time.sleep(max(0.0, sample_every_s - (time.monotonic() - now)))
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    growth, problems = detect_leaks(samples, max_rss_growth_mb, max_fd_growth)
    if counts.valid_failed:
        problems.append(f"{counts.valid_failed} valid requests failed, first: {counts.failures[0]}")
    if counts.bad_accepted:
        problems.append(f"{counts.bad_accepted} malformed requests were not refused with INVALID_ARG")
    if counts.valid_ok == 0:
        problems.append("no valid request succeeded")
    if server.watchdog is not None and server.watchdog.reloads:
        problems.append(
            f"stub processes died and were replaced: {[model for _, model in server.watchdog.reloads]}"
        )
    return SoakReport(time.monotonic() - started, counts, updates, samples, growth, problems)


def soak_command(spec: ModelSpec, repository: Path, duration_s: float, update_every_s: float) -> int:
    """``recserve lab soak``: a private server on free loopback ports; exit status 1 when the soak fails."""
    with tempfile.TemporaryDirectory(prefix="recserve-soak-") as scratch:
        root = scratch_repository(repository, Path(scratch) / "repository")
        security = Security("explicit", admin_key=secrets.token_urlsafe(32))
        with TritonServer(
            root, Ports.free(), log_path=Path(scratch) / "server.log", security=security
        ) as server:
            dense = DenseVersionUpdater(root, server.grpc_url, security.headers())
            report = run_soak(
                server, spec, duration_s, alternate(dense, EmbeddingDeltaUpdater(spec, root)), update_every_s
            )
    print(report.table())
    return 0 if report.passed else 1
