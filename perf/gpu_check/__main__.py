"""The command line: ``prepare`` and ``dry-run`` here, ``run`` on the GPU machine.

``run`` imports the standard library only; ``parity`` and ``variant``, which the serving steps call in
the venv, import numpy, tritonclient and recserve when called.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from . import __doc__ as PLAN
from .common import KIT, LIMIT_BYTES, PARTS, WORK, find_root, log
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
    ctx = Context(root, root / KIT, work, output, dry_run, gpus, deadline=time.monotonic() + args.deadline)
    return ctx


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
    extra = {"size": figures, "fits": fits, "size_table": table, "plan": {"carry": [KIT], "calls": 3}}
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
    parts = (args.part,) if args.part else PARTS
    return run_steps(ctx, parts, f"parts {', '.join(map(str, parts))}", {})


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``prepare``, ``run``, ``dry-run`` (and the helpers ``parity``, ``variant``)."""
    top = argparse.ArgumentParser(
        prog="gpu_check", description=PLAN, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = top.add_subparsers(dest="command", required=True)
    prepare_cmd = sub.add_parser("prepare", help="build and size-check the kit (needs the registries)")
    prepare_cmd.add_argument("--force", action="store_true", help="rebuild even when the kit is current")
    prepare_cmd.set_defaults(func=cmd_prepare)
    for name, func, deadline in (("run", cmd_run, 570.0), ("dry-run", cmd_dry_run, 600.0)):
        command = sub.add_parser(
            name, help="the GPU steps" if name == "run" else "everything that needs no GPU"
        )
        command.add_argument("--output", type=Path, default=None, help="default: $OUT, else .gpu-run/out")
        command.add_argument("--deadline", type=float, default=deadline, help="seconds for this call")
        if name == "run":
            command.add_argument("--part", type=int, choices=PARTS, default=None, help="default: all")
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
    args = top.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
