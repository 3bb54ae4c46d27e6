"""``recserve perf`` and ``bench``: the served model measured with perf_analyzer and against its peers."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from recserve.commands.loop import table_names
from recserve.commands.spec_source import command_spec
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec

if TYPE_CHECKING:
    from recserve.perf.bench.loop.bench import LoopGrid


def _perf(args: argparse.Namespace) -> int:
    from recserve.perf.bench.analyzer import run_perf

    return run_perf(
        command_spec(args, server=True),  # without --spec: the one the server serves
        url=args.url,
        protocol=args.protocol,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        measurement_ms=args.measurement_ms,
        output=args.output,
        inprocess_repository=None if args.no_inprocess else args.repository,
        candidates=args.candidates,
    )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _bench(args: argparse.Namespace) -> int:
    from recserve.build.repository import is_built
    from recserve.perf.bench.bench import Grid, format_result, run_bench

    if args.make_baseline:
        return _make_baseline(args.make_baseline, args.baseline_file)
    if args.summarize is not None:  # no measuring: recompute summary.json and plots of a finished run
        from recserve.perf.bench.bench import write_summary
        from recserve.perf.bench.report import read_points

        points = read_points(args.summarize)
        summary = write_summary(args.summarize, points)
        print(format_result(points, summary))
        return _compare(summary, args.compare)
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
    return _compare(summary, args.compare)


def _compare(summary: dict, baseline_file: Path | None) -> int:
    """Exit status of ``--compare``: 1 when a ratio is worse than the baseline beyond its noise."""
    if baseline_file is None:
        return 0
    from recserve.perf.bench.baseline import read_baseline, report

    text, passed = report(summary, read_baseline(baseline_file))
    print(f"\nagainst {baseline_file}:\n{text}")
    return 0 if passed else 1


def _make_baseline(runs: list[Path], out: Path) -> int:
    import json

    from recserve.perf.bench.baseline import make_baseline

    summaries = [json.loads((run / "summary.json").read_text()) for run in runs]
    baseline = make_baseline(summaries, [run.name for run in runs])
    out.write_text(json.dumps(baseline, indent=1) + "\n")
    print(f"wrote {out}: {', '.join(baseline['ratios'])}")
    return 0


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _bench_longseq(args: argparse.Namespace) -> int:
    from recserve.perf.bench.longseq.bench import LongseqGrid, run_longseq
    from recserve.perf.bench.longseq.report import describe

    spec = load_spec(args.spec)
    if not spec.sequences:
        print(f"error: spec {spec.name!r} has no sequence: no behaviour history to lengthen", file=sys.stderr)
        return 2
    if args.in_process:
        return _longseq_steps(spec, args)
    grid = LongseqGrid.quick() if args.quick else LongseqGrid()
    overrides = {"rates": args.rates, "rounds": args.rounds, "seconds": args.seconds}
    if args.alone:
        grid = replace(grid, mixed=False)
    grid = replace(grid, **{k: v for k, v in overrides.items() if v is not None})
    run, summary = run_longseq(
        spec, args.repository, args.output, grid, progress=_progress, profile=args.profile
    )
    print(describe(summary))
    print(f"\nresults in {run}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def _longseq_steps(spec: ModelSpec, args: argparse.Namespace) -> int:
    from recserve.perf.bench.longseq.steps import StepGrid, describe_steps, run_steps

    grid = StepGrid(calls=60, rounds=2) if args.quick else StepGrid()
    if args.rounds is not None:
        grid = replace(grid, rounds=args.rounds)
    summary = run_steps(spec, args.repository, args.output, grid, progress=_progress)
    print(describe_steps(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def _bench_loop(args: argparse.Namespace) -> int:
    import datetime

    from recserve.build.repository import is_built
    from recserve.loop.joiner import committed_segments
    from recserve.perf.bench.loop.bench import LoopGrid, run_loop
    from recserve.perf.bench.loop.figures import describe, summarize, write_plots

    spec = load_spec(args.spec)
    if not is_built(spec, args.repository):
        print(f"error: {args.repository} is not built from this spec; run 'recserve build'", file=sys.stderr)
        return 2
    grid = LoopGrid.quick() if args.quick else LoopGrid()
    overrides = {
        "rounds": args.rounds,
        "round_seconds": args.round_seconds,
        "rate": args.rate,
        "train_tables": args.train_tables,
        "learning_rate": args.learning_rate,
        "dense_learning_rate": args.dense_learning_rate,
    }
    grid = replace(grid, **{k: v for k, v in overrides.items() if v is not None})
    if args.replay is not None:
        return _replay_loop(spec, args, grid)
    name = args.run_name or datetime.datetime.now(datetime.UTC).strftime("loop-%Y%m%dT%H%M%SZ")
    recorded = run_loop(spec, args.repository, args.output / name, grid, progress=_progress)
    _progress("[bench-loop] the log scored again offline (recserve verify --log)")
    skew = log_skew(recorded.loop_repository, recorded.log_dir)
    summary, freshness = summarize(recorded, committed_segments, skew)
    run_json = recorded.folder / "summary.json"
    run_json.write_text(json.dumps(summary, indent=1) + "\n")
    plots = write_plots(summary, freshness, (args.json or run_json).parent)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(describe(summary))
    print(f"\nresults in {recorded.folder}; plots {', '.join(str(p) for p in plots)}")
    return 0


def _replay_loop(spec: ModelSpec, args: argparse.Namespace, grid: LoopGrid) -> int:
    """``bench-loop --replay RATES``: the loop emulated in process on the bench's stream, per rate."""
    import torch

    from recserve.perf.bench.loop.bench import starting_logits
    from recserve.perf.bench.loop.replay import as_json, describe, open_served, replay, stream_requests

    torch.set_num_threads(1)  # small batches, one after the other: more threads only wait for each other
    _progress(f"[bench-loop] the stream's {grid.rounds} rounds logged in process")
    requests = stream_requests(spec, grid, starting_logits(spec, args.repository))
    store, net = open_served(spec, args.repository)
    figures = []
    for rate in args.replay or [grid.learning_rate or spec.loop.learning_rate]:
        _progress(f"[bench-loop] replay at learning rate {rate:g}")
        figures.append(replay(spec, store, net, grid, rate, requests))
    print(describe(figures))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(as_json(figures), indent=1) + "\n")
    return 0


