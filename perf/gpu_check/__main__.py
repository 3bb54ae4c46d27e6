"""The command line: ``prepare`` and ``dry-run`` here, ``run`` on the GPU machine.

``run`` imports the standard library only; ``parity`` and ``variant``, which the serving steps call in
the venv, import numpy, tritonclient and recserve when called.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from . import __doc__ as PLAN
from .common import (
    BENCH,
    BENCH_DEADLINE_S,
    BENCH_DRY,
    BENCH_PART,
    KIT,
    LIMIT_BYTES,
    PARTS,
    WORK,
    find_root,
    log,
)
from .context import Context, detect_gpus
from .kit import mib, prepare, size_table
from .report import print_calls
from .serve import cmd_parity, cmd_variant
from .steps import run_steps


def make_context(args: argparse.Namespace, dry_run: bool) -> Context:
    """The shared context from the command line."""
    root = find_root()
    output = args.output or Path(os.environ.get("OUT") or root / WORK / "out")
    work = root / WORK
    work.mkdir(exist_ok=True)
    gpus = [] if dry_run else detect_gpus()
    seconds = args.deadline or (BENCH_DEADLINE_S if getattr(args, "part", None) == BENCH_PART else 570.0)
    return Context(
        root,
        root / KIT,
        work,
        output,
        dry_run,
        gpus,
        deadline=time.monotonic() + seconds,
        lookup_instances=getattr(args, "lookup_instances", None),
    )


def cmd_prepare(args: argparse.Namespace) -> int:
    """Build the kit and size-check it."""
    root = find_root()
    kit = prepare(root, force=args.force)
    table, fits, _ = size_table(root, kit)
    print_calls(table)
    if not fits:
        print(f"error: one call needs more than {mib(LIMIT_BYTES)}", file=sys.stderr)
        return 1
    return 0


def cmd_dry_run(args: argparse.Namespace) -> int:
    """Everything that needs no GPU."""
    started = time.monotonic()
    root = find_root()
    kit = prepare(root, force=args.force)
    table, fits, figures = size_table(root, kit)
    print_calls(table)
    ctx = make_context(args, dry_run=True)
    shutil.rmtree(ctx.logs, ignore_errors=True)
    ctx.logs.mkdir(parents=True)
    extra = {
        "size": figures,
        "fits": fits,
        "size_table": table,
        "plan": {"carry": [KIT], "calls": len(PARTS)},
    }
    code = run_steps(ctx, PARTS, "dry run (no GPU)", extra)
    log(f"dry run took {time.monotonic() - started:.0f} s")
    return code if fits else 1


def cmd_run(args: argparse.Namespace) -> int:
    """The GPU half: the steps of one part (or all)."""
    ctx = make_context(args, dry_run=False)
    if not (ctx.kit / "kit.json").is_file():
        print(
            f"error: no {KIT}/kit.json: run 'prepare' where the registries are and carry {KIT}",
            file=sys.stderr,
        )
        return 2
    header = "the bench (one call)" if args.part == BENCH_PART else f"part {args.part}"
    return run_steps(ctx, (args.part,), header, {})


def cmd_bench_spec(args: argparse.Namespace) -> int:
    """Write the bench spec; print its changes from the default spec as one JSON line."""
    from .bench.spec import write_bench_spec

    sizes = BENCH_DRY if args.dry else BENCH
    print(json.dumps(write_bench_spec(args.base, sizes, args.target, args.lookup_instances)))
    return 0


def cmd_bound(args: argparse.Namespace) -> int:
    """Measure the in-process bound; write its JSON."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from .bench.bound import measure_bound

    figures = measure_bound(args.spec, args.repository, args.device, BENCH_DRY if args.dry else BENCH)
    args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


