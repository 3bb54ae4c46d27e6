"""``recserve serve``, ``predict`` and ``verify``: run the server; score rows through it and in process."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from recserve.commands.spec_source import command_spec
from recserve.core.names import DENSE, IDS_WIRE, PROFILES, STEPS, WIRE_FORMS

ADMIN_KEY_ENV = "RECSERVE_ADMIN_KEY"


def _serve(args: argparse.Namespace) -> int:
    from recserve.server import (
        MpsDaemon,
        Ports,
        Security,
        ServerProcessError,
        TritonServer,
        config_arguments,
        metrics_env,
        require_gpu,
        run_child,
        run_foreground,
        runtime_dir,
        server_command,
        server_env,
    )  # fmt: skip

    if not (args.repository / DENSE).is_dir():
        print(f"error: {args.repository} holds no built model; run 'recserve build'", file=sys.stderr)
        return 2
    if not log_environment(args):
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
        if args.queue and (
            args.profile != "cpu"
            or not (args.repository / STEPS[0] / "configs" / f"{args.queue}.pbtxt").is_file()
        ):
            print(
                f"error: no queue policy {args.queue!r} in {args.repository} "
                "(queue policies are cpu configs)",
                file=sys.stderr,
            )
            return 2
        if args.profile != "cpu":
            print(f"GPUs: {', '.join(require_gpu())}", file=sys.stderr)
        config_name = args.queue or (None if args.profile == "cpu" else args.profile)
        # <model>/configs/<name>.pbtxt where present
        command = server_command(
            args.repository, ports, args.host, config_arguments(config_name), security=security
        )
    except ServerProcessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if security.model_control == "explicit" and args.profile != "cpu":
        print("error: --model-control explicit serves the cpu profile only", file=sys.stderr)
        return 2
    print(
        f"starting tritonserver on {args.host}: HTTP {args.http_port}, gRPC {args.grpc_port}, "
        f"metrics {args.metrics_port}",
        file=sys.stderr,
    )
    if not args.mps:  # stay the parent: restart a server that dies; the stub watchdog needs the admin API
        server = TritonServer(
            args.repository, ports, host=args.host, security=security, config_name=config_name
        )
        try:
            return run_foreground(server, status_path=args.status_file)
        except ServerProcessError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        with MpsDaemon(runtime_dir().parent / "mps") as mps:  # pipes and logs beside the server runtime
            return run_child(command, mps.env({**server_env(), **metrics_env(ports, args.host)}))
    except ServerProcessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _predict(args: argparse.Namespace) -> int:
    from recserve.clients import CTRClient, RecserveClientError, read_rows

    try:
        spec = command_spec(args, server=True)  # without --spec: the one the server serves
        rows = read_rows(args.input, spec)
        with CTRClient(
            args.url, protocol=args.protocol, timeout_s=args.timeout, spec=spec, wire=args.wire
        ) as client:
            score = client.predict_by_user if spec.inputs.user else client.predict
            probabilities = score(rows, batch_size=args.batch_size)
            request_ids = client.last_request_ids
    except (RecserveClientError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.request_ids is not None:  # which request served each row: the log and events name it
        args.request_ids.write_text("".join(f"{rid}\n" for rid in request_ids))
    sys.stdout.write("".join(f"{score_text(p, args.digits)}\n" for p in probabilities))
    return 0


def log_environment(args: argparse.Namespace) -> bool:
    """``--log-dir`` and ``--log-sample-rate`` into the environment the servers inherit; False when bad.

    The steps read them when they load, whatever the spec's ``[logging]`` says.
    """
    from recserve.core.sections.logging import LOG_DIR_ENV, LOG_SAMPLE_RATE_ENV

    if args.log_sample_rate is not None and not 0.0 <= args.log_sample_rate <= 1.0:
        print(f"error: --log-sample-rate lies in 0..1, got {args.log_sample_rate}", file=sys.stderr)
        return False
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        os.environ[LOG_DIR_ENV] = str(args.log_dir.resolve())
        if args.log_sample_rate is not None:
            os.environ[LOG_SAMPLE_RATE_ENV] = repr(args.log_sample_rate)
    return True


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log-dir`` and ``--log-sample-rate`` (``serve`` and ``access``)."""
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="log the requests served (features and scores) as Parquet segments in this folder, "
        "whatever the spec's [logging] says (docs/design/loop.md)",
    )
    parser.add_argument(
        "--log-sample-rate", type=float, default=None, help="with --log-dir: the share of requests logged"
    )


def score_text(score: float, digits: int | None) -> str:
    """A score as ``predict`` prints it: full float32 precision, or ``digits`` decimals.

    Full precision is the shortest decimal text that reads back as the same float32 (``0.12345679``).
    """
    import numpy as np

    if digits is None:
        return np.format_float_positional(np.float32(score), unique=True, trim="-")
    return f"{score:.{digits}f}"


