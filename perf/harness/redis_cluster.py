"""A real Redis Cluster on loopback: Debian's redis-server, 3 masters + 3 replicas.

Used by the L3 tests and by ``recserve lab redis-outage``. Nodes keep no data on disk (no RDB, no AOF);
each keeps its cluster configuration (``nodes.conf``) in its own folder, so a killed node started
again with :meth:`RedisCluster.restart` rejoins the same cluster, empty.

Every node requires a password (``requirepass``, and ``masterauth`` for its replication), a new one
for each cluster, as a deployment should: while the cluster runs, the environment variable
:data:`PASSWORD_ENV` holds it, so ``[store] redis_password_env`` can name it for the servers started
meanwhile (they inherit the environment).
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from recserve.core.sections.serving import StoreSection

LOOPBACK = "127.0.0.1"
#: The environment variable that holds a running cluster's password (``[store] redis_password_env``).
PASSWORD_ENV = "RECSERVE_REDIS_PASSWORD"


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


#: A node's cluster bus listens on its port + 10000.
BUS_OFFSET = 10000


def ephemeral_start() -> int:
    """The first port the kernel hands to outgoing connections (32768 when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_cluster_ports(count: int) -> list[int]:
    """Ports free together with their cluster-bus ports (port + 10000).

    Both lie below the kernel's ephemeral range: a bus port inside it could be taken by any
    outgoing connection between this check and the node's bind (a node then fails to start).
    """
    highest = ephemeral_start() - BUS_OFFSET - 1
    ports: list[int] = []
    while len(ports) < count:
        port = random.randint(highest - 9999, highest)
        if port not in ports and _free(port) and _free(port + BUS_OFFSET):
            ports.append(port)
    return ports


class RedisCluster:
    """Start with ``with RedisCluster(folder) as cluster:``; every node is stopped at exit."""

    def __init__(
        self,
        folder: Path,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        password: str | None = None,
        tls: bool = False,
    ) -> None:
        """Plan the cluster.

        Args:
            folder: where each node keeps its files.
            masters: master nodes.
            replicas: replicas per master.
            node_timeout_ms: ``cluster-node-timeout``.
            password: every node's (None: a new random one; empty: no password).
            tls: clients, replication and the cluster bus speak TLS only, with certificates of a CA
                made for this cluster (``openssl`` is needed).
        """
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server and redis-cli are needed (make installs Debian's redis-server)")
        self.folder = folder
        self.ports = free_cluster_ports(masters * (1 + replicas))
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.processes: dict[int, subprocess.Popen] = {}
        self.password = secrets.token_hex(16) if password is None else password
        self.password_env = PASSWORD_ENV if self.password else ""  # what ``redis_password_env`` names
        self._saved_env: str | None = None
        self.tls_ca = folder / "tls" / "ca.crt" if tls else None  # the CA clients must trust

    @property
    def nodes(self) -> list[str]:
        """``host:port`` of every node."""
        return [f"{LOOPBACK}:{port}" for port in self.ports]

    def store_section(self, **settings: Any) -> StoreSection:
        """A ``[store]`` section that reaches this cluster (its nodes, the password's variable)."""
        tls = {"redis_ssl": True, "redis_ssl_ca_certs": str(self.tls_ca)} if self.tls_ca else {}
        return StoreSection(
            **{"redis_nodes": tuple(self.nodes), "redis_password_env": self.password_env, **tls, **settings}
        )

    def _make_certificates(self) -> None:
        """A CA and one certificate for every node (it names 127.0.0.1), valid for two days."""
        assert self.tls_ca is not None
        folder = self.tls_ca.parent
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "san.ext").write_text(f"subjectAltName=IP:{LOOPBACK}\n")
        steps = [
            ["req", "-x509", "-new", "-nodes", "-newkey", "rsa:2048", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=recserve test Redis CA"],
            ["req", "-new", "-nodes", "-newkey", "rsa:2048", "-keyout", "node.key", "-out", "node.csr",
             "-subj", f"/CN={LOOPBACK}"],
            ["x509", "-req", "-in", "node.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.crt", "-days", "2", "-extfile", "san.ext"],
        ]  # fmt: skip
        for step in steps:
            subprocess.run(["openssl", *step], cwd=folder, check=True, capture_output=True, timeout=60)

    def _spawn(self, port: int) -> None:
        node_dir = self.folder / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        config = node_dir / "node.conf"  # the password in a private file, not on the command line
        config.touch(mode=0o600)
        lines = [f"requirepass {self.password}", f"masterauth {self.password}"] if self.password else []
        listen = ["--port", str(port)]
        if self.tls_ca is not None:
            tls = self.tls_ca.parent
            lines += [
                f"tls-cert-file {tls / 'node.crt'}", f"tls-key-file {tls / 'node.key'}",
                f"tls-ca-cert-file {self.tls_ca}", "tls-cluster yes", "tls-replication yes",
                "tls-auth-clients no",
            ]  # fmt: skip
            listen = ["--port", "0", "--tls-port", str(port)]  # TLS only; the bus stays at port + 10000
        config.write_text("".join(f"{line}\n" for line in lines))
        self.processes[port] = subprocess.Popen(
            ["redis-server", str(config), *listen, "--bind", LOOPBACK, "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
             "--cluster-replica-validity-factor", "0",
             "--save", "", "--appendonly", "no", "--dir", str(node_dir), "--logfile", "redis.log"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _wait_started(self, port: int) -> None:
        self._wait(lambda: self.client(port, timeout_s=1).ping(), f"node {port} to start")

    def __enter__(self) -> RedisCluster:
        if self.password_env:
            self._saved_env = os.environ.get(self.password_env)
            os.environ[self.password_env] = self.password
        try:
            if self.tls_ca is not None:
                self._make_certificates()
            for port in self.ports:
                self._spawn(port)
            for port in self.ports:
                self._wait_started(port)
            subprocess.run(
                [
                    "redis-cli",
                    *self._cli_tls(),
                    "--cluster",
                    "create",
                    *self.nodes,
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                timeout=60,
                env=self._cli_env(),
            )
            self.wait_ok()
            self._wait(self._replicas_synced, "replicas to sync with their masters")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait(self, probe: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if probe():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
            time.sleep(0.1)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` and sees all slots served."""

        def ok() -> bool:
            for port, process in self.processes.items():
                if process.poll() is None:
                    if "cluster_state:ok" not in self.cli(port, "cluster", "info"):
                        return False
            return True

        self._wait(ok, "cluster_state:ok", timeout_s)

    def _replicas_synced(self) -> bool:
        roles = [self.cli(port, "info", "replication") for port in self.ports]
        replicas = [text for text in roles if "role:slave" in text]
        return len(replicas) == len(self.ports) - len(self.ports) // (1 + self.replicas) and all(
            "master_link_status:up" in text for text in replicas
        )

    def wait_replicated(self, timeout_s: float = 30.0) -> None:
        """Wait until every replica has every write its master took (replication is asynchronous).

        A replica that has just synced gets new writes only once its master has its first
        acknowledgement (sent about once a second): a master killed before then loses them, and the
        promoted replica serves without them. Call this after loading data that a failover must keep.
        """

        def caught_up() -> bool:
            for port in self.masters():
                info = dict(
                    line.split(":", 1)
                    for line in self.cli(port, "info", "replication").splitlines()
                    if ":" in line
                )
                offset = int(info.get("master_repl_offset", "0"))
                replicas = [
                    value for key, value in info.items() if key.startswith("slave") and key[5:].isdigit()
                ]
                if len(replicas) < self.replicas:
                    return False
                for replica in replicas:
                    fields = dict(item.split("=", 1) for item in replica.strip().split(","))
                    if int(fields.get("offset", "-1")) < offset:
                        return False
            return True

        self._wait(caught_up, "replicas to take every write of their masters", timeout_s)

    def masters(self) -> list[int]:
        """Ports of the live masters that serve slots."""
        live = next(p for p, proc in self.processes.items() if proc.poll() is None)
        text = self.cli(live, "cluster", "nodes")
        ports = []
        for line in text.splitlines():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2] and len(fields) > 8:
                ports.append(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(ports)

    def cli(self, port: int, *command: str) -> str:
        """Output of ``redis-cli -p port command...`` (authenticated)."""
        return subprocess.run(
            ["redis-cli", *self._cli_tls(), "-h", LOOPBACK, "-p", str(port), *command],
            capture_output=True,
            text=True,
            timeout=10,
            env=self._cli_env(),
        ).stdout

    def _cli_env(self) -> dict[str, str]:
        """redis-cli's environment: the password in ``REDISCLI_AUTH`` (``-a`` would show it in ``ps``)."""
        env = dict(os.environ)
        if self.password:
            env["REDISCLI_AUTH"] = self.password
        return env

    def _cli_tls(self) -> list[str]:
        return ["--tls", "--cacert", str(self.tls_ca)] if self.tls_ca is not None else []

    def client(self, port: int, timeout_s: float = 5.0) -> redis.Redis:
        """A plain (non-cluster) client of one node, with the password and TLS when the cluster has them."""
        return redis.Redis(
            LOOPBACK,
            port,
            password=self.password or None,
            socket_timeout=timeout_s,
            ssl=self.tls_ca is not None,
            ssl_ca_certs=str(self.tls_ca) if self.tls_ca is not None else None,
        )

    def kill(self, port: int) -> None:
        """``kill -9`` one node."""
        self.processes[port].kill()
        self.processes[port].wait()

    def kill_all(self) -> None:
        """``kill -9`` every node, masters and replicas: the whole cluster is gone."""
        for port in self.ports:
            self.kill(port)

    def restart(self, ports: list[int] | None = None, timeout_s: float = 30.0) -> None:
        """Start killed nodes again (all by default) and wait until the cluster serves every slot.

        They come back without data: whatever L3 needs must be loaded again.
        """
        ports = [p for p in (ports or self.ports) if self.processes[p].poll() is not None]
        for port in ports:
            self._spawn(port)
        for port in ports:
            self._wait_started(port)
        self.wait_ok(timeout_s)

    def stop(self) -> None:
        """Kill every node; restore the password's environment variable."""
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        if self.password_env and os.environ.get(self.password_env) == self.password:
            if self._saved_env is None:
                os.environ.pop(self.password_env, None)
            else:
                os.environ[self.password_env] = self._saved_env
