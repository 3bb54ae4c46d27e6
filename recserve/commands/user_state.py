"""``recserve user-state run`` and ``delete``: the near-line builder of users' states, in its own process."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.parse import load_spec
from recserve.core.user_state_wire import user_key

#: How often the builder looks for a new item table or dense version (and measures its drift).
KEY_SPACE_POLL_S = 5.0


def _run(args: argparse.Namespace) -> int:
    from recserve.backends.steps.user_state_keys import RepositoryKeySpace
    from recserve.backends.store.redis_tier import RedisTier
    from recserve.backends.store.served import ServedStore
    from recserve.backends.store.user_state.builder import Regrouping, UserStateBuilder
    from recserve.backends.store.user_state.events import FileEventLog, RedisEventLog
    from recserve.backends.store.user_state.groups import Budget
    from recserve.backends.store.user_state.rebuilds import (
        REBUILD_FILE_SUFFIX,
        REBUILD_SET_SUFFIX,
        FileRebuilds,
        RedisRebuilds,
    )
    from recserve.backends.store.user_state.states import RedisUserStates, open_user_states

    spec = load_spec(args.spec)
    section = spec.user_state
    if not section.enabled:
        print("note: [user_state] enabled is false: servers will not read these states", file=sys.stderr)
    # the item rows as served: published updates applied, new ones followed by the upkeep thread
    served = ServedStore.open(spec, args.repository / EMBEDDING_LOOKUP / str(spec.version))
    key_space = RepositoryKeySpace.load(spec, args.repository, spec.version, served.store)
    attributes = tuple(s.name for s in spec.sequences[1:])  # the sequences aligned to the items
    states = open_user_states(section, spec.store, args.folder, attributes=len(attributes))
    if section.event_log == "redis":
        client = RedisTier.connect(replace(spec.store, redis_deadline_ms=1000.0)).client
        log: FileEventLog | RedisEventLog = RedisEventLog(client, section.event_stream, attributes=attributes)
    else:
        log = FileEventLog(args.folder / section.event_path, attributes=attributes)
    # the servers' rebuild requests: beside the states (a Redis set), or a file beside the event file
    rebuilds: FileRebuilds | RedisRebuilds = (
        RedisRebuilds(states.client, section.event_stream + REBUILD_SET_SUFFIX)
        if isinstance(states, RedisUserStates)
        else FileRebuilds(args.folder / (section.event_path + REBUILD_FILE_SUFFIX))
    )
    builder = UserStateBuilder(
        states,
        Budget(section.tokens, section.exact_tokens, section.group_radius),
        key_space,
        section.max_events,
        section.debounce_ms / 1000.0,
        key_space.versions,
    )
    regrouping = Regrouping(key_space, section.regroup_drift)
    looked = [time.monotonic()]

    def tick() -> None:  # a new table or dense version: regroup when it moved the keys enough
        if time.monotonic() - looked[0] >= KEY_SPACE_POLL_S:
            looked[0] = time.monotonic()
            key_space.newer_dense(args.repository)
            regrouping.check(builder, key_space.versions)

    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    started = time.monotonic()
    deadline = started + args.duration if args.duration else float("inf")

    def stop() -> bool:
        if args.drain:  # the log as it is now, then stop
            return True
        return bool(stopping) or time.monotonic() >= deadline

    try:
        report = builder.run(log.read, stop, rebuilds=rebuilds.take, tick=tick)
    except KeyboardInterrupt:
        report = builder.report
    finally:
        served.close()
    summary = report.summary(time.monotonic() - started)
    summary["refused_events"] = log.refused
    p50, p99 = report.lag_percentiles()
    print(
        f"user-state builder: {summary['events']} events, {summary['rebuilds']} rebuilds "
        f"({summary['users_per_s']:.0f} users/s), lag p50 {1000 * p50:.1f} ms "
        f"p99 {1000 * p99:.1f} ms, modes {summary['modes']}",
        file=sys.stderr,
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _delete(args: argparse.Namespace) -> int:
    from recserve.backends.store.user_state.states import open_user_states

    try:
        user = user_key(args.user)
    except ValueError as exc:
        raise ValueError(f"--user: {exc}") from None
    spec = load_spec(args.spec)
    states = open_user_states(spec.user_state, spec.store, args.folder, attributes=len(spec.sequences) - 1)
    erased = states.delete(user)
    print(f"user {args.user}: {'state erased' if erased else 'no state stored'}", file=sys.stderr)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``user-state run`` and ``user-state delete`` to ``recserve``'s sub-command parser."""
    group = sub.add_parser("user-state", help="the near-line builder of users' states ([user_state])")
    commands = group.add_subparsers(dest="user_state_command", required=True, metavar="NAME")
    run = commands.add_parser("run", help="consume the event log and write users' states until stopped")
    run.add_argument("--repository", type=Path, default=None)
    run.add_argument("--folder", type=Path, default=Path("."), help="where relative store and log paths lie")
    run.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: never)")
    run.add_argument("--drain", action="store_true", help="build from the log as it is now, then stop")
    run.add_argument("--json", type=Path, default=None, help="write the report (lag, users/s, modes) here")
    run.set_defaults(func=_run)
    delete = commands.add_parser("delete", help="erase one user's state")
    delete.add_argument("--user", required=True, help="the user's id (an integer or a string)")
    delete.add_argument("--folder", type=Path, default=Path("."))
    delete.set_defaults(func=_delete)