def cmd_served(args: argparse.Namespace) -> int:
    """One group of the served bench; its points appended to the JSON-lines file."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from .bench.served import cmd_served as served

    sizes = BENCH_DRY if args.dry else BENCH
    urls = (args.grpc, args.http)
    return served(
        args.spec,
        args.repository,
        urls,
        args.group,
        sizes,
        args.seconds,
        not args.dry,
        args.jsonl,
        args.tolerance,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``prepare``, ``run``, ``dry-run`` (and the helpers ``parity``, ``variant``)."""
    top = argparse.ArgumentParser(
        prog="gpu_check", description=PLAN, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = top.add_subparsers(dest="command", required=True)
    prepare_cmd = sub.add_parser("prepare", help="build and size-check the kit (needs the registries)")
    prepare_cmd.add_argument("--force", action="store_true", help="rebuild even when the kit is current")
    prepare_cmd.set_defaults(func=cmd_prepare)
    for name, func, deadline in (("run", cmd_run, 0.0), ("dry-run", cmd_dry_run, 900.0)):
        command = sub.add_parser(
            name, help="the GPU steps" if name == "run" else "everything that needs no GPU"
        )
        command.add_argument("--output", type=Path, default=None, help="default: $OUT, else .gpu-run/out")
        command.add_argument(
            "--deadline",
            type=float,
            default=deadline or None,
            help=f"seconds for this call (run: {BENCH_DEADLINE_S:.0f} for the bench, 570 for a part)",
        )
        if name == "run":
            command.add_argument(
                "--part",
                type=int,
                choices=PARTS,
                default=BENCH_PART,
                help=f"default {BENCH_PART}: the bench in one call; 1-5: the longer checks",
            )
            command.add_argument(
                "--lookup-instances",
                type=int,
                default=None,
                help="the bench's embedding_lookup instances (default: the spec's)",
            )
        else:
            command.add_argument("--force", action="store_true", help="rebuild the kit")
        command.set_defaults(func=func)
    parity_cmd = sub.add_parser("parity", help="served vs in-process PyTorch scores (JSON line)")
    parity_cmd.add_argument("--url", required=True)
    parity_cmd.add_argument("--tolerance", type=float, default=1e-4)
    parity_cmd.set_defaults(func=cmd_parity)
    variant_cmd = sub.add_parser("variant", help="cuda-profile repository variant with other instance counts")
    variant_cmd.add_argument("--dense-instances", type=int, help="dense instances (default 1)")
    variant_cmd.add_argument("--lookup-instances", type=int, help="lookup instances (default: the spec's)")
    variant_cmd.add_argument("--target", type=Path, required=True)
    variant_cmd.set_defaults(func=cmd_variant)
    bench_spec = sub.add_parser("bench-spec", help="write the bench spec (JSON); print its changes")
    bench_spec.add_argument("--base", default="ctr", help="the spec it derives from (default: ctr)")
    bench_spec.add_argument("--target", type=Path, required=True)
    bench_spec.add_argument("--lookup-instances", type=int, default=None, help="default: the spec's")
    bench_spec.set_defaults(func=cmd_bench_spec)
    bound = sub.add_parser("bound", help="the in-process bound on a device (JSON)")
    bound.add_argument("--device", default="cuda")
    bound.add_argument("--json", type=Path, required=True)
    bound.set_defaults(func=cmd_bound)
    served = sub.add_parser("served", help="one group of the served bench (JSON lines)")
    served.add_argument("--group", choices=("parity", "ids-lists", "ids-rows", "bytes"), required=True)
    served.add_argument("--grpc", required=True, help="host:port")
    served.add_argument("--http", required=True, help="host:port (Triton's statistics)")
    served.add_argument("--seconds", type=float, required=True, help="stop starting points after this")
    served.add_argument("--jsonl", type=Path, required=True)
    served.add_argument("--tolerance", type=float, default=1e-4, help="parity: max |served - PyTorch|")
    served.set_defaults(func=cmd_served)
    for helper in (bench_spec, bound, served):
        helper.add_argument("--dry", action="store_true", help="the dry run's tiny sizes")
    for helper in (bound, served):
        helper.add_argument("--spec", type=Path, required=True, help="the bench spec (JSON)")
        helper.add_argument("--repository", type=Path, required=True)
    args = top.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
