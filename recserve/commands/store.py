"""``recserve update``, ``rollback``, ``explain`` and ``redis-load``: the parameter store from the shell."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from recserve.commands.spec_source import command_spec
from recserve.core.spec.parse import load_spec


def _open(args: argparse.Namespace, start: bool = False):  # returns (spec, ServedStore)
    from recserve.backends.store.served import ServedStore
    from recserve.core.names import EMBEDDING_LOOKUP

    spec = command_spec(args)  # without --spec: the one the repository carries
    return spec, ServedStore.open(spec, args.repository / EMBEDDING_LOOKUP / str(spec.version), start=start)


def _announce(served, table: str, version: int) -> None:
    """Also send the version through the Redis stream when the store has an L3 cluster."""
    if served.maintainer.stream is not None:
        entry = served.maintainer.stream.publish(table, version)
        print(f"sent version {version} of {table!r} to the update stream ({entry})", file=sys.stderr)


def _applied_here(served, table: str, version: int) -> int:
    """0 when this machine's store serves ``version`` of ``table``, else 1 with an ``error:`` line.

    A newer version published meanwhile on top of ``version`` (a concurrent update) serves it too;
    one that rolled back past it does not.
    """
    served.updater.poll()
    applied = served.updater.applied[table]
    if applied == version or (
        applied > version and version in (r.version for r in served.updater.log.chain(table, applied))
    ):
        return 0
    reason = served.updater.problems.get(table, "another version is served")
    print(
        f"error: version {version} of table {table!r} was published but this store cannot apply it "
        f"(serving version {applied}): {reason}",
        file=sys.stderr,
    )
    return 1


def _update(args: argparse.Namespace) -> int:
    from recserve.backends.store.updates.versions import read_delta_file

    spec, served = _open(args)
    keys, vectors = read_delta_file(args.delta)
    if args.table not in served.store.tables:
        raise ValueError(f"unknown table {args.table!r}; tables: {', '.join(served.store.table_names)}")
    version = served.updater.log.publish(
        args.table,
        keys,
        vectors,
        served.store.table_dim(args.table),
        # under the log's lock: the same checks the servers make, against what is published now
        check=lambda: served.updater.check_publishable(args.table, keys),
    )
    _announce(served, args.table, version)
    print(
        f"published {len(keys)} rows as version {version} of table {args.table!r}; "
        f"servers apply it within {served.maintainer.interval_s:g} s",
        file=sys.stderr,
    )
    return _applied_here(served, args.table, version)


def _rollback(args: argparse.Namespace) -> int:
    _, served = _open(args)
    if args.table not in served.store.tables:
        raise ValueError(f"unknown table {args.table!r}")
    version = served.updater.log.rollback(args.table, args.to)
    _announce(served, args.table, version)
    print(f"table {args.table!r}: version {version} restores version {args.to}", file=sys.stderr)
    return _applied_here(served, args.table, version)


def _explain(args: argparse.Namespace) -> int:
    from recserve.backends.steps.explain import FIELDS, explain
    from recserve.clients.rows import read_rows
    from recserve.core.user_state_wire import serves_user_state

    spec, served = _open(args)
    inputs = read_rows(args.input, spec).to_inputs(spec)
    states = None
    if serves_user_state(spec):  # the states the served step reads: under the repository's folder
        from recserve.backends.store.user_state.states import open_user_states

        states = open_user_states(spec.user_state, spec.store, args.repository)
    for record in explain(spec, served.store, inputs, args.device, states):
        if args.json:
            print(json.dumps(record))
        else:
            print("\t".join(str(record[f]) for f in FIELDS))
    return 0


def _redis_load(args: argparse.Namespace) -> int:
    from recserve.build.repository import upload_remote_tables
    from recserve.core.names import EMBEDDING_LOOKUP

    spec = load_spec(args.spec)
    options = spec.store
    if args.nodes:
        options = replace(options, redis_nodes=tuple(args.nodes.split(",")))
    if not options.redis_nodes:
        raise ValueError(
            "no Redis Cluster: set [store] redis_nodes in the spec or pass --nodes host:port,..."
        )
    total = upload_remote_tables(
        spec, args.repository / EMBEDDING_LOOKUP / str(spec.version), options, args.all
    )
    print(f"wrote {total} rows to the Redis Cluster at {','.join(options.redis_nodes)}", file=sys.stderr)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add the store commands to ``recserve``'s sub-command parser."""
    update = sub.add_parser(
        "update", help="publish an embedding delta (.npz/.safetensors: keys int64, vectors float32)"
    )
    update.add_argument("--table", required=True)
    update.add_argument("--delta", type=Path, required=True)
    update.add_argument("--repository", type=Path, default=None)
    update.set_defaults(func=_update)

    rollback = sub.add_parser("rollback", help="serve an earlier version of a table again (as a new version)")
    rollback.add_argument("--table", required=True)
    rollback.add_argument("--to", type=int, required=True, help="the version whose content to restore")
    rollback.add_argument("--repository", type=Path, default=None)
    rollback.set_defaults(func=_rollback)

    explain = sub.add_parser(
        "explain", help="per row and feature: value, normalized, key, table, table row, dim, tier, version"
    )
    explain.add_argument(
        "--input", type=Path, required=True, help="rows of the spec: TSV, or CSV with a header"
    )
    explain.add_argument("--json", action="store_true", help="one JSON object per line")
    explain.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="",
        help="the tiers of a device step (profile cuda): tables resident on this device report 'device'",
    )
    explain.add_argument("--repository", type=Path, default=None)
    explain.set_defaults(func=_explain)

    redis_load = sub.add_parser(
        "redis-load", help="write the L3 tables ([store] remote_tables) into the Redis Cluster"
    )
    redis_load.add_argument("--repository", type=Path, default=None)
    redis_load.add_argument(
        "--nodes", default="", help="host:port,... (default: the spec's [store] redis_nodes)"
    )
    redis_load.add_argument("--all", action="store_true", help="also write the locally stored tables")
    redis_load.set_defaults(func=_redis_load)
