"""``recserve bench-longseq``: 4,096-event users through a state against today's 256-event rows.

One run, the workloads interleaved at each load point with the same users and the same offered
load (requests of ``rows`` rows at ``rate`` per second, :mod:`.longseq_load`), round after round:

* ``w0``: today: every row a full 256-event history (each user's newest 256 events), no user;
* ``w0_aa``: the same requests again: the A/A control for a noisy machine;
* ``w1``: the naive path: every row all 4,096 events, through the 4,096 sequence bucket;
* ``w2``: ``user_id`` and ``user_seq`` with the newest 64 events; every user's state stored
  (built from all but the newest 8 events), read through the step's cache;
* ``w2_redis``: the same requests to a second server whose states live only in a loopback Redis
  Cluster (no local cache: every request reads Redis);
* ``w2_miss``: as ``w2`` with one row in ten a user without a state (served from its tail alone);
* ``w2_builder``: as ``w2`` while ``recserve user-state run`` rebuilds states from new events.

Per workload and load point: p50/p99 latency, rows/s, request bytes and the steps' times (Triton's
statistics), medians over the rounds; the ratios per round, then their median. The states' outcomes
(hit, miss, ...) come from each server's metrics, the builder's lag from outside it (the store the
servers read). The accuracy figures (:mod:`.longseq_error`) are measured in process on held-out
users. ``summary.json`` (and ``--json``) carry ``longseq_p99_ratio`` (w2 / w0),
``longseq_aa_p99_ratio`` (w0_aa / w0), ``longseq_throughput_ratio``, ``longseq_aa_throughput_ratio``
(at the highest load point; every point is in ``points``) and ``longseq_exact_max_abs``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from recserve.backends.store.event_log import Events, append_events
from recserve.backends.store.user_state_store import open_user_states
from recserve.build import configs
from recserve.core.names import IDS_WIRE, STEPS
from recserve.core.spec import ModelSpec
from recserve.perf.bench import longseq_setup as setup
from recserve.perf.bench.longseq_builder import BuilderProcess, EventFeed
from recserve.perf.bench.longseq_error import FRESH_EVENTS, measure_error
from recserve.perf.bench.longseq_load import Requests, offer, round_order, warm
from recserve.perf.harness.stats import difference, snapshot
from recserve.server import Ports, ServerProcessError, TritonServer

LOGGER = logging.getLogger(__name__)

W0, W0_AA, W1, W2, W2_REDIS, W2_MISS, W2_BUILDER = (
    "w0", "w0_aa", "w1", "w2", "w2_redis", "w2_miss", "w2_builder",
)  # fmt: skip
WORKLOADS = (W0, W0_AA, W1, W2, W2_REDIS, W2_MISS, W2_BUILDER)
#: The lengths of today's rows (W0) and of a request's real-time tail (W2).
TODAY, TAIL = 256, 64
MISS_EVERY = 10  # w2_miss: one row in ten has no state
#: The summary's ratios (of the highest load point), medians of the per-round ratios.
RATIO_KEYS = (
    "longseq_p99_ratio",
    "longseq_aa_p99_ratio",
    "longseq_throughput_ratio",
    "longseq_aa_throughput_ratio",
)
OUTCOME = re.compile(r'recserve_user_state_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)')


@dataclass(frozen=True)
class LongseqGrid:
    """What to measure and for how long."""

    rates: tuple[float, ...] = (20.0, 40.0, 60.0)  # requests per second, each a load point
    rows: int = 16  # rows per request
    users: int = 256
    rounds: int = 5
    seconds: float = 4.0  # per workload, round and load point
    event_rate: float = 50.0  # new events per second during w2_builder
    error_users: int = 512  # held-out users of the clustered error (and half as many exact ones)

    @classmethod
    def quick(cls) -> LongseqGrid:
        """One load point, two rounds of 2 s: under 30 s of load, for CI."""
        return cls(rates=(25.0,), users=64, rounds=2, seconds=2.0, error_users=128)


def _requests(spec: ModelSpec, users: setup.BenchUsers, rows: int) -> dict[str, dict[str, np.ndarray]]:
    """The wire of every workload (all users, one row each), in the SDK's id form."""
    made = users.made
    tails = made.tail_rows(TAIL).with_user_state(spec, made.users, made.rows.lengths)
    stated = tails.to_wire(spec, IDS_WIRE)
    missing = tails.with_user_state(
        spec,
        np.where(np.arange(users.count) % MISS_EVERY == 0, users.unknown_first + made.users, made.users),
        made.rows.lengths,
    ).to_wire(spec, IDS_WIRE)
    today = made.tail_rows(TODAY).to_wire(spec, IDS_WIRE)
    naive = made.rows.to_wire(spec, IDS_WIRE)
    return {
        W0: today,
        W0_AA: today,
        W1: naive,
        W2: stated,
        W2_REDIS: stated,
        W2_MISS: missing,
        W2_BUILDER: stated,
    }


