"""``recserve lab ...``: measurements and experiments on private loopback servers, not needed to serve.

``soak``, ``overload``, ``redis-outage``, ``tune``, ``store-bench``, ``dense-bench``, ``hops``, ``fuzz``,
``chaos``, ``candidate-lists``, ``queue-stall``, ``device-ops``, ``degrade``, ``versions`` and
``stages``. Those of :data:`FLAT_NAMES` used to be top-level commands; it maps those old names to the
new ones, which :mod:`recserve.commands.main` keeps as hidden aliases.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from recserve.core.spec.parse import load_spec

#: the old top-level name of each lab command -> its name under ``recserve lab``
FLAT_NAMES = {
    "soak": "soak",
    "overload": "overload",
    "redis-outage": "redis-outage",
    "tune": "tune",
    "bench-store": "store-bench",
    "bench-dense": "dense-bench",
    "bench-hops": "hops",
    "bench-candidates": "candidate-lists",
    "bench-queues": "queue-stall",
}


def _bench_dense(args: argparse.Namespace) -> int:
    from recserve.perf.lab.dense_bench import run_dense_bench

    print(
        run_dense_bench(
            load_spec(args.spec),
            args.repository,
            device=args.device,
            threads=args.threads,
            rounds=args.rounds,
            budget_s=args.budget_ms / 1e3,
            output=args.output,
        )
    )
    return 0


def _stages(args: argparse.Namespace) -> int:
    import tempfile

    from recserve.perf.lab.stage_budget import stages_command

    with tempfile.TemporaryDirectory(prefix="recserve-stages-") as scratch:
        return stages_command(load_spec(args.spec), args.repository, Path(scratch), args.requests, args.json)


def _workloads(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(b), int(c)) for b, c in (item.split("x") for item in text.split(",") if item.strip()))


def _tune(args: argparse.Namespace) -> int:
    from recserve.build.repository import is_built
    from recserve.core.spec.parse import spec_path
    from recserve.perf.lab.tune import DEFAULT_WORKLOADS, admission_cap, run_tune

    spec = load_spec(args.spec)
    if not is_built(spec, args.repository):
        print(f"error: {args.repository} is not built from this spec; run 'recserve build'", file=sys.stderr)
        return 2
    best, trials = run_tune(
        spec,
        spec_path(args.spec),
        args.repository,
        args.p99_ms,
        args.workloads or DEFAULT_WORKLOADS,
        args.measurement_ms,
        write=not args.no_write,
        progress=lambda m: print(m, file=sys.stderr),
    )
    for trial in trials:
        marker = "*" if best is not None and trial.plan == best.plan else " "
        capacity = {b: round(v) for b, v in trial.capacity(args.p99_ms).items()}
        print(
            f"{marker} score {trial.score(args.p99_ms):7.0f}  "
            f"rows/s under p99 by batch {capacity}  {trial.plan}"
        )
    if best is not None:
        cap = admission_cap(best, args.p99_ms)
        print(f"in-flight cap per replica for the access layer ([access] max_requests): {cap}")
    if best is None:
        print(
            f"no plan met p99 <= {args.p99_ms} ms at every client batch size; the spec is unchanged",
            file=sys.stderr,
        )
        return 1
    return 0


def _soak(args: argparse.Namespace) -> int:
    from recserve.perf.lab.soak import soak_command

    return soak_command(load_spec(args.spec), args.repository, args.duration, args.update_every)


def _overload(args: argparse.Namespace) -> int:
    if args.access:
        from recserve.perf.lab.access_overload import access_overload_command

        return access_overload_command(
            load_spec(args.spec),
            args.repository,
            args.rows,
            args.spike,
            args.seconds,
            args.json,
            args.max_requests,
        )
    from recserve.perf.lab.overload import overload_command

    return overload_command(
        load_spec(args.spec), args.repository, args.rows, args.spike, args.seconds, args.queue, args.json
    )


def _degrade(args: argparse.Namespace) -> int:
    from recserve.perf.lab.degrade import degrade_command

    overrides = {} if args.headroom is None else {"headroom": args.headroom}
    if args.learned_capacity:
        overrides["capacity"] = 0.0  # not the lab's measured capacity: learned from the first backlog
    return degrade_command(
        load_spec(args.spec),
        args.repository,
        args.quick,
        args.json,
        args.plot,
        args.workdir,
        args.costs,
        overrides,
        args.access,
    )


def _later(module: str) -> Callable[[argparse.Namespace], int]:
    """A command run by ``module``'s ``run_from_args``, imported when it runs (it imports torch)."""
    return lambda args: importlib.import_module(module).run_from_args(args)


def _bench_hops(args: argparse.Namespace) -> int:
    from recserve.perf.bench.hops import hops_command

    return hops_command(
        load_spec(args.spec), args.repository, args.requests, args.rounds, args.json, args.cpu_seconds
    )


def _bench_candidates(args: argparse.Namespace) -> int:
    from recserve.perf.bench.candidates import candidates_command

    return candidates_command(
        load_spec(args.spec), args.repository, args.candidates, args.history, args.rounds, args.json
    )


