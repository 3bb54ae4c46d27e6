"""``recserve build``, ``import``, ``contract`` and ``sample``: make a servable repository and rows for it."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from recserve.backends.dense.tensorrt_engine import PRECISIONS
from recserve.core.contract import ContractTensor, dense_contract
from recserve.core.in_model import IN_MODEL, in_model_contract
from recserve.core.names import BATCH_AXIS, SEQUENCE_AXIS
from recserve.core.spec.parse import load_spec
from recserve.errors import ArtifactError


def format_contract(inputs: tuple[ContractTensor, ...], outputs: tuple[ContractTensor, ...]) -> str:
    """The contract as an aligned table (one line per tensor)."""
    lines = []
    name_width = max(len(t.name) for t in (*inputs, *outputs)) + 2
    for kind, tensors in (("input", inputs), ("output", outputs)):
        for t in tensors:
            shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
            lines.append(f"{kind:<7}{t.name:<{name_width}}{t.dtype:<6}{shape:<14}{t.holds}")
    return "\n".join(lines)


def _build(args: argparse.Namespace) -> int:
    from recserve.build.configs import write_configs
    from recserve.build.repository import add_tensorrt_engine, build_repository, install_adapters, is_built

    spec = load_spec(args.spec)
    if args.train_data is not None:
        from recserve.clients.rows import read_rows

        rows = read_rows(args.train_data, spec, max_rows=args.max_rows).to_raw(spec)
        print(f"[build] read {len(rows)} labelled rows from {args.train_data}", file=sys.stderr)
        build_repository(spec, args.repository, rows=rows)
    elif args.if_missing and is_built(spec, args.repository):
        # code and configs, not artifacts: always the installed version's
        install_adapters(spec, args.repository)
        write_configs(spec, args.repository)
        print(
            f"[build] {args.repository} is already built from spec {spec.name!r}; "
            "adapters and configs refreshed",
            file=sys.stderr,
        )
    else:
        build_repository(spec, args.repository)
    if args.profile == "gpu":
        add_tensorrt_engine(spec, args.repository, args.precision)
    return 0


def _sample(args: argparse.Namespace) -> int:
    from recserve.build.synthetic import generate
    from recserve.clients.writers import write_csv, write_tsv

    spec = load_spec(args.spec)
    writer = write_csv if args.output.suffix == ".csv" else write_tsv
    if args.event_log is not None:  # long users: their events in the log, their newest tails as rows
        from recserve.backends.store.user_state.events import append_events
        from recserve.build.synthetic_users import long_users

        made = long_users(spec, args.rows, args.seed)
        events = made.event_log(start_ts=time.time() - spec.user_state.max_events)
        append_events(args.event_log, events, made.attribute_names)
        # each row a user's newest tail, with its user and newest event's number (read back by predict)
        rows = made.tail_rows(spec.user_state.tail).with_user_state(spec, made.users, made.rows.lengths)
        print(
            f"wrote {int(made.rows.lengths.sum())} events of users {made.first_user}.."
            f"{made.first_user + args.rows - 1} to {args.event_log} (row i is user {made.first_user} + i)",
            file=sys.stderr,
        )
    else:
        rows = generate(spec, args.rows, args.seed)
    writer(args.output, rows, spec, with_label=not args.no_label)
    print(f"wrote {args.rows} rows to {args.output}", file=sys.stderr)
    return 0


def _contract(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    in_model = spec.model.lookups == IN_MODEL and not args.served
    inputs, outputs = in_model_contract(spec) if in_model else dense_contract(spec)
    if args.json:
        doc = {"inputs": [t.to_json() for t in inputs], "outputs": [t.to_json() for t in outputs]}
        print(json.dumps({"lookups": IN_MODEL, **doc} if in_model else doc))
        return 0
    axes = f"-1: dynamic; name the axes {BATCH_AXIS!r}, {SEQUENCE_AXIS!r}"
    if in_model:
        print(f"network of spec {spec.name!r} with its own tables, as exported ({axes}):")
    else:
        print(f"dense network of spec {spec.name!r} ({axes}):")
    print(format_contract(inputs, outputs))
    if in_model:
        print(
            "each table is the weight its features' Gather nodes read, its rows those of <table>.vocab.json; "
            "recserve import splits the network at those lookups and serves the rest over the dense "
            "contract (--served prints it)"
        )
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
    """Add ``build``, ``import``, ``contract`` and ``sample`` to ``recserve``'s sub-command parser."""
    build = sub.add_parser("build", help="train, export and write the model repository")
    build.add_argument("--repository", type=Path, default=None)
    build.add_argument("--if-missing", action="store_true", help="skip when already built from this spec")
    build.add_argument(
        "--profile", choices=("cpu", "gpu"), default="cpu", help="gpu: also build the dense TensorRT engine"
    )
    build.add_argument("--precision", choices=PRECISIONS, default="fp32", help="TensorRT engine precision")
    build.add_argument(
        "--train-data", type=Path, default=None, help="train on these labelled rows (as predict reads them)"
    )
    build.add_argument("--max-rows", type=int, default=None, help="read at most this many training rows")
    build.set_defaults(func=_build)

    contract = sub.add_parser("contract", help="what the dense network receives and returns under the spec")
    contract.add_argument("--json", action="store_true", help='{"inputs": [...], "outputs": [...]}')
    contract.add_argument(
        "--served",
        action="store_true",
        help='with [model] lookups = "in_model": the dense contract the split network is served over',
    )
    contract.set_defaults(func=_contract)

    imported = sub.add_parser(
        "import", help="write a servable repository from trained tables and a dense ONNX (no training)"
    )
    imported.add_argument("--tables", type=Path, required=True, help="one file or folder per table")
    imported.add_argument(
        "--dense",
        type=Path,
        required=True,
        help='the dense network, following the contract (lookups = "in_model": the whole model)',
    )
    imported.add_argument("--repository", type=Path, default=None)
    imported.add_argument("--replace", action="store_true", help="replace an existing repository")
    imported.set_defaults(func=_import)

    sample = sub.add_parser(
        "sample", help="write synthetic rows in the spec's schema (.csv with header, else TSV)"
    )
    sample.add_argument("--output", type=Path, required=True)
    sample.add_argument("--rows", type=int, default=20)
    sample.add_argument("--seed", type=int, default=1)
    sample.add_argument("--no-label", action="store_true")
    sample.add_argument(
        "--event-log",
        type=Path,
        default=None,
        help="long users instead ([user_state] max_events): append their events to this JSON-lines log "
        "and write their newest [user_state] tail events as the rows, with user and user_seq columns",
    )
    sample.set_defaults(func=_sample)
