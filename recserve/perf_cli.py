"""``recserve perf``, ``bench``, ``bench-dense``, ``tune``, ``soak``, ``overload``, ``redis-outage``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recserve.spec import load_spec


def _perf(args: argparse.Namespace) -> int:
    from recserve.perf.analyzer import run_perf

    return run_perf(
        load_spec(args.spec),
        url=args.url,
        protocol=args.protocol,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        measurement_ms=args.measurement_ms,
        output=args.output,
        inprocess_repository=None if args.no_inprocess else args.repository,
        candidates=args.candidates,
    )


def _bench_dense(args: argparse.Namespace) -> int:
    from recserve.perf.dense_bench import run_dense_bench

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


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _bench(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from recserve.build.repository import is_built
    from recserve.perf.bench import Grid, format_result, run_bench

    if args.summarize is not None:  # no measuring: recompute summary.json and plots of a finished run
        from recserve.perf.bench import write_summary
        from recserve.perf.report import read_points

        points = read_points(args.summarize)
        print(format_result(points, write_summary(args.summarize, points)))
        return 0
    spec = load_spec(args.spec)
    if not is_built(spec, args.repository):
        print(f"error: {args.repository} is not built from this spec; run 'recserve build'", file=sys.stderr)
        return 2
    grid = Grid.quick() if args.quick else Grid.full()
    overrides = {
        "client_batches": args.batch_sizes,
        "concurrencies": args.concurrency,
        "measurement_ms": args.measurement_ms,
    }
    grid = replace(
        grid, **{k: v for k, v in overrides.items() if v is not None}, torchserve=not args.no_torchserve
    )
    run, points, summary = run_bench(spec, args.spec, args.repository, args.output, grid, args.run_name)
    print(format_result(points, summary))
    print(f"\nresults in {run}")
    return 0


def _workloads(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(b), int(c)) for b, c in (item.split("x") for item in text.split(",") if item.strip()))


def _tune(args: argparse.Namespace) -> int:
    from recserve.build.repository import is_built
    from recserve.perf.tune import DEFAULT_WORKLOADS, admission_cap, run_tune
    from recserve.spec import spec_path

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
    from recserve.perf.soak import soak_command

    return soak_command(load_spec(args.spec), args.repository, args.duration, args.update_every)


def _overload(args: argparse.Namespace) -> int:
    if args.access:
        from recserve.perf.access_overload import access_overload_command

        return access_overload_command(
            load_spec(args.spec),
            args.repository,
            args.rows,
            args.spike,
            args.seconds,
            args.json,
            args.max_requests,
        )
    from recserve.perf.overload import overload_command

    return overload_command(
        load_spec(args.spec), args.repository, args.rows, args.spike, args.seconds, args.queue, args.json
    )


def _bench_hops(args: argparse.Namespace) -> int:
    from recserve.perf.hops import hops_command

    return hops_command(load_spec(args.spec), args.repository, args.requests, args.rounds, args.json)


def _bench_candidates(args: argparse.Namespace) -> int:
    from recserve.perf.candidates import candidates_command

    return candidates_command(
        load_spec(args.spec), args.repository, args.candidates, args.history, args.rounds, args.json
    )


def _bench_queues(args: argparse.Namespace) -> int:
    from recserve.perf.queue_stall import queue_stall_command

    profiles = tuple(p for p in args.profiles.split(",") if p)
    spec = load_spec(args.spec)
    return queue_stall_command(
        spec, args.repository, profiles, args.concurrency, args.seconds, args.rounds, args.json
    )


def _redis_outage(args: argparse.Namespace) -> int:
    from recserve.perf.redis_outage import outage_command

    return outage_command(
        load_spec(args.spec), args.repository, args.requests, args.rounds, args.batch_size, args.deadline_ms
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add the measurement commands to ``recserve``'s sub-command parser."""
    perf = sub.add_parser("perf", help="run perf_analyzer against the ensemble with spec-derived data")
    perf.add_argument("--url", default=None)
    perf.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    perf.add_argument("--batch-size", type=int, default=1)
    perf.add_argument("--concurrency", default="1:4", help="perf_analyzer concurrency range start:end[:step]")
    perf.add_argument("--measurement-ms", type=int, default=3000)
    perf.add_argument("--output", type=Path, default=None, help="also write the measured points as CSV here")
    perf.add_argument("--repository", type=Path, default=None, help="for the in-process comparison")
    perf.add_argument("--no-inprocess", action="store_true", help="skip the in-process comparison")
    perf.add_argument(
        "--candidates",
        type=int,
        default=0,
        help="send one user's list of this many candidates per request to the candidates ensemble",
    )
    perf.set_defaults(func=_perf)

    soak = sub.add_parser(
        "soak",
        help="bounded mixed traffic with periodic dense updates on a private loopback server; fails on leaks",
    )
    soak.add_argument("--repository", type=Path, default=None, help="copied; the copy gets the updates")
    soak.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    soak.add_argument(
        "--update-every", type=float, default=10.0, help="seconds between dense version updates"
    )
    soak.set_defaults(func=_soak)

    overload = sub.add_parser(
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
        help="queue profile of the spec to serve; 'default': [serving.queue] (with --access: [access])",
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

    outage = sub.add_parser(
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

    hops = sub.add_parser(
        "bench-hops", help="the served ensemble against echo ensembles of its shape (the hop floor), batch 1"
    )
    hops.add_argument("--requests", type=int, default=300, help="batch-1 requests per system and round")
    hops.add_argument("--rounds", type=int, default=3, help="the systems take turns; medians over rounds")
    hops.add_argument("--json", type=Path, default=None, help="also write the summary here")
    hops.add_argument("--repository", type=Path, default=None)
    hops.set_defaults(func=_bench_hops)

    lists = sub.add_parser(
        "bench-candidates",
        help="one user's candidate list against the same rows sent as rows (candidate_list_gain)",
    )
    lists.add_argument("--candidates", type=int, default=200, help="candidates of the one user")
    lists.add_argument("--history", type=int, default=256, help="the user's history length")
    lists.add_argument("--rounds", type=int, default=3, help="the forms take turns; medians over rounds")
    lists.add_argument("--json", type=Path, default=None, help="also write the summary here")
    lists.add_argument("--repository", type=Path, default=None)
    lists.set_defaults(func=_bench_candidates)

    queues = sub.add_parser(
        "bench-queues",
        help="the served configs against queue profiles, batch-1 closed loop: how often a batcher sleeps",
    )
    queues.add_argument("--profiles", default="throughput_first", help="queue profiles, comma-separated")
    queues.add_argument("--concurrency", type=int, default=16, help="batch-1 requests in flight")
    queues.add_argument("--seconds", type=float, default=6.0, help="per configuration and round")
    queues.add_argument("--rounds", type=int, default=6, help="the configurations take turns")
    queues.add_argument("--json", type=Path, default=None, help="also write the summary here")
    queues.add_argument("--repository", type=Path, default=None)
    queues.set_defaults(func=_bench_queues)

    bench = sub.add_parser(
        "bench-dense", help="dense step: bucketed runner vs the bare graphs, per bucket (ratios)"
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

    bench = sub.add_parser(
        "bench", help="in-process bound, naive and tuned Triton, TorchServe: measured in one run"
    )
    bench.add_argument("--repository", type=Path, default=None)
    bench.add_argument(
        "--output", type=Path, default=Path("perf/results"), help="a run folder is created in here"
    )
    bench.add_argument("--run-name", default=None, help="folder name of this run (default: UTC time)")
    bench.add_argument(
        "--quick", action="store_true", help="a smaller grid that still yields every ratio (< 5 min)"
    )
    bench.add_argument("--batch-sizes", type=_ints, default=None, help="client batch sizes, e.g. 1,16,64")
    bench.add_argument(
        "--concurrency", type=_ints, default=None, help="requests in flight, e.g. 1,2,4,8,16,32"
    )
    bench.add_argument("--measurement-ms", type=int, default=None, help="perf_analyzer measurement window")
    bench.add_argument(
        "--no-torchserve", action="store_true", help="skip TorchServe (no install, no peer rows)"
    )
    bench.add_argument(
        "--summarize",
        type=Path,
        default=None,
        metavar="RUN",
        help="only rewrite summary.json and plots of RUN",
    )
    bench.set_defaults(func=_bench)

    tune = sub.add_parser(
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
