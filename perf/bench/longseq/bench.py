"""``recserve bench-longseq``: 4,096-event users through a state against today's 256-event rows.

One run, the workloads interleaved at each load point with the same users and the same offered
load (requests of ``rows`` rows at ``rate`` per second, :mod:`.load`), round after round.
In each round ``w0``, ``w0_aa`` and the ``w2`` workloads but ``w2_builder`` share one stream,
interleaved request by request in a new order each cycle, so that the machine's drift from second
to second reaches them alike; ``w1`` and ``w2_builder`` each run alone (the blocks' order changes
from round to round):

* ``w0``: today: every row a full 256-event history (each user's newest 256 events), no user;
* ``w0_aa``: the same requests again: the A/A control for a noisy machine;
* ``w1``: the naive path: every row all 4,096 events, through the 4,096 sequence bucket;
* ``w2``: ``user_id`` and ``user_seq`` with the newest 64 events; every user's state stored
  (built from all but the newest 8 events), read through the step's cache;
* ``w2_redis``: the same requests to a second server whose states live only in a loopback Redis
  Cluster (no local cache: every request reads Redis);
* ``w2_miss``: as ``w2`` with one row in ten a user without a state (served from its tail alone);
* ``w2_builder``: as ``w2`` while ``recserve user-state run`` rebuilds states from new events.

Per workload and load point: p50/p99 latency, rows/s and request bytes, medians over the rounds,
and the steps' times (Triton's statistics; a mixed workload's from one phase of its own after the
rounds); the ratios per round, then their median. The states' outcomes
(hit, miss, ...) come from each server's metrics, the builder's lag from outside it (the store the
servers read). The accuracy figures (:mod:`.error`) are measured in process on held-out
users. ``summary.json`` (and ``--json``) carry ``longseq_p99_ratio`` (w2 / w0),
``longseq_aa_p99_ratio`` (w0_aa / w0), ``longseq_throughput_ratio``, ``longseq_aa_throughput_ratio``
(at the highest load point; every point is in ``points``) and ``longseq_exact_max_abs``.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from recserve.backends.store.user_state.events import Events, append_events
from recserve.backends.store.user_state.states import open_user_states
from recserve.build import configs
from recserve.core.names import IDS_WIRE, STEPS
from recserve.core.spec.model import ModelSpec
from recserve.perf.bench.longseq import report as report
from recserve.perf.bench.longseq import setup as setup
from recserve.perf.bench.longseq.builder import BuilderProcess, EventFeed
from recserve.perf.bench.longseq.error import FRESH_EVENTS, measure_error
from recserve.perf.bench.longseq.load import Requests, offer, round_order, warm
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
#: Sent interleaved, request by request, in one stream per round. w1 and w2_builder each run alone:
#: w1's long requests would delay whichever request follows them, and the builder runs beside
#: w2_builder only.
MIXED = (W0, W0_AA, W2, W2_REDIS, W2_MISS)
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
    #: False: every workload in a phase of its own, as until 2026-11-27 (the A/A spread to compare)
    mixed: bool = True

    @classmethod
    def quick(cls) -> LongseqGrid:
        """One load point, two rounds of 2 s: under 30 s of load, for CI."""
        return cls(rates=(25.0,), users=64, rounds=2, seconds=2.0, error_users=128)


def workload_wires(spec: ModelSpec, users: setup.BenchUsers) -> dict[str, dict[str, np.ndarray]]:
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


def _point_summary(
    rate: float,
    grid: LongseqGrid,
    phases: dict[str, list[dict[str, Any]]],
    steps: dict[str, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Medians over the rounds; ``steps``: the steps' times of the mixed workloads (each alone once)."""
    workloads: dict[str, dict[str, Any]] = {}
    for name, rounds in phases.items():
        keys = [k for k in rounds[0] if k != "steps"]
        workloads[name] = {k: _median([r[k] for r in rounds]) for k in keys}
        workloads[name]["steps"] = (steps or {}).get(name) or rounds[-1]["steps"]
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
    wires = workload_wires(spec, users)
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
        blocks = round_blocks(active, grid.mixed)
        together = blocks[0] if len(blocks[0]) > 1 else ()
        stage = _Stage(server_of, requests, builder, feed, grid.seconds)
        for point_number, rate in enumerate(grid.rates):
            phases: dict[str, list[dict[str, Any]]] = {name: [] for name in active}
            for number in range(grid.rounds):
                for block in round_order(blocks, number):
                    for name, figures in stage.run(block, rate, seed=1000 * point_number + number):
                        phases[name].append(figures)
            # each mixed workload alone once, for its steps' times
            steps = {name: stage.run((name,), rate, seed=0)[0][1]["steps"] for name in together}
            point = _point_summary(rate, grid, phases, steps)
            point["targets_met"] = _targets_met(point)
            results["points"].append(point)
            progress(f"[bench-longseq] {rate:g} requests/s: {report.describe_point(point)}")
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
    summary = report.summary(results, grid, base, time.monotonic() - started)
    summary["run"] |= {"profile": profile, "folder": str(run)}
    (run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return run, summary


def round_blocks(active: list[str], mixed: bool) -> list[tuple[str, ...]]:
    """A round's blocks: with ``mixed``, those of MIXED in one stream, then every other workload alone."""
    together = tuple(n for n in active if n in MIXED) if mixed else ()
    return [b for b in (together, *((n,) for n in active if n not in together)) if b]


@dataclass(frozen=True)
class _Stage:
    """What a round's phases run on: the servers, the requests, the builder and its event feed."""

    server_of: dict[str, TritonServer]
    requests: dict[str, Requests]
    builder: BuilderProcess
    feed: EventFeed
    seconds: float

    def run(self, block: tuple[str, ...], rate: float, seed: int) -> list[tuple[str, dict[str, Any]]]:
        """One phase of ``block``: its workloads in one stream, or one workload alone.

        A workload alone also gets its steps' times (Triton's statistics); the builder runs beside
        ``w2_builder`` only.
        """
        url = self.server_of[block[0]].http_url
        before = snapshot(url) if len(block) == 1 else None
        if block == (W2_BUILDER,):
            self.builder.resume()
            self.feed.start()
        streams = {name: (self.server_of[name].grpc_url, self.requests[name]) for name in block}
        phases = offer(streams, rate, self.seconds, seed)
        if block == (W2_BUILDER,):
            self.feed.stop()
            self.builder.pause()
        steps = [s.as_dict() for s in difference(before, snapshot(url), STEPS)] if before is not None else []
        return [
            (name, {**phase.figures(), "request_bytes": self.requests[name].request_bytes, "steps": steps})
            for name, phase in phases.items()
        ]


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
