"""The ``recserve`` command: build, serve, predict, perf."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from recserve import wire
from recserve.backends.dense.tensorrt_engine import PRECISIONS
from recserve.spec import DEFAULT_SPEC, load_spec

DEFAULT_REPOSITORY = Path("model_repository")
ADMIN_KEY_ENV = "RECSERVE_ADMIN_KEY"


def _build(args: argparse.Namespace) -> int:
    from recserve.build.repository import add_tensorrt_engine, build_repository, install_adapters, is_built

    spec = load_spec(args.spec)
    if args.if_missing and is_built(spec, args.repository):
        install_adapters(spec, args.repository)  # code, not artifacts: always the installed version
        print(
            f"[build] {args.repository} is already built from spec {spec.name!r}; adapters refreshed",
            file=sys.stderr,
        )
    else:
        build_repository(spec, args.repository)
    if args.profile == "gpu":
        add_tensorrt_engine(spec, args.repository, args.precision)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os

    from recserve.server import (
        MpsDaemon,
        Ports,
        Security,
        ServerError,
        TritonServer,
        require_gpu,
        run_child,
        run_foreground,
        runtime_dir,
        server_command,
        server_env,
    )  # fmt: skip

    if not (args.repository / wire.DENSE).is_dir():
        print(f"error: {args.repository} holds no built model; run 'recserve build'", file=sys.stderr)
        return 2
    if args.mps and args.profile == "cpu":
        print(
            "error: --mps shares a GPU between instances; use it with --profile gpu or cuda", file=sys.stderr
        )
        return 2
    try:
        security = Security(
            args.model_control, os.environ.get(ADMIN_KEY_ENV) or None, args.client_shared_memory
        )
        ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
        extra = []
        if args.queue and (
            args.profile != "cpu"
            or not (args.repository / wire.FEATURE_TRANSFORM / "configs" / f"{args.queue}.pbtxt").is_file()
        ):
            print(
                f"error: no queue profile {args.queue!r} in {args.repository} (queue profiles are cpu configs)",
                file=sys.stderr,
            )
            return 2
        if args.profile != "cpu":
            print(f"GPUs: {', '.join(require_gpu())}", file=sys.stderr)
        if args.profile != "cpu" or args.queue:  # <model>/configs/<name>.pbtxt where present
            extra.append(f"--model-config-name={args.queue or args.profile}")
        command = server_command(args.repository, ports, args.host, extra, security=security)
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if security.model_control == "explicit" and args.profile != "cpu":
        print("error: --model-control explicit serves the cpu profile only", file=sys.stderr)
        return 2
    print(
        f"starting tritonserver on {args.host}: HTTP {args.http_port}, gRPC {args.grpc_port}, metrics {args.metrics_port}",
        file=sys.stderr,
    )
    if security.model_control == "explicit":  # stay as the parent: the stub watchdog needs the admin API
        return run_foreground(
            TritonServer(args.repository, ports, host=args.host, security=security, config_name=args.queue)
        )
    if not args.mps:
        os.execve(command[0], command, server_env())  # tritonserver takes over: Ctrl-C stops it
    try:
        with MpsDaemon(runtime_dir().parent / "mps") as mps:  # pipes and logs beside the server runtime
            return run_child(command, mps.env(server_env()))
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _predict(args: argparse.Namespace) -> int:
    from recserve.clients import CTRClient, RecserveClientError, read_rows

    spec = load_spec(args.spec)
    try:
        rows = read_rows(args.input, spec)
        with CTRClient(args.url, protocol=args.protocol, timeout_s=args.timeout, spec=spec) as client:
            probabilities = client.predict(rows, batch_size=args.batch_size)
    except (RecserveClientError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("".join(f"{p:.6f}\n" for p in probabilities))
    return 0


def _sample(args: argparse.Namespace) -> int:
    from recserve.build.synthetic import generate
    from recserve.clients.rows import write_csv, write_tsv

    spec = load_spec(args.spec)
    writer = write_csv if args.output.suffix == ".csv" else write_tsv
    writer(args.output, generate(spec, args.rows, args.seed), spec, with_label=not args.no_label)
    print(f"wrote {args.rows} rows to {args.output}", file=sys.stderr)
    return 0


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
    )


def _bench_dense(args: argparse.Namespace) -> int:
    from recserve.perf.dense_bench import run_dense_bench

    print(
        run_dense_bench(
            load_spec(args.spec), args.repository, device=args.device, threads=args.threads, rounds=args.rounds,
            budget_s=args.budget_ms / 1e3, output=args.output,
        )
    )  # fmt: skip
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
        "client_batches": args.batch_sizes, "concurrencies": args.concurrency, "measurement_ms": args.measurement_ms,
    }  # fmt: skip
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
    from recserve.perf.tune import DEFAULT_WORKLOADS, run_tune
    from recserve.spec import spec_path

    spec = load_spec(args.spec)
    if not is_built(spec, args.repository):
        print(f"error: {args.repository} is not built from this spec; run 'recserve build'", file=sys.stderr)
        return 2
    best, trials = run_tune(
        spec, spec_path(args.spec), args.repository, args.p99_ms, args.workloads or DEFAULT_WORKLOADS, args.measurement_ms,
        write=not args.no_write, progress=lambda m: print(m, file=sys.stderr),
    )  # fmt: skip
    for trial in trials:
        marker = "*" if best is not None and trial.plan == best.plan else " "
        capacity = {b: round(v) for b, v in trial.capacity(args.p99_ms).items()}
        print(
            f"{marker} score {trial.score(args.p99_ms):7.0f}  rows/s under p99 by batch {capacity}  {trial.plan}"
        )
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
    from recserve.perf.overload import overload_command

    return overload_command(
        load_spec(args.spec), args.repository, args.rows, args.spike, args.seconds, args.queue
    )


def _redis_outage(args: argparse.Namespace) -> int:
    from recserve.perf.redis_outage import outage_command

    return outage_command(
        load_spec(args.spec), args.repository, args.requests, args.rounds, args.batch_size, args.deadline_ms
    )


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``recserve``."""
    top = argparse.ArgumentParser(prog="recserve", description=__doc__)
    top.add_argument("--spec", default=DEFAULT_SPEC, help="bundled spec name or path to a spec .toml")
    sub = top.add_subparsers(dest="command", required=True)

    build = sub.add_parser("build", help="train, export and write the model repository")
    build.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    build.add_argument("--if-missing", action="store_true", help="skip when already built from this spec")
    build.add_argument(
        "--profile", choices=("cpu", "gpu"), default="cpu", help="gpu: also build the dense TensorRT engine"
    )
    build.add_argument("--precision", choices=PRECISIONS, default="fp32", help="TensorRT engine precision")
    build.set_defaults(func=_build)

    serve = sub.add_parser("serve", help="run tritonserver on the repository (foreground, Ctrl-C stops)")
    serve.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument(
        "--profile",
        choices=("cpu", "gpu", "cuda"),
        default="cpu",
        help="gpu / cuda: serve the configs/<profile>.pbtxt variants (KIND_GPU instances; needs a GPU)",
    )
    serve.add_argument(
        "--queue", help="serve a queue profile of the spec ([serving.queue_profiles], e.g. latency_first)"
    )
    serve.add_argument(
        "--mps", action="store_true", help="run the NVIDIA MPS control daemon for the server's lifetime"
    )
    serve.add_argument(
        "--model-control",
        choices=("none", "explicit"),
        default="none",
        help=f"'explicit': models can be (re)loaded by callers sending the {ADMIN_KEY_ENV} value "
        "in the recserve-admin-key header (required then)",
    )
    serve.add_argument(
        "--client-shared-memory",
        action="store_true",
        help="let every client register shared memory (locked by default)",
    )
    serve.set_defaults(func=_serve)

    predict = sub.add_parser(
        "predict", help="score Criteo rows (TSV or CSV with header); one probability per line"
    )
    predict.add_argument("--input", type=Path, required=True)
    predict.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 gRPC, :8000 HTTP)")
    predict.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    predict.add_argument("--batch-size", type=int, default=64)
    predict.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    predict.set_defaults(func=_predict)

    sample = sub.add_parser(
        "sample", help="write synthetic rows in the spec's schema (.csv with header, else TSV)"
    )
    sample.add_argument("--output", type=Path, required=True)
    sample.add_argument("--rows", type=int, default=20)
    sample.add_argument("--seed", type=int, default=1)
    sample.add_argument("--no-label", action="store_true")
    sample.set_defaults(func=_sample)

    perf = sub.add_parser("perf", help="run perf_analyzer against the ensemble with spec-derived data")
    perf.add_argument("--url", default=None)
    perf.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    perf.add_argument("--batch-size", type=int, default=1)
    perf.add_argument("--concurrency", default="1:4", help="perf_analyzer concurrency range start:end[:step]")
    perf.add_argument("--measurement-ms", type=int, default=3000)
    perf.add_argument("--output", type=Path, default=None, help="also write the measured points as CSV here")
    perf.add_argument(
        "--repository", type=Path, default=DEFAULT_REPOSITORY, help="for the in-process comparison"
    )
    perf.add_argument("--no-inprocess", action="store_true", help="skip the in-process comparison")
    perf.set_defaults(func=_perf)

    soak = sub.add_parser(
        "soak",
        help="bounded mixed traffic with periodic dense updates on a private loopback server; fails on leaks",
    )
    soak.add_argument(
        "--repository", type=Path, default=DEFAULT_REPOSITORY, help="copied; the copy gets the updates"
    )
    soak.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    soak.add_argument(
        "--update-every", type=float, default=10.0, help="seconds between dense version updates"
    )
    soak.set_defaults(func=_soak)

    overload = sub.add_parser(
        "overload", help="open-loop spike above measured capacity on a private loopback server"
    )
    overload.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    overload.add_argument("--rows", type=int, default=8, help="rows per request")
    overload.add_argument("--spike", type=float, default=2.0, help="spike rate as a multiple of capacity")
    overload.add_argument(
        "--seconds", type=float, default=5.0, help="length of the half-capacity and spike phases"
    )
    overload.add_argument(
        "--queue",
        default="latency_first",
        help="queue profile of the spec to serve; 'default': [serving.queue]",
    )
    overload.set_defaults(func=_overload)

    outage = sub.add_parser(
        "redis-outage",
        help="ctr p50/p99 with the L3 Redis Cluster up, all of it killed, and back (private loopback servers)",
    )
    outage.add_argument(
        "--repository", type=Path, default=DEFAULT_REPOSITORY, help="copied; its item table goes to Redis"
    )
    outage.add_argument(
        "--requests", type=int, default=1000, help="requests per phase and round, one at a time"
    )
    outage.add_argument("--rounds", type=int, default=3, help="times Redis goes down and comes back")
    outage.add_argument("--batch-size", type=int, default=16, help="rows per request")
    outage.add_argument(
        "--deadline-ms", type=float, default=None, help="L3 deadline (default: the spec's redis_deadline_ms)"
    )
    outage.set_defaults(func=_redis_outage)

    from recserve.store_cli import add_commands

    add_commands(sub)

    bench = sub.add_parser(
        "bench-dense", help="dense step: bucketed runner vs the bare graphs, per bucket (ratios)"
    )
    bench.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
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
    bench.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
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
        "tune", help="sweep queue delay, preferred batch size and instances; write the best to the spec"
    )
    tune.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
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
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``recserve`` console script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    from recserve.errors import ArtifactError

    try:
        return int(args.func(args) or 0)
    except (ArtifactError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
