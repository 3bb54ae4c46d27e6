"""Two replicas of one model behind the proxy, sharing one Redis Cluster: L3 and the update stream.

Each replica serves its own copy of the repository, as if on its own machine: its own shards and
update log, with the target-item table kept only in the shared Redis Cluster. An update published
once, on one machine, reaches both through the Redis stream. ``kill -9`` of one replica under load
fails at most the requests in flight on it; the proxy ejects it, and takes it back once restarted.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import pytest

from recserve.access import AccessLayer, ProxyPorts
from recserve.backends.store.served import ServedStore
from recserve.build.repository import build_repository, upload_remote_tables, version_dir
from recserve.build.synthetic import generate
from recserve.clients import CTRClient
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.parse import load_spec
from recserve.perf.harness.l3_repository import l3_repository
from recserve.perf.harness.redis_cluster import RedisCluster
from recserve.perf.harness.stats import snapshot
from recserve.server import TritonServer
from recserve.server.watchdog import orphaned_stubs

from .helpers import ClosedLoopClients, wait_for

pytestmark = pytest.mark.integration

IN_FLIGHT = 4  # closed-loop clients through the proxy: at most this many requests in flight
KILLED = 1  # the replica index that is killed


def _requests(server: TritonServer) -> int:
    return snapshot(server.http_url).get(EMBEDDING_LOOKUP, {}).get("requests", 0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tiny = load_spec("tiny")
    root = tmp_path_factory.mktemp("replicas")
    build_repository(tiny, root / "built")
    with RedisCluster(root / "redis") as cluster:
        machines = [root / f"machine-{i}" for i in range(2)]
        for machine in machines:
            spec = l3_repository(tiny, root / "built", machine, cluster.nodes, 500.0, cluster.password_env)
        upload_remote_tables(spec, version_dir(machines[0], EMBEDDING_LOOKUP, spec), spec.store)
        cluster.wait_replicated()
        access = dataclasses.replace(
            tiny.access, weights={"stable": 100}, shadow_fraction=0.0, max_requests=IN_FLIGHT, replicas=2
        )
        with AccessLayer(access, {"stable": machines}, root / "access", ProxyPorts.free()) as layer:
            yield spec, machines, layer


def test_an_update_published_once_reaches_both_replicas(stack):
    spec, machines, layer = stack
    table = spec.categorical.features[0].table
    wire = generate(spec, 4, seed=3).to_wire(spec)
    replicas = layer.servers["stable"]
    clients = [CTRClient(server.grpc_url, spec=spec, timeout_s=30) for server in replicas]
    try:
        before = [client.score_inputs(wire).table_versions()[table] for client in clients]
        assert before[0] == before[1]
        # what `recserve update` does on machine 0: its own update log, then the Redis stream
        served = ServedStore.open(spec, version_dir(machines[0], EMBEDDING_LOOKUP, spec), start=False)
        try:
            keys = served.store.table_arrays(table).keys[:16]
            vectors = np.full((len(keys), served.store.dim), 0.5, np.float32)
            version = served.updater.log.publish(table, keys, vectors, served.store.dim)
            assert served.maintainer.stream is not None
            served.maintainer.stream.publish(table, version)
        finally:
            served.close()
        for client in clients:
            wait_for(
                lambda c=client: c.score_inputs(wire).table_versions()[table] == version,
                timeout_s=30,
                what=f"version {version} of {table} served",
            )
        assert (machines[1] / EMBEDDING_LOOKUP / "updates").is_dir()  # mirrored into machine 1's own log
    finally:
        for client in clients:
            client.close()


def test_kill_9_of_a_replica_fails_at_most_its_requests_in_flight_and_it_rejoins(stack):
    spec, _, layer = stack
    wire = generate(spec, 8, seed=5).to_wire(spec)
    with ClosedLoopClients(layer.grpc_url, spec, wire, IN_FLIGHT) as clients:
        replicas = layer.servers["stable"]
        wait_for(lambda: all(_requests(s) > 0 for s in replicas), 30, "both replicas serving")
        victim = replicas[KILLED]
        assert victim.process is not None
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.wait()
        assert orphaned_stubs(victim.process.pid)  # its stubs outlive it ...
        served_at_kill = clients.counts["ok"]
        survivor = replicas[1 - KILLED]
        at_kill = _requests(survivor)
        wait_for(lambda: _requests(survivor) > at_kill + 50, 30, "the survivor serving on")
        assert clients.counts["ok"] > served_at_kill
        restarted = layer.restart("stable", KILLED)
        assert not orphaned_stubs(victim.process.pid)  # ... until the dead server is stopped
        rejoined_s = wait_for(lambda: _requests(restarted) > 0, 60, "the restarted replica taking traffic")
    counts, errors = clients.counts, clients.errors
    assert counts["failed"] <= IN_FLIGHT, errors
    assert all("UNAVAILABLE" in e or "unavailable" in e.lower() for e in errors), errors
    print(f"failed {counts['failed']} of {sum(counts.values())}; rejoined after {rejoined_s:.1f} s")
