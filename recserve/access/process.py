"""Processes of the access layer: Envoy, and the tritonservers of the variants behind it.

:class:`AccessLayer` starts one tritonserver per variant on free loopback ports, writes the
generated config, starts the proxy (:class:`EnvoyProxy`) in front of them, restarts a server that
dies (:meth:`AccessLayer.supervise`), and stops everything it started, proxy first.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from recserve.access.admin import AdminClient
from recserve.access.canary import controller as canary
from recserve.access.config import (
    LOOPBACK,
    PROTOCOLS,
    AccessError,
    ProxyPorts,
    Upstream,
    cluster_name,
    envoy_config,
    write_config,
)
from recserve.access.envoy import EnvoyProxy, envoy_binary, validate
from recserve.access.front_door import FrontDoor, served_spec
from recserve.access.value_door import ValueDoor
from recserve.core.sections.serving import AccessSection
from recserve.server import Backoff, Ports, Started, Supervisor, TritonServer, port_in_use
from recserve.server.runtime import ServerProcessError
from recserve.server.supervisor import Supervised

__all__ = ["AccessLayer", "EnvoyProxy", "envoy_binary", "run_foreground", "validate"]

LOGGER = logging.getLogger(__name__)

CONFIG_FILE = "envoy.json"
SUPERVISOR_FILE = "supervisor.json"  # per server: crashes, restarts, last cause (see Supervisor)
PROXY_NAME = "envoy"  # the proxy's name in the supervisor's counts


class AccessLayer(Started):
    """Envoy in front of the variants' tritonservers, all on loopback except the public listeners.

    Use as a context manager. Everything is stopped by PID on exit: the proxy first, so that no new
    request reaches a stopping server, then the servers.

    Args:
        access: the spec's ``[access]``.
        repositories: variant -> its model repository, served by ``access.replicas`` tritonservers;
            or a list of repositories, one tritonserver each (replicas as on separate machines,
            each with its own update log). ``stable`` is required.
        workdir: where the config and the logs go.
        ports: the proxy's ports; None: the ones in ``access``.
        config_name: the servers' ``--model-config-name`` (a queue policy); None: ``config.pbtxt``.
        server_cpus: cores for the tritonservers (and their stubs); None: not pinned.
        proxy_cpus: cores for Envoy; None: not pinned.
        proxy_priority: Envoy's niceness increment (see :class:`EnvoyProxy`).
    """

    def __init__(
        self,
        access: AccessSection,
        repositories: Mapping[str, Path | Sequence[Path]],
        workdir: Path,
        ports: ProxyPorts | None = None,
        config_name: str | None = None,
        server_cpus: frozenset[int] | None = None,
        proxy_cpus: frozenset[int] | None = None,
        proxy_priority: int = 0,
    ) -> None:
        if "stable" not in repositories:
            raise AccessError("the access layer needs a repository for the 'stable' variant")
        self.access = access
        self.repositories = {
            name: [paths] * access.replicas if isinstance(paths, Path) else list(paths)
            for name, paths in repositories.items()
        }
        self.workdir = workdir
        self.ports = ports or ProxyPorts.from_section(access)
        self.config_name = config_name
        self.server_cpus = server_cpus
        self.proxy_cpus = proxy_cpus
        self.proxy_priority = proxy_priority
        self.servers: dict[str, list[TritonServer]] = {}  # variant -> its replicas
        self.proxy: EnvoyProxy | None = None
        self.supervisor: Supervisor | None = None

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the public gRPC listener."""
        return f"{LOOPBACK if self.access.host in ('0.0.0.0', '::') else self.access.host}:{self.ports.grpc}"

    @property
    def http_url(self) -> str:
        """``host:port`` of the public HTTP listener."""
        return f"{LOOPBACK if self.access.host in ('0.0.0.0', '::') else self.access.host}:{self.ports.http}"

    @property
    def admin(self) -> AdminClient:
        """The proxy's admin client."""
        return AdminClient(f"{LOOPBACK}:{self.ports.admin}")

    def config(self) -> dict[str, object]:
        """The Envoy config for the running servers (with a canary's saved decision, if any)."""
        upstreams = {
            name: [Upstream(s.ports.grpc, s.ports.http) for s in replicas]
            for name, replicas in self.servers.items()
        }
        door = FrontDoor.from_repositories(path for paths in self.repositories.values() for path in paths)
        stable = self.repositories["stable"]
        value_door = ValueDoor.in_front_of(served_spec(stable[0]), stable, self.access.workers)
        door = dataclasses.replace(door, value_door=value_door)
        return envoy_config(canary.routed(self.access, self.workdir), upstreams, self.ports, door)

    def start(self, timeout_s: float = 180.0) -> AccessLayer:
        """Start the servers (side by side), then the proxy; wait until every live cluster is healthy."""
        for port in (self.ports.grpc, self.ports.http, self.ports.admin):
            if port_in_use(port):
                raise AccessError(f"port {port} is already in use; is another proxy or server running?")
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name, paths in self.repositories.items():
            self.servers[name] = [self._server(name, i, path, Ports.free()) for i, path in enumerate(paths)]
        try:
            with ThreadPoolExecutor(len(self.all_servers())) as pool:
                for future in [pool.submit(server.start, timeout_s) for server in self.all_servers()]:
                    future.result()
            self.start_proxy()
            metrics = {
                v: [f"{LOOPBACK}:{s.ports.metrics}" for s in replicas] for v, replicas in self.servers.items()
            }
            canary.Stack(f"{LOOPBACK}:{self.ports.admin}", metrics).save(self.workdir / canary.STACK_FILE)
        except BaseException:
            self.stop()
            raise
        LOGGER.info("access layer up: gRPC %s, HTTP %s", self.grpc_url, self.http_url)
        return self

    def start_proxy(self, healthy: bool = True) -> EnvoyProxy:
        """Write the config for the running servers, start Envoy, wait until the clusters are healthy.

        Args:
            healthy: wait until every cluster's hosts passed their health checks (False: until Envoy
                is live; its health checks take the servers in as they answer).
        """
        path = write_config(self.config(), self.workdir / CONFIG_FILE)
        self.proxy = EnvoyProxy(
            path,
            f"{LOOPBACK}:{self.ports.admin}",
            self.workdir / "envoy.log",
            self.access.workers,
            self.proxy_cpus,
            self.proxy_priority,
        )
        self.proxy.start()
        if healthy:
            self.proxy.wait_healthy([cluster_name(v, p) for v in self.servers for p in PROTOCOLS])
        return self.proxy

    def restart_proxy(self) -> EnvoyProxy:
        """Stop Envoy and start it again on the same ports.

        Runtime changes are lost; a canary's saved decision is not (the new config carries it).
        """
        if self.proxy is not None:
            self.proxy.stop()
        return self.start_proxy()

    def _server(self, variant: str, index: int, repository: Path, ports: Ports) -> TritonServer:
        suffix = f"-{index}" if len(self.repositories[variant]) > 1 else ""
        return TritonServer(
            repository,
            ports,
            log_path=self.workdir / f"tritonserver-{variant}{suffix}.log",
            config_name=self.config_name,
            cpus=self.server_cpus,
        )

    def scrape_targets(self) -> tuple[list[str], list[str]]:
        """``host:port`` of every tritonserver's metrics endpoint, and of Envoy's admin interface."""
        triton = [f"{LOOPBACK}:{server.ports.metrics}" for server in self.all_servers()]
        return triton, [f"{LOOPBACK}:{self.ports.admin}"]

    def all_servers(self) -> list[TritonServer]:
        """Every replica of every variant."""
        return [server for replicas in self.servers.values() for server in replicas]

    def restart(self, variant: str, index: int, timeout_s: float = 180.0) -> TritonServer:
        """Start replica ``index`` of ``variant`` again on its ports (after it died or was stopped).

        The proxy's health checks take it back: nothing in Envoy's config changes.
        """
        old = self.servers[variant][index]
        old.stop()
        server = self._server(variant, index, self.repositories[variant][index], old.ports)
        self.servers[variant][index] = server  # stopped by stop() even while it starts
        return server.start(timeout_s)

    def supervise(self, backoff: Backoff | None = None) -> Supervisor:
        """Restart every server that dies on its own or loses a stub, and the proxy when it dies.

        Counted in ``workdir/supervisor.json`` and ``supervisor.prom``. Envoy's health checks and
        outlier detection take a dead replica out of rotation and the restarted one back: the other
        replicas serve meanwhile. A dead proxy is started again on its ports with the config of the
        running servers (runtime changes are lost; a canary's saved decision is not).
        """
        names = {f"{v}-{i}": (v, i) for v, replicas in self.servers.items() for i in range(len(replicas))}

        def watched() -> dict[str, Supervised]:
            processes: dict[str, Supervised] = {name: self.servers[v][i] for name, (v, i) in names.items()}
            if self.proxy is not None:
                processes[PROXY_NAME] = self.proxy
            return processes

        def restart(name: str) -> Supervised:
            if name != PROXY_NAME:
                return self.restart(*names[name])
            if self.proxy is not None:
                self.proxy.stop()
            try:
                return self.start_proxy(healthy=False)
            except AccessError as exc:
                raise ServerProcessError(str(exc)) from exc

        self.supervisor = Supervisor(watched, restart, backoff, self.workdir / SUPERVISOR_FILE)
        self.supervisor.start()
        return self.supervisor

    def alive(self) -> bool:
        """True while the proxy and every server run."""
        processes = [s.process for s in self.all_servers()]
        processes.append(self.proxy.process if self.proxy is not None else None)
        return all(p is not None and p.poll() is None for p in processes)

    def stop(self) -> None:
        """Stop restarting, stop the proxy, then every server (each by its PID, side by side)."""
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.proxy is not None:
            self.proxy.stop()
        servers = self.all_servers()
        for server in servers:
            if server.process is not None and server.process.poll() is None:
                LOGGER.info("stopping tritonserver %s (pid %d)", server.repository, server.process.pid)
        if servers:
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(lambda server: server.stop(), servers))
        if self.supervisor is not None and self.supervisor.is_alive():
            self.supervisor.join(30)  # a restart in progress gives up
            for server in self.all_servers():  # one that was being started when the stop came
                server.stop()

    def log_tails(self, lines: int = 30) -> str:
        """The tails of the proxy's and the servers' logs."""
        parts = [f"--- envoy\n{self.proxy.log_tail(lines) if self.proxy else '(not started)'}"]
        parts += [
            f"--- tritonserver {name} {i}\n{s.log_tail(lines)}"
            for name, replicas in self.servers.items()
            for i, s in enumerate(replicas)
        ]
        return "\n".join(parts)


def run_foreground(layer: AccessLayer, on_ready: Callable[[AccessLayer], None] | None = None) -> int:
    """Run ``layer`` until SIGINT or SIGTERM, or until the proxy exits with code 0; then stop it all.

    A tritonserver that dies or loses a stub, and a proxy that dies, are restarted
    (:meth:`AccessLayer.supervise`); the stack stays up. Returns 0 after a signal, 1 when the proxy
    was stopped by someone else.
    """
    stopping = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stopping.set()

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with layer:
            layer.supervise()
            if on_ready is not None:
                on_ready(layer)
            died = False
            while not stopping.wait(0.5):
                proxy = layer.proxy.process if layer.proxy is not None else None
                if proxy is not None and proxy.poll() == 0:  # stopped by someone: not restarted
                    died = True
                    LOGGER.error("the proxy of the access layer exited:\n%s", layer.log_tails())
                    break
        return 1 if died else 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