def _split(wire: dict[str, np.ndarray], rows: int, model: str) -> Requests:
    count = next(iter(wire.values())).shape[0] // rows
    return Requests.of(
        model, [{k: v[i * rows : (i + 1) * rows] for k, v in wire.items()} for i in range(count)]
    )


def _outcomes(server: TritonServer) -> dict[str, float]:
    url = f"http://127.0.0.1:{server.ports.metrics}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    counts: dict[str, float] = {}
    for outcome, value in OUTCOME.findall(text):
        counts[outcome] = counts.get(outcome, 0.0) + float(value)
    return counts


def _median(values: list[float]) -> float | None:
    finite = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.median(finite)) if finite else None


def _ratios(phases: dict[str, list[dict[str, Any]]], a: str, b: str, key: str) -> float | None:
    per_round = [
        x[key] / y[key] for x, y in zip(phases[a], phases[b], strict=True) if y[key] and np.isfinite(x[key])
    ]
    return _median(per_round)


def _point_summary(rate: float, grid: LongseqGrid, phases: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    workloads = {}
    for name, rounds in phases.items():
        keys = [k for k in rounds[0] if k != "steps"]
        workloads[name] = {k: _median([r[k] for r in rounds]) for k in keys}
        workloads[name]["steps"] = rounds[-1]["steps"]
    return {
        "rate": rate,
        "offered_rows_per_s": rate * grid.rows,
        "workloads": workloads,
        "longseq_p99_ratio": _ratios(phases, W2, W0, "p99_ms"),
        "longseq_aa_p99_ratio": _ratios(phases, W0_AA, W0, "p99_ms"),
        "longseq_throughput_ratio": _ratios(phases, W2, W0, "rows_per_s"),
        "longseq_aa_throughput_ratio": _ratios(phases, W0_AA, W0, "rows_per_s"),
        "naive_p99_ratio": _ratios(phases, W1, W0, "p99_ms"),
    }


def _targets_met(point: dict[str, Any]) -> bool | None:
    p99, aa, rate, aa_rate = (
        point[k] for k in ("longseq_p99_ratio", "longseq_aa_p99_ratio", "longseq_throughput_ratio",
                           "longseq_aa_throughput_ratio")
    )  # fmt: skip
    if None in (p99, aa, rate, aa_rate):
        return None
    return bool(p99 <= aa + 0.05 and rate >= aa_rate - 0.05)


def run_longseq(
    base: ModelSpec,
    source: Path,
    output: Path,
    grid: LongseqGrid,
    progress: Callable[[str], None] = LOGGER.info,
    seed: int = 41,
    profile: str = "cpu",
) -> tuple[Path, dict[str, Any]]:
    """Measure every workload at every load point; ``summary.json`` and the servers' logs go in a run folder.

    ``profile``: the configs the servers run (``cuda``: the steps' instances on the GPU, Triton's
    CUDA pool); a variant repository has no ``configs/`` folder, so Triton reads its ``config.pbtxt``.
    """
    spec = setup.longseq_spec(base)
    run = output / time.strftime("longseq-%Y%m%d-%H%M%S", time.gmtime())
    run.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    repository = setup.bench_repository(base, spec, source, output, progress)
    users = setup.bench_users(spec, grid.users, seed)
    wires = _requests(spec, users, grid.rows)
    requests = {name: _split(wire, grid.rows, spec.name) for name, wire in wires.items()}
    results: dict[str, Any] = {"points": [], "outcomes": {}, "builder": None, "notes": []}
    with tempfile.TemporaryDirectory(prefix="recserve-longseq-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        local = configs.write_variant(spec, repository, work / "local", profile)
        states = stack.enter_context(_closing(setup.local_states(spec, local)))
        modes = setup.write_states(spec, repository, users.made, states, FRESH_EVENTS)
        progress(f"[bench-longseq] {users.count} users' states written: {modes}")
        servers: dict[str, TritonServer | None] = {
            "local": stack.enter_context(
                TritonServer(local, Ports.free(), log_path=run / "local.log", config_name=profile)
            )
        }
        servers["redis"] = _redis_server(
            spec, repository, users, work, run, stack, results["notes"], progress, profile
        )
        log = local / spec.user_state.event_path
        events = users.made.event_log(start_ts=time.time() - 3600)
        keep = events.seqs <= users.made.rows.lengths[events.users - users.made.first_user] - FRESH_EVENTS
        append_events(log, Events(events.users[keep], events.seqs[keep], events.items[keep], events.ts[keep]))
        builder = BuilderProcess(repository / setup.SPEC_FILE, repository, local, work / "builder.json")
        stack.callback(builder.stop)
        took = builder.wait_built(local / spec.user_state.local_path, users.count, spec.user_state.ttl_s)
        progress(f"[bench-longseq] builder took in the log in {took:.0f} s")
        builder.pause()
        feed = EventFeed(log, users.made, states, grid.event_rate, seed)
        server_of = {
            name: server
            for name in WORKLOADS
            if (server := servers["redis" if name == W2_REDIS else "local"]) is not None
        }
        active = list(server_of)
        for name in active:
            warm(server_of[name].grpc_url, requests[name])
        for rate in grid.rates:
            phases: dict[str, list[dict[str, Any]]] = {name: [] for name in active}
            for number in range(grid.rounds):
                for name in round_order(active, number):
                    server = server_of[name]
                    before = snapshot(server.http_url)
                    if name == W2_BUILDER:
                        builder.resume()
                        feed.start()
                    phase = offer(server.grpc_url, requests[name], rate, grid.seconds)
                    if name == W2_BUILDER:
                        feed.stop()
                        builder.pause()
                    steps = difference(before, snapshot(server.http_url), STEPS)
                    figures: dict[str, Any] = phase.figures()
                    figures["request_bytes"] = requests[name].request_bytes
                    figures["steps"] = [s.as_dict() for s in steps]
                    phases[name].append(figures)
            point = _point_summary(rate, grid, phases)
            point["targets_met"] = _targets_met(point)
            results["points"].append(point)
            progress(f"[bench-longseq] {rate:g} requests/s: {_describe_point(point)}")
        time.sleep(1.2)  # the outcome counters are published at most once a second
        for name, server in servers.items():
            if server is not None:
                warm(server.grpc_url, requests[W2_REDIS if name == "redis" else W2])
                results["outcomes"][name] = _outcomes(server)
        results["builder"] = feed.summary()
        builder.stop()
        if (work / "builder.json").exists():
            results["builder"]["report"] = json.loads((work / "builder.json").read_text())
    progress("[bench-longseq] accuracy: exact and clustered states against the full-length attention")
    held_out = setup.bench_users(spec, grid.error_users, seed + 1).made
    results["error"] = measure_error(spec, repository, held_out, grid.error_users // 2)
    summary = _summary(results, grid, base, time.monotonic() - started)
    summary["run"] |= {"profile": profile, "folder": str(run)}
    (run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return run, summary


def _redis_server(
    spec: ModelSpec, repository: Path, users: setup.BenchUsers, work: Path, run: Path, stack: ExitStack,
    notes: list[str], progress: Callable[[str], None], profile: str,
) -> TritonServer | None:  # fmt: skip
    """A server whose states live only in a loopback Redis Cluster (None, with a note, without Redis)."""
    from recserve.perf.harness.redis_cluster import RedisCluster

    try:
        cluster = stack.enter_context(RedisCluster(work / "redis"))
    except (RuntimeError, OSError) as exc:
        notes.append(f"w2_redis not measured: {exc}")
        progress(f"[bench-longseq] {notes[-1]}")
        return None
    variant = setup.redis_variant(spec, cluster.nodes, cluster.password_env)
    folder = configs.write_variant(variant, repository, work / "redis_variant", profile)
    writer = replace(variant.user_state, deadline_ms=2000.0)
    states = stack.enter_context(_closing(open_user_states(writer, variant.store, folder)))
    setup.write_states(variant, repository, users.made, states, FRESH_EVENTS)
    for attempt in (1, 2):  # the step connects under [user_state] deadline_ms: a busy machine may miss it
        try:
            return stack.enter_context(
                TritonServer(folder, Ports.free(), log_path=run / f"redis{attempt}.log", config_name=profile)
            )
        except ServerProcessError as exc:
            reason = str(exc).splitlines()[-1] if str(exc) else type(exc).__name__
            progress(f"[bench-longseq] the Redis-backed server did not load (try {attempt}): {reason}")
    notes.append(
        "w2_redis not measured: its server did not load twice (the states' Redis connection timed out)"
    )
    return None


class _closing:
    """A store closed at exit (if it has ``close``)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __enter__(self) -> Any:
        return self.store

    def __exit__(self, *exc: object) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            close()


def _hit_rate(outcomes: dict[str, float]) -> float | None:
    total = sum(outcomes.values())
    return outcomes.get("hit", 0.0) / total if total else None


def _summary(results: dict[str, Any], grid: LongseqGrid, base: ModelSpec, seconds: float) -> dict[str, Any]:
    last = results["points"][-1]
    error = results["error"]
    keys = (
        "longseq_p99_ratio",
        "longseq_aa_p99_ratio",
        "longseq_throughput_ratio",
        "longseq_aa_throughput_ratio",
    )
    met = [p["targets_met"] for p in results["points"]]
    return {
        **{k: last[k] for k in keys},
        "longseq_exact_max_abs": error["longseq_exact_max_abs"],
        "longseq_targets_met": None if None in met else all(met),
        "longseq_hit_rate": {name: _hit_rate(o) for name, o in results["outcomes"].items()},
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


def _describe_point(point: dict[str, Any]) -> str:
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