def _bench_queues(args: argparse.Namespace) -> int:
    from recserve.perf.lab.queue_stall import queue_stall_command

    policies = tuple(p for p in args.policies.split(",") if p)
    spec = load_spec(args.spec)
    return queue_stall_command(
        spec, args.repository, policies, args.concurrency, args.seconds, args.rounds, args.json
    )


def _redis_outage(args: argparse.Namespace) -> int:
    from recserve.perf.lab.redis_outage import outage_command

    return outage_command(
        load_spec(args.spec), args.repository, args.requests, args.rounds, args.batch_size, args.deadline_ms
    )


def add_commands(lab: argparse._SubParsersAction) -> None:
    """Add the lab commands to the sub-command parser of ``recserve lab``."""
    soak = lab.add_parser(
        "soak",
        help="bounded mixed traffic with periodic dense updates on a private loopback server; fails on leaks",
    )
    soak.add_argument("--repository", type=Path, default=None, help="copied; the copy gets the updates")
    soak.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    soak.add_argument(
        "--update-every", type=float, default=10.0, help="seconds between dense version updates"
    )
    soak.set_defaults(func=_soak)

    overload = lab.add_parser(
        "overload", help="open-loop spike above measured capacity on a private loopback server"
    )
    overload.add_argument("--repository", type=Path, default=None)
    overload.add_argument("--rows", type=int, default=8, help="rows per request")
    overload.add_argument("--spike", type=float, default=2.0, help="spike rate as a multiple of capacity")
    overload.add_argument(
        "--seconds", type=float, default=5.0, help="length of the half-capacity and spike phases"
    )
    overload.add_argument(
        "--queue",
        default="latency_first",
        help="queue policy of the spec to serve; 'default': [serving.queue] (with --access: [access])",
    )
    overload.add_argument(
        "--access",
        action="store_true",
        help="send through the Envoy access layer (in-flight cap from [access]; Triton's queues unbounded)",
    )
    overload.add_argument(
        "--max-requests", type=int, default=None, help="with --access: the proxy's in-flight cap per replica"
    )
    overload.add_argument("--json", type=Path, default=None, help="also write the summary as JSON here")
    overload.set_defaults(func=_overload)

    degrade = lab.add_parser(
        "degrade",
        help="a 2x and 4x spike of valued candidate lists, shed-only and with [degrade], side by side",
    )
    degrade.add_argument("--repository", type=Path, default=None)
    degrade.add_argument("--quick", action="store_true", help="the short form CI runs (under a minute)")
    degrade.add_argument("--json", type=Path, default=None, help="also write the summary as JSON here")
    degrade.add_argument("--plot", type=Path, default=None, help="a PNG of lambda, p99 and levels over time")
    degrade.add_argument(
        "--workdir", type=Path, default=None, help="keep the servers' logs here (default: a temporary folder)"
    )
    degrade.add_argument(
        "--costs", action="store_true", help="also measure each level's capacity and cost against full"
    )
    degrade.add_argument(
        "--headroom",
        type=float,
        default=None,
        help="[degrade] headroom for the degrade server (default: 0.9)",
    )
    degrade.add_argument(
        "--learned-capacity",
        action="store_true",
        help="leave the degrade server's [degrade] capacity at 0 (learned from its first backlog) instead "
        "of the capacity the lab measured",
    )
    degrade.add_argument(
        "--access",
        action="store_true",
        help="serve both policies through the access layer (Envoy on the load generator's core): the "
        "degrade server's refusals by value are then made by the proxy's door, before its queue",
    )
    degrade.set_defaults(func=_degrade)

    outage = lab.add_parser(
        "redis-outage",
        help=(
            "ctr p50/p99 with the L3 Redis Cluster up, all of it killed, and back (private loopback servers)"
        ),
    )
    outage.add_argument("--repository", type=Path, default=None, help="copied; its item table goes to Redis")
    outage.add_argument(
        "--requests", type=int, default=1000, help="requests per phase and round, one at a time"
    )
    outage.add_argument("--rounds", type=int, default=3, help="times Redis goes down and comes back")
    outage.add_argument("--batch-size", type=int, default=16, help="rows per request")
    outage.add_argument(
        "--deadline-ms", type=float, default=None, help="L3 deadline (default: the spec's redis_deadline_ms)"
    )
    outage.set_defaults(func=_redis_outage)

    hops = lab.add_parser(
        "hops", help="the served ensemble against echo ensembles of its shape (the hop floor), batch 1"
    )
    hops.add_argument("--requests", type=int, default=300, help="batch-1 requests per system and round")
    hops.add_argument("--rounds", type=int, default=3, help="the systems take turns; medians over rounds")
    hops.add_argument("--json", type=Path, default=None, help="also write the summary here")
    hops.add_argument(
        "--cpu-seconds",
        type=float,
        default=0.0,
        help="also measure each process's CPU per request, served and echo, 1 and 16 in flight, this long",
    )
    hops.add_argument("--repository", type=Path, default=None)
    hops.set_defaults(func=_bench_hops)

    stages = lab.add_parser("stages", help="one request's time stage by stage, batch 1 and 64 (µs)")
    stages.add_argument("--requests", type=int, default=500, help="requests per batch size, one in flight")
    stages.add_argument("--json", type=Path, default=None, help="also write the figures here")
    stages.add_argument("--repository", type=Path, default=None)
    stages.set_defaults(func=_stages)

    lists = lab.add_parser(
        "candidate-lists",
        help="one user's candidate list against the same rows sent as rows (candidate_list_gain)",
    )
    lists.add_argument("--candidates", type=int, default=200, help="candidates of the one user")
    lists.add_argument("--history", type=int, default=256, help="the user's history length")
    lists.add_argument("--rounds", type=int, default=3, help="the forms take turns; medians over rounds")
    lists.add_argument("--json", type=Path, default=None, help="also write the summary here")
    lists.add_argument("--repository", type=Path, default=None)
    lists.set_defaults(func=_bench_candidates)

    queues = lab.add_parser(
        "queue-stall",
        help="the served configs against queue policies, batch-1 closed loop: how often a batcher sleeps",
    )
    queues.add_argument(
        "--policies",
        default="throughput_first",
        help="queue policies of the spec, comma-separated",
    )
    queues.add_argument("--concurrency", type=int, default=16, help="batch-1 requests in flight")
    queues.add_argument("--seconds", type=float, default=6.0, help="per configuration and round")
    queues.add_argument("--rounds", type=int, default=6, help="the configurations take turns")
    queues.add_argument("--json", type=Path, default=None, help="also write the summary here")
    queues.add_argument("--repository", type=Path, default=None)
    queues.set_defaults(func=_bench_queues)

    bench = lab.add_parser(
        "dense-bench", help="dense step: bucketed runner vs the bare graphs, per bucket (ratios)"
    )
    bench.add_argument("--repository", type=Path, default=None)
    bench.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: ONNX Runtime; cuda: CUDA graphs"
    )
    bench.add_argument("--threads", type=int, default=1, help="intra-op threads per ONNX Runtime session")
    bench.add_argument(
        "--rounds", type=int, default=30, help="interleaved rounds per shape (the best is kept)"
    )
    bench.add_argument("--budget-ms", type=float, default=10.0, help="time per variant per round")
    bench.add_argument(
        "--output", type=Path, default=None, help="also write the per-bucket table as CSV here"
    )
    bench.set_defaults(func=_bench_dense)

    tune = lab.add_parser(
        "tune",
        help="sweep queue delay, preferred batch size and instances; write the best (and the access "
        "layer's in-flight cap) to the spec",
    )
    tune.add_argument("--repository", type=Path, default=None)
    tune.add_argument("--p99-ms", type=float, default=50.0, help="p99 target")
    tune.add_argument(
        "--workloads",
        type=_workloads,
        default=None,
        help="client batch x concurrency ladder, e.g. 1x4,1x8,1x16,64x1,64x2,64x4 (the default)",
    )
    tune.add_argument("--measurement-ms", type=int, default=2000)
    tune.add_argument("--no-write", action="store_true", help="report only; leave the spec and configs alone")
    tune.set_defaults(func=_tune)

    from recserve.perf.lab import store_bench

    bench = lab.add_parser(
        "store-bench", help="store lookups/s vs the numpy take floor, hit rates, memory, warm-up"
    )
    store_bench.add_arguments(bench)
    bench.set_defaults(func=store_bench.run_from_args)

    counter = lab.add_parser(
        "device-ops",
        help="torch operators and host synchronisations per batch of the device path (lookup, dense)",
    )
    counter.add_argument("--json", type=Path, default=None, help="write the counts to this JSON file")
    counter.add_argument("--device", default="cpu", help="torch device of the steps (default: cpu)")
    counter.set_defaults(func=_later("recserve.perf.lab.device_ops"))

    from recserve.perf.lab.fuzz import run as fuzz

    fuzzer = lab.add_parser(
        "fuzz",
        help="seeded JSON inference bodies through the proxy to supervised servers (crashes, valid failed)",
    )
    fuzz.add_arguments(fuzzer)
    fuzzer.set_defaults(func=fuzz.run_from_args)

    killer = lab.add_parser(
        "chaos", help="kill each kind of process of the stack under bounded load (seconds to served again)"
    )
    killer.add_argument(
        "--repository", type=Path, default=None, help="copied; the copy's item table goes to Redis"
    )
    killer.add_argument("--replicas", type=int, default=2, help="tritonservers behind the proxy")
    killer.add_argument("--rate", type=float, default=40.0, help="requests per second through the proxy")
    killer.add_argument("--json", type=Path, default=None, help="also write the figures here")
    killer.set_defaults(func=_later("recserve.perf.lab.chaos"))

    from recserve.perf.lab import versions_ab

    versions = lab.add_parser(
        "versions", help="today's server against another checkout's, taking turns: batch-1 p50/p99, rows/s"
    )
    versions_ab.add_arguments(versions)
    versions.set_defaults(func=versions_ab.run_from_args)
