"""``recserve lab chaos``: kill each kind of process of a serving stack under bounded load.

The stack is the one ``recserve access`` runs, on loopback: Envoy in front of the stable variant's
replicas, under the supervisor (:meth:`recserve.access.AccessLayer.supervise`), over a scratch copy
of the repository whose target-item table lives in a real Redis Cluster (3 masters, 3 replicas).
:class:`~perf.lab.chaos_load.PacedLoad` sends a fixed batch through the proxy at a bounded rate
while, one kind at a time, a process is killed with SIGKILL:

* each Python-backend stub of one replica (``stub:<model>``): its server stays ready while every
  request through that model fails, until the supervisor restarts it;
* one replica's ``tritonserver``;
* ``envoy``, the proxy;
* ``redis node``: a master of the cluster (its replica takes over; the node is started again as an
  operator's process manager would, and rejoins as a replica).

Right after each kill a new version of one local embedding table is published through the update
log, as ``recserve update`` does. Per kind the report gives the seconds until requests were served
again, the requests failed meanwhile, and the updates lost: replicas that, once the stack has
settled, do not serve the newest published rows (every replica's answer must have moved and agree).
The user-state builder is not part of this stack (``recserve user-state run`` is its own process).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from recserve.access import AccessLayer, ProxyPorts
from recserve.build.repository import upload_remote_tables, version_dir
from recserve.build.synthetic import generate
from recserve.clients import CTRClient, RecserveClientError
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.l3_repository import l3_repository
from recserve.perf.harness.redis_cluster import RedisCluster
from recserve.perf.lab.chaos_load import Outage, PacedLoad, outage
from recserve.server import Backoff, Supervisor, TritonServer

LOGGER = logging.getLogger(__name__)

#: Served again within this many seconds of a kill, for every kind.
TARGET_S = 10.0
#: A kind is over once requests have been answered this long without a failure.
SETTLE_S = 3.0
#: How long a kind may take to settle before it is reported as not served again.
KIND_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class KindResult:
    """One kill and what it cost."""

    kind: str
    pid: int
    failed: int
    requests: int
    served_again_s: float | None
    updates_lost: int

    @property
    def passed(self) -> bool:
        """Served again within :data:`TARGET_S`, no update lost."""
        return self.served_again_s is not None and self.served_again_s <= TARGET_S and not self.updates_lost


class TableUpdates:
    """Publishes new rows for every key of one local table through the update log the servers watch."""

    def __init__(self, spec: ModelSpec, repository: Path) -> None:
        from recserve.backends.store.served import updates_dir
        from recserve.backends.store.tiered import TieredStore
        from recserve.backends.store.updates.versions import UpdateLog

        folder = version_dir(repository, EMBEDDING_LOOKUP, spec)
        remote = set(spec.store.remote_tables)
        store = TieredStore.load(folder, spec)
        local = [name for name in store.table_names if name not in remote]
        self.table = min(local, key=lambda name: len(store.table_arrays(name).keys))
        self.keys = store.table_arrays(self.table).keys
        self.dim = store.dim
        self.log = UpdateLog(updates_dir(folder), store.base_version, store.table_names)
        self.rng = np.random.default_rng(11)

    def publish(self) -> int:
        """A new version of the table (new rows for all its keys); its number."""
        vectors = self.rng.normal(0, 0.5, size=(len(self.keys), self.dim)).astype(np.float32)
        return self.log.publish(self.table, self.keys, vectors, self.dim)


def _answers(layer: AccessLayer, spec: ModelSpec, inputs: dict[str, np.ndarray]) -> list[np.ndarray | None]:
    """Each replica's answer to ``inputs``, asked directly (None: it did not answer)."""
    answers: list[np.ndarray | None] = []
    for server in layer.all_servers():
        try:
            with CTRClient(server.grpc_url, spec=spec, timeout_s=5) as client:
                answers.append(np.asarray(client.predict_inputs(inputs)))
        except RecserveClientError:
            answers.append(None)
    return answers


def _updates_lost(
    layer: AccessLayer, spec: ModelSpec, inputs: dict[str, np.ndarray], before: list[np.ndarray | None]
) -> tuple[int, list[np.ndarray | None]]:
    """Replicas not serving the newest rows after a while: their answer never moved, or differs."""
    deadline = time.monotonic() + 5 * SETTLE_S
    while True:
        now = _answers(layer, spec, inputs)
        pairs = zip(now, before, strict=True)
        moved = [a is not None and (b is None or not np.allclose(a, b)) for a, b in pairs]
        first = now[0]
        agree = [a is not None and first is not None and np.allclose(a, first, atol=1e-5) for a in now]
        lost = sum(1 for m, g in zip(moved, agree, strict=True) if not (m and g))
        if not lost or time.monotonic() > deadline:
            return lost, now
        time.sleep(0.25)


