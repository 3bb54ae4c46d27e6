"""What ``recserve bench-longseq`` serves: a bench-local spec, its repository, the users and their states.

The bench-local spec is the measured spec with ``[user_state]`` on, its first sequence allowed
4,096 events and a 4,096 sequence bucket added (the naive path, W1, goes through it); every other
bucket, table and setting is the measured spec's. Its repository is built once per spec (in the
bench's output folder, reused while the spec is unchanged). One tritonserver serves it with states
in the local store (W0, W0', W1, W2 and its variants); a second serves a copy whose states live only
in a loopback Redis Cluster, with no local cache (W2 Redis).
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from recserve.backends.base.artifacts import read_manifest
from recserve.backends.steps.user_state_keys import RepositoryKeySpace
from recserve.backends.store.tiered import TieredStore
from recserve.backends.store.user_state.groups import Budget, build_state
from recserve.backends.store.user_state.states import UserStates, open_user_states
from recserve.build import configs
from recserve.build.repository import (
    build_repository,
    install_adapters,
    is_built,
    load_reference_net,
    version_dir,
    write_dense,
    write_tables,
)
from recserve.build.synthetic_users import LongUsers, long_users
from recserve.core.names import DENSE, EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import parse_spec

LOGGER = logging.getLogger(__name__)

#: The naive path's history: every event of a 4,096-event user, through a bucket of that length.
LONG_EVENTS = 4096
#: The bench-local spec, written beside its repository (``recserve --spec FILE`` reads it).
SPEC_FILE = "longseq_spec.json"


def longseq_spec(spec: ModelSpec, **user_state: object) -> ModelSpec:
    """``spec`` with ``[user_state]`` on, a 4,096-event first sequence and a 4,096 sequence bucket.

    ``user_state``: further ``[user_state]`` keys (e.g. ``store = "redis"``).

    Raises:
        ValueError: the spec has no sequence.
    """
    if not spec.sequences:
        raise ValueError(f"spec {spec.name!r} has no sequence: it has no behaviour history to lengthen")
    doc = copy.deepcopy(spec.source)
    first = spec.sequences[0].name
    for feature in doc["features"]:
        if feature.get("name") == first:
            feature["max_length"] = LONG_EVENTS
    serving = doc.setdefault("serving", {})
    buckets = serving.get("sequence_buckets", list(spec.serving.sequence_buckets))
    serving["sequence_buckets"] = sorted({*buckets, LONG_EVENTS})
    doc["user_state"] = {**doc.get("user_state", {}), "enabled": True, **user_state}
    return parse_spec(doc)


def bench_repository(
    base: ModelSpec, spec: ModelSpec, source: Path, folder: Path, progress: Callable[[str], None]
) -> Path:
    """The bench-local spec's repository under ``folder``: the model of ``source``, served under ``spec``.

    ``source`` is built from ``base`` (the measured spec): its tables and trained network are
    written again under the bench-local spec (seconds: the ONNX graph gains ``history_log_weights``
    and is checked at the 4,096 bucket too). Without a built ``source`` the spec is trained from
    scratch. A repository already built from ``spec`` is reused.
    """
    repository = folder / f"longseq_{spec.name}"
    if is_built(spec, repository):
        install_adapters(spec, repository)
        configs.write_configs(spec, repository)  # the installed version's adapters and configs
        progress(f"[bench-longseq] reusing {repository}")
    elif is_built(base, source):
        progress(f"[bench-longseq] serving the model of {source} under the bench-local spec")
        store = TieredStore.load(version_dir(source, EMBEDDING_LOOKUP, base), base)
        tables = {name: store.table_arrays(name) for name in store.table_names}
        for model in (EMBEDDING_LOOKUP, DENSE):
            shutil.rmtree(version_dir(repository, model, spec), ignore_errors=True)
        write_tables(spec, tables, version_dir(repository, EMBEDDING_LOOKUP, spec))
        auc = read_manifest(version_dir(source, DENSE, base)).get("holdout_auc")
        write_dense(spec, load_reference_net(spec, source), version_dir(repository, DENSE, spec), auc)
        install_adapters(spec, repository)
        configs.write_configs(spec, repository)
    else:
        progress(f"[bench-longseq] {source} is not built from {base.name!r}: training {repository}")
        build_repository(spec, repository, progress=progress)
    (repository / SPEC_FILE).write_text(json.dumps(spec.source, indent=1))
    return repository


def redis_variant(spec: ModelSpec, nodes: list[str], password_env: str) -> ModelSpec:
    """The bench-local spec with states in the Redis Cluster at ``nodes`` and no local cache."""
    doc = copy.deepcopy(spec.source)
    doc["store"] = {**doc.get("store", {}), "redis_nodes": list(nodes), "redis_password_env": password_env}
    doc["user_state"] = {**doc["user_state"], "store": "redis", "cache_users": 0}
    return parse_spec(doc)


@dataclass(frozen=True)
class BenchUsers:
    """The load's users: every one with exactly 4,096 events; ``unstated`` more with no state at all."""

    made: LongUsers
    unknown_first: int  # ids from here on have no state (the misses)

    @property
    def count(self) -> int:
        """How many users the rows hold."""
        return len(self.made.rows)


def bench_users(spec: ModelSpec, users: int, seed: int) -> BenchUsers:
    """``users`` synthetic users of exactly 4,096 events each, under the spec's click rule."""
    made = long_users(spec, 2 * users, seed, max_events=LONG_EVENTS, mean_events=1e12)
    full = np.flatnonzero(made.rows.lengths == LONG_EVENTS)[:users]  # some rows have no history at all
    if full.size < users:
        raise ValueError(f"{full.size} of {2 * users} synthetic users have {LONG_EVENTS} events, not {users}")
    made = replace(made, rows=made.rows.take(full))
    return BenchUsers(made, unknown_first=made.first_user + 10 * users)


def write_states(
    spec: ModelSpec, repository: Path, users: LongUsers, states: UserStates, fresh_events: int
) -> dict[str, int]:
    """Every user's state built from all but its newest ``fresh_events`` events; the modes' counts.

    The newest events are in each request's tail only, as when events arrive between two builds.
    """
    section = spec.user_state
    keys = RepositoryKeySpace.load(spec, repository, spec.version)
    budget = Budget(section.tokens, section.exact_tokens, section.group_radius)
    modes: dict[str, int] = {}
    for index, user in enumerate(users.users.tolist()):
        events = users.events(index)
        seen = events[: max(events.size - fresh_events, 1)]
        built = build_state(seen, int(seen.size), budget, keys, keys.versions)
        states.put(int(user), built.state)
        modes[built.state.mode] = modes.get(built.state.mode, 0) + 1
    return modes


def local_states(spec: ModelSpec, folder: Path) -> UserStates:
    """The local store a server of ``folder`` reads (``[user_state] local_path`` under it)."""
    return open_user_states(spec.user_state, spec.store, folder)


__all__ = [
    "LONG_EVENTS",
    "SPEC_FILE",
    "BenchUsers",
    "bench_repository",
    "bench_users",
    "local_states",
    "longseq_spec",
    "redis_variant",
    "write_states",
]