def log_skew(repository: Path, log: Path) -> dict:
    """``recserve verify --log``'s check, against the repository's store as served: updates applied."""
    from recserve.backends.steps.pipeline import InProcessPipeline
    from recserve.backends.store.served import ServedStore
    from recserve.build.repository import dense_runners, version_dir
    from recserve.build.repository_spec import repository_spec
    from recserve.core.names import EMBEDDING_LOOKUP
    from recserve.verify_log import rescore_log

    spec = repository_spec(repository)
    networks = dense_runners(spec, repository, runtime="onnx")  # as served on CPUs, every version on disk
    served = ServedStore.open(spec, version_dir(repository, EMBEDDING_LOOKUP, spec), start=False)
    pipeline = InProcessPipeline(spec, served.store, networks[spec.version])  # the last published rows
    check = rescore_log(spec, pipeline.embeddings, networks, log)
    return {
        "skew_max_abs": check.max_abs if check.rescored else None,
        "skew_rows_rescored": check.rescored,
        "skew_rows_other_versions": check.other_versions,
    }


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``perf`` and ``bench`` to ``recserve``'s sub-command parser."""
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
    bench.add_argument(
        "--compare",
        type=Path,
        default=None,
        metavar="BASELINE",
        help="compare the run's ratios with a baseline (perf/baseline.json); exit 1 on a regression",
    )
    bench.add_argument(
        "--make-baseline",
        type=Path,
        nargs="+",
        default=None,
        metavar="RUN",
        help="write the baseline of these runs (at least three quick runs) to --baseline-file",
    )
    bench.add_argument("--baseline-file", type=Path, default=Path("perf/baseline.json"))
    bench.set_defaults(func=_bench)

    longseq = sub.add_parser(
        "bench-longseq",
        help="4,096-event users through a state against today's 256-event rows, interleaved",
    )
    longseq.add_argument(
        "--repository", type=Path, default=None, help="the built model to serve (default: the spec's)"
    )
    longseq.add_argument(
        "--output",
        type=Path,
        default=Path("perf/results"),
        help="the bench repository and a run folder go here",
    )
    longseq.add_argument(
        "--quick", action="store_true", help="one load point, two rounds (under 30 s of load)"
    )
    longseq.add_argument("--rates", type=_floats, default=None, help="requests per second, e.g. 20,40,60")
    longseq.add_argument(
        "--rounds", type=int, default=None, help="rounds per load point (>= 5 for the targets)"
    )
    longseq.add_argument("--seconds", type=float, default=None, help="seconds per workload and round")
    longseq.add_argument("--json", type=Path, default=None, help="also write the summary here")
    longseq.add_argument(
        "--alone",
        action="store_true",
        help="every workload in a phase of its own, not one stream per round (to compare the A/A spread)",
    )
    longseq.add_argument(
        "--in-process",
        action="store_true",
        help="no server: the lookup step's parts timed for w0 and w2 rows in one process",
    )
    longseq.add_argument(
        "--profile",
        choices=("cpu", "cuda"),
        default="cpu",
        help="the configs served: cuda puts both steps' instances on the GPU (needs one)",
    )
    longseq.set_defaults(func=_bench_longseq)

    loop = sub.add_parser(
        "bench-loop",
        help="the closed loop (log, join, learn, publish) against a frozen copy on a drifting stream",
    )
    loop.add_argument("--repository", type=Path, default=None, help="the built model both servers start from")
    loop.add_argument(
        "--output", type=Path, default=Path("perf/results"), help="a run folder is created in here"
    )
    loop.add_argument("--run-name", default=None, help="folder name of this run (default: loop-<UTC time>)")
    loop.add_argument("--quick", action="store_true", help="six 8-second rounds (about 2 minutes in all)")
    loop.add_argument("--rounds", type=int, default=None)
    loop.add_argument("--round-seconds", type=float, default=None)
    loop.add_argument("--rate", type=float, default=None, help="requests per second to each server")
    loop.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="the learner's Adagrad step (default: 0.03, the replay's choice for the drifting items; "
        "--replay takes its own)",
    )
    loop.add_argument(
        "--dense-learning-rate",
        type=float,
        default=None,
        help="the learner trains the dense network too, with this Adagrad step; the loop server loads "
        "each dense version it publishes (default: 0, frozen)",
    )
    loop.add_argument(
        "--train-tables",
        type=table_names,
        default=None,
        metavar="TABLES",
        help="the learner trains only these tables' rows, e.g. item ('' : all; default: the table of the "
        "items the stream drifts)",
    )
    loop.add_argument("--json", type=Path, default=None, help="also write the summary here (plots beside it)")
    loop.add_argument(
        "--replay",
        type=_floats,
        nargs="?",
        const=[],
        default=None,
        metavar="RATES",
        help="no servers: the loop emulated in one process on the same stream, at each learning rate "
        "(e.g. 0.01,0.03,0.1; none given: the bench's rate); prints the AUC gain of each",
    )
    loop.set_defaults(func=_bench_loop)
