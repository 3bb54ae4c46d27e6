"""A scratch copy of a built repository whose target-item table lives only in a Redis Cluster.

Used by ``recserve lab redis-outage`` and by the tests of the L3 tier (with
:class:`~recserve.perf.harness.redis_cluster.RedisCluster`).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

from recserve.backends.store.tiered import TieredStore
from recserve.build import configs
from recserve.build.repository import version_dir, write_tables
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import parse_spec


def l3_repository(
    spec: ModelSpec,
    repository: Path,
    target: Path,
    nodes: list[str],
    deadline_ms: float | None = None,
    password_env: str = "",
) -> ModelSpec:
    """A copy of a built repository whose target-item table lives only in the Redis Cluster at ``nodes``.

    Args:
        spec: the spec the repository was built from.
        repository: the built repository (left unchanged).
        target: where the copy goes (without the update log).
        nodes: ``host:port`` seeds of the cluster.
        deadline_ms: the L3 deadline of the copy; None keeps the spec's ``redis_deadline_ms``.
        password_env: the environment variable holding the cluster's password (empty: none).

    Returns:
        The copy's spec (its configs carry it); load the cluster with
        :func:`recserve.build.repository.upload_remote_tables`.
    """
    doc = copy.deepcopy(spec.source)
    store = {
        **doc.get("store", {}),
        "redis_nodes": list(nodes),
        "remote_tables": [spec.attention("redis-outage")[0].table],
    }
    if deadline_ms is not None:
        store["redis_deadline_ms"] = float(deadline_ms)
    if password_env:
        store["redis_password_env"] = password_env
    doc["store"] = store
    variant = parse_spec(doc)
    shutil.copytree(repository, target, ignore=shutil.ignore_patterns("updates", "__pycache__"))
    source = TieredStore.load(version_dir(repository, EMBEDDING_LOOKUP, spec), spec)
    tables = {name: source.table_arrays(name) for name in source.table_names}
    root = version_dir(target, EMBEDDING_LOOKUP, spec)
    shutil.rmtree(root / "shards")
    write_tables(variant, tables, root)
    configs.write_configs(variant, target)
    return variant
