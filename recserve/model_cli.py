"""``recserve contract`` and ``recserve import``: bring a model trained elsewhere."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recserve import wire
from recserve.errors import ArtifactError
from recserve.spec import load_spec


def format_contract(inputs: tuple[wire.ContractTensor, ...], outputs: tuple[wire.ContractTensor, ...]) -> str:
    """The contract as an aligned table (one line per tensor)."""
    lines = []
    name_width = max(len(t.name) for t in (*inputs, *outputs)) + 2
    for kind, tensors in (("input", inputs), ("output", outputs)):
        for t in tensors:
            shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
            lines.append(f"{kind:<7}{t.name:<{name_width}}{t.dtype:<6}{shape:<14}{t.holds}")
    return "\n".join(lines)


def _contract(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    inputs, outputs = wire.dense_contract(spec)
    if args.json:
        print(
            json.dumps({"inputs": [t.to_json() for t in inputs], "outputs": [t.to_json() for t in outputs]})
        )
    else:
        print(
            f"dense network of spec {spec.name!r} (-1: dynamic; name the axes {wire.BATCH_AXIS!r}, "
            f"{wire.SEQUENCE_AXIS!r}):"
        )
        print(format_contract(inputs, outputs))
    return 0


def _import(args: argparse.Namespace) -> int:
    from recserve.build.importer import import_repository

    spec = load_spec(args.spec)
    try:
        import_repository(spec, args.tables, args.dense, args.repository, replace=args.replace)
    except OSError as exc:  # an unreadable file or folder: one line naming it, no traceback
        raise ArtifactError(f"{exc.filename or 'a file'}: {exc.strerror or exc}") from None
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add the bring-your-own-model commands to ``recserve``'s sub-command parser."""
    contract = sub.add_parser("contract", help="what the dense network receives and returns under the spec")
    contract.add_argument("--json", action="store_true", help='{"inputs": [...], "outputs": [...]}')
    contract.set_defaults(func=_contract)

    imported = sub.add_parser(
        "import", help="write a servable repository from trained tables and a dense ONNX (no training)"
    )
    imported.add_argument("--tables", type=Path, required=True, help="one file or folder per table")
    imported.add_argument(
        "--dense", type=Path, required=True, help="the dense network, following the contract"
    )
    imported.add_argument("--repository", type=Path, default=None)
    imported.add_argument("--replace", action="store_true", help="replace an existing repository")
    imported.set_defaults(func=_import)