def _all_up(supervisor: Supervisor) -> bool:
    """True when every supervised process is up (none down or starting again)."""
    return all(record["up"] for record in supervisor.status().values())


def _kinds(layer: AccessLayer, cluster: RedisCluster) -> list[tuple[str, Callable[[], int]]]:
    """(kind, kill) for every kind of process: kill returns the pid it killed."""
    turn = itertools.count()  # the replicas take turns: each restart starts its own backoff schedule

    def server(index: int) -> TritonServer:
        replicas = layer.servers["stable"]
        return replicas[index % len(replicas)]  # the current one: a restart replaces it

    def stub(model: str) -> Callable[[], int]:
        def kill() -> int:
            pid = next(p for p, m in server(next(turn)).stubs().items() if m == model)
            os.kill(pid, signal.SIGKILL)
            return pid

        return kill

    def process(pid: Callable[[], int | None]) -> Callable[[], int]:
        def kill() -> int:
            victim = pid()
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            return victim

        return kill

    def redis_node() -> int:
        port = cluster.masters()[0]
        pid = cluster.processes[port].pid
        cluster.kill(port)
        cluster.wait_ok()  # its replica took over
        cluster.restart([port])  # as a process manager would; it rejoins as a replica
        return pid

    models = sorted(set(server(0).stubs().values()))
    kinds: list[tuple[str, Callable[[], int]]] = [(f"stub:{model}", stub(model)) for model in models]
    kinds.append(("tritonserver", process(lambda: server(next(turn)).pid)))
    kinds.append(("envoy", process(lambda: layer.proxy.pid if layer.proxy is not None else None)))
    kinds.append(("redis node", redis_node))
    return kinds


def run_chaos(
    spec: ModelSpec, repository: Path, scratch: Path, replicas: int = 2, rate: float = 40.0, threads: int = 4
) -> list[KindResult]:
    """Start the stack in ``scratch`` and kill each kind of process once (see the module docstring)."""
    inputs = generate(spec, 8, seed=23).to_wire(spec)
    with RedisCluster(scratch / "redis") as cluster:
        variant = l3_repository(
            spec, repository, scratch / "repository", cluster.nodes, None, cluster.password_env
        )
        upload_remote_tables(
            variant, version_dir(scratch / "repository", EMBEDDING_LOOKUP, variant), variant.store
        )
        updates = TableUpdates(variant, scratch / "repository")
        access = replace(variant.access, weights={"stable": 100}, shadow_fraction=0.0, replicas=replicas)
        results = []
        with AccessLayer(
            access, {"stable": scratch / "repository"}, scratch / "access", ProxyPorts.free()
        ) as layer:
            supervisor = layer.supervise(Backoff())
            before = _answers(layer, spec, inputs)
            with PacedLoad(layer.grpc_url, spec, inputs, threads, rate / threads) as load:
                time.sleep(SETTLE_S)
                for kind, kill in _kinds(layer, cluster):
                    killed_at = time.monotonic()
                    pid = kill()
                    updates.publish()
                    LOGGER.info("killed %s (pid %d)", kind, pid)
                    while not (load.quiet_since(killed_at, SETTLE_S) and _all_up(supervisor)):
                        if time.monotonic() - killed_at > KIND_TIMEOUT_S:
                            break
                        time.sleep(0.1)
                    cost: Outage = outage(load.snapshot(), killed_at, time.monotonic())
                    lost, before = _updates_lost(layer, spec, inputs, before)
                    results.append(
                        KindResult(kind, pid, cost.failed, cost.requests, cost.served_again_s, lost)
                    )
                    LOGGER.info("%s", results[-1])
            if load.errors:
                LOGGER.info("first failures: %s", load.errors[:3])
    return results


def format_report(results: list[KindResult]) -> str:
    """One line per kind, then the verdict."""
    lines = [
        f"{'kind':<26} {'pid':>7} {'served again':>13} {'failed':>7} {'requests':>9} {'updates lost':>13}"
    ]
    for r in results:
        again = "never" if r.served_again_s is None else f"{r.served_again_s:.2f} s"
        lines.append(
            f"{r.kind:<26} {r.pid:>7} {again:>13} {r.failed:>7} {r.requests:>9} {r.updates_lost:>13}"
        )
    verdict = "PASS" if all(r.passed for r in results) else "FAIL"
    lines.append(f"{verdict}: every kind served again within {TARGET_S:.0f} s, 0 updates lost")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    """Run, print the table (and write it as JSON); 0 when every kind passed."""
    from recserve.core.spec.parse import load_spec

    with tempfile.TemporaryDirectory(prefix="recserve-chaos-") as scratch:
        results = run_chaos(load_spec(args.spec), args.repository, Path(scratch), args.replicas, args.rate)
    print(format_report(results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0 if all(r.passed for r in results) else 1
