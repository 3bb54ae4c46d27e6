"""The ``recserve`` command: the parser of every sub-command, and the dispatch.

The user's commands (build, serve, score, update the store, run the access layer, measure) are top-level;
the lab commands (measurements and experiments on private servers, not needed to serve) sit under
``recserve lab``. Each command group lives in a module of its own: :mod:`~recserve.commands.model`,
:mod:`~recserve.commands.serving`, :mod:`~recserve.commands.store`, :mod:`~recserve.commands.access`,
:mod:`~recserve.commands.perf` and :mod:`~recserve.commands.lab`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap

from recserve.commands import access, lab, loop, model, perf, serving, store, user_state
from recserve.core.spec.types import DEFAULT_SPEC, default_repository
from recserve.errors import ArtifactError

SPEC_HELP = "bundled spec name or path to a spec .toml"
LAB_HELP = "measurements and experiments on private loopback servers, not needed to serve"
DESCRIPTION = (
    "Serve sparse CTR models on Triton Inference Server. The user commands build, serve, score, update "
    "and measure; the lab commands (listed last) run as 'recserve lab NAME'. --spec goes before or "
    "after the command."
)


def _add_spec(command: argparse.ArgumentParser) -> None:
    """``--spec`` after the sub-command too; given there, it wins over the one before it."""
    command.add_argument("--spec", default=argparse.SUPPRESS, help=SPEC_HELP)


def _lab_listing(commands: argparse._SubParsersAction) -> str:
    """The lab commands and their help, for the epilog of ``recserve --help``."""
    entries = [(action.dest, action.help or "") for action in commands._choices_actions]
    width = max(len(name) for name, _ in entries) + 2
    lines = [
        textwrap.fill(text, 100, initial_indent=f"  {name:<{width}}", subsequent_indent=" " * (width + 2))
        for name, text in entries
    ]
    return "lab commands (recserve lab NAME ...):\n" + "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``recserve``."""
    top = argparse.ArgumentParser(
        prog="recserve",
        description=textwrap.fill(DESCRIPTION, 100),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument(
        "--spec",
        default=None,
        help=f"{SPEC_HELP} (default: {DEFAULT_SPEC}, or the spec a named repository or the server carries)",
    )
    sub = top.add_subparsers(dest="command", required=True, title="user commands", metavar="COMMAND")
    for group in (model, serving, store, user_state, loop, access, perf):
        group.add_commands(sub)
    lab_parser = sub.add_parser("lab", help=f"{LAB_HELP} (listed below)", description=LAB_HELP)
    lab_commands = lab_parser.add_subparsers(
        dest="lab_command", required=True, title="lab commands", metavar="NAME"
    )
    lab.add_commands(lab_commands)
    for command in (*sub.choices.values(), *lab_commands.choices.values()):
        _add_spec(command)
    top.epilog = _lab_listing(lab_commands)
    return top


def resolve_flat_name(argv: list[str]) -> list[str]:
    """``argv`` with an old top-level lab command name moved under ``lab`` (a notice goes to stderr).

    Scripts written before the lab commands were grouped keep working: ``recserve soak ...`` runs
    ``recserve lab soak ...``, and ``recserve bench-store ...`` runs ``recserve lab store-bench ...``.
    """
    i = 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("--spec="):
            i += 1
        elif len(word) > 2 and "--spec".startswith(word):  # --spec VALUE (argparse takes a prefix too)
            i += 2
        elif word.startswith("-"):
            return argv
        else:
            new = lab.FLAT_NAMES.get(word)
            if new is None:
                return argv
            print(f"recserve: '{word}' is now 'recserve lab {new}'; the old name will go", file=sys.stderr)
            return [*argv[:i], "lab", new, *argv[i + 1 :]]
    return argv


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``recserve`` console script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(resolve_flat_name(sys.argv[1:] if argv is None else list(argv)))
    # without --spec, the commands reading a repository or a server take the spec it carries
    args.spec_given = args.spec is not None
    args.spec = DEFAULT_SPEC if args.spec is None else args.spec
    args.repository_given = getattr(args, "repository", None) is not None
    if getattr(args, "repository", False) is None:
        args.repository = default_repository(args.spec)
    try:
        return int(args.func(args) or 0)
    except (ArtifactError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