def _verify(args: argparse.Namespace) -> int:
    from recserve import verify
    from recserve.build.repository import reference_pipeline
    from recserve.clients import CTRClient, RecserveClientError, read_rows

    spec = command_spec(args)  # without --spec: the one the repository carries
    if args.log is not None:
        return _verify_log(args, spec)
    if args.rows is None or args.expected is None:
        raise ValueError("verify takes --rows and --expected (your rows and your scores), or --log DIR")
    rows = verify.read_named(args.rows, lambda path: read_rows(path, spec))
    expected = verify.read_named(args.expected, verify.read_expected)
    pipeline = reference_pipeline(spec, args.repository, runtime=args.runtime)
    scores = {f"in process ({args.runtime})": verify.score_in_batches(rows, spec, pipeline.predict)}
    if args.url:
        try:
            with CTRClient(args.url, protocol=args.protocol, spec=spec) as client:
                scores[f"server {args.url}"] = client.predict(rows, batch_size=spec.model.max_batch_size)
        except RecserveClientError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    tolerance = verify.DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    comparisons = [verify.compare(name, s, expected, rows.labels, tolerance) for name, s in scores.items()]
    print(verify.format_report(comparisons, expected, rows.labels))
    failed = [c for c in comparisons if not c.passed]
    for comparison in failed:
        print(
            f"\n{comparison.source}: {comparison.over} rows differ by over {comparison.tolerance:g}; worst:"
        )
        for row in comparison.worst:
            print(f"row {row}: expected {expected[row]:.6f}, got {scores[comparison.source][row]:.6f}")
        print("\n".join(verify.explain_rows(spec, pipeline.lookup.store, rows, comparison.worst)))
    if failed and verify.rounding_note(spec):
        print("\n" + verify.rounding_note(spec))
    return 1 if failed else 0


def _verify_log(args: argparse.Namespace, spec) -> int:
    """``verify --log DIR``: the logged records scored again offline against their logged scores."""
    from recserve.backends.steps.pipeline import InProcessPipeline
    from recserve.backends.store.tiered import TieredStore
    from recserve.build.repository import dense_runners, version_dir
    from recserve.core.names import EMBEDDING_LOOKUP
    from recserve.verify_log import rescore_log

    if not args.log.is_dir():
        raise ValueError(f"--log {args.log}: not a folder")
    dense = dense_runners(spec, args.repository, args.runtime)  # each record by the version that served it
    store = TieredStore.load(version_dir(args.repository, EMBEDDING_LOOKUP, spec), spec)
    pipeline = InProcessPipeline(spec, store, dense[spec.version])  # the built version's loaded once
    check = rescore_log(spec, pipeline.embeddings, dense, args.log)
    tolerance = LOG_TOLERANCE if args.tolerance is None else args.tolerance
    print(
        f"{check.records} logged rows; {check.rescored} scored again ({args.runtime}), "
        f"{check.other_versions} served by other versions than the repository's; "
        f"max |delta| {check.max_abs:.2e} (tolerance {tolerance:g})"
    )
    for request_id, row, logged, rescored in check.worst:
        print(f"  request {request_id} row {row}: logged {logged!r}, scored again {rescored!r}")
    if not check.rescored:
        print("error: no logged row was served by the repository's versions", file=sys.stderr)
        return 1
    return 0 if check.max_abs <= tolerance else 1


#: ``verify --log``'s tolerance: the same features through the same network, so the same score.
LOG_TOLERANCE = 1e-6


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``serve``, ``predict`` and ``verify`` to ``recserve``'s sub-command parser."""
    serve = sub.add_parser(
        "serve", help="run tritonserver on the repository (foreground, restarted when it dies; Ctrl-C stops)"
    )
    serve.add_argument("--repository", type=Path, default=None)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument(
        "--profile",
        choices=PROFILES,
        default="cpu",
        help="gpu / cuda: serve the configs/<profile>.pbtxt variants (KIND_GPU instances; needs a GPU)",
    )
    serve.add_argument(
        "--queue",
        help="shed load in Triton with a queue policy of the spec ([serving.queue_policies]: "
        "throughput_first, latency_first); by default the steps have no queue policy",
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
        "--status-file",
        type=Path,
        default=None,
        help="write the supervisor's counts here as JSON after every death and restart, and as "
        "Prometheus text beside it (.prom)",
    )
    serve.add_argument(
        "--client-shared-memory",
        action="store_true",
        help="let every client register shared memory (locked by default)",
    )
    add_log_arguments(serve)
    serve.set_defaults(func=_serve)

    predict = sub.add_parser(
        "predict", help="score rows of the spec (TSV, or CSV with a header); one probability per line"
    )
    predict.add_argument("--input", type=Path, required=True)
    predict.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 gRPC, :8000 HTTP)")
    predict.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    predict.add_argument("--batch-size", type=int, default=64)
    predict.add_argument(
        "--digits",
        type=int,
        default=None,
        help="decimals per score (default: full float32 precision, as served)",
    )
    predict.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    predict.add_argument(
        "--wire",
        choices=WIRE_FORMS,
        default=IDS_WIRE,
        help="categorical values as 64-bit ids (INT64, the default) or as text (BYTES)",
    )
    predict.add_argument(
        "--request-ids",
        type=Path,
        default=None,
        help="write the id of each request sent here, one a line, in the order sent",
    )
    predict.set_defaults(func=_predict)

    check = sub.add_parser(
        "verify", help="compare recserve's scores of your rows with your own framework's scores"
    )
    check.add_argument("--rows", type=Path, default=None, help="raw rows, as predict reads them")
    check.add_argument("--expected", type=Path, default=None, help="your scores, one probability per line")
    check.add_argument(
        "--log",
        type=Path,
        default=None,
        help="instead: score the request log in this folder again and compare with its logged scores",
    )
    check.add_argument("--url", default=None, help="also score through this server (host:port)")
    check.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    check.add_argument("--repository", type=Path, default=None)
    check.add_argument(
        "--runtime",
        choices=("onnx", "torch"),
        default="onnx",
        help="in process: the served ONNX graph or PyTorch",
    )
    check.add_argument(
        "--tolerance", type=float, default=None, help="largest |difference| accepted per row (default 1e-5)"
    )
    check.set_defaults(func=_verify)
