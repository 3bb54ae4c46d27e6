"""A tritonserver child process: command line, start, readiness, drain and stop."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from recserve.core.names import GPU_PROFILES, TRAFFIC_HEADER, VARIANT_HEADER
from recserve.core.sections.degrade import (
    LAMBDA_HEADER,
    METRICS_URL_ENV,
    ORDERED_HEADER,
    REFUSED_HEADER,
    VALUE_HEADER,
)
from recserve.server.child import ChildProcess, read_tail
from recserve.server.mps import visible_gpus
from recserve.server.runtime import ServerProcessError, prepare_runtime, server_env
from recserve.server.security import Security
from recserve.server.shm import backend_argument, region_prefix, remove_regions
from recserve.server.watchdog import (
    StubWatchdog,
    ensemble_names,
    expected_stubs,
    orphaned_stubs,
    stub_processes,
)

LOGGER = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: How long the log tail of a dead server waits for the output still in its pipe.
ECHO_DRAIN_S = 0.5


@dataclass(frozen=True)
class Ports:
    """The three ports tritonserver listens on."""

    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> Ports:
        """Three currently free loopback ports."""
        sockets = [socket.socket() for _ in range(3)]
        try:
            for s in sockets:
                s.bind((LOOPBACK, 0))
            http, grpc, metrics = (s.getsockname()[1] for s in sockets)
        finally:
            for s in sockets:
                s.close()
        return cls(http, grpc, metrics)


#: Triton's CUDA memory pool on each GPU (its own default is 64 MiB). The GPU tensors that the
#: ensemble's steps hand each other stay in GPU memory only while they fit in it: past it Triton falls
#: back to pinned host memory, a copy each way, and in 2.51 the Python stub then fails to load some of
#: those buffers. One list of 4,096 candidates is about 7 MB of lookup outputs, 1,024 rows with their
#: own 256-long histories about 19 MB: 1 GiB holds over 50 of the largest requests in flight.
CUDA_POOL_BYTES = 1 << 30


def config_arguments(config_name: str | None) -> list[str]:
    """The server arguments that serve ``<model>/configs/<config_name>.pbtxt`` (none: the default).

    A GPU profile also gets a CUDA memory pool of :data:`CUDA_POOL_BYTES` on every visible GPU.
    """
    if not config_name:
        return []
    arguments = [f"--model-config-name={config_name}"]
    if config_name in GPU_PROFILES:
        arguments += [
            f"--cuda-memory-pool-byte-size={gpu}:{CUDA_POOL_BYTES}" for gpu in range(len(visible_gpus()))
        ]
    return arguments


#: The request headers tritonserver hands every step as request parameters: the variant the access
#: layer routed a request to and its traffic kind (the request log's), the request's value, the
#: lambda the access layer's door chose its level at and what the door answered itself, which it
#: reports (``[degrade]``). Anchored: no other header (the admin key least of all) reaches a model.
FORWARDED_HEADERS = (
    f"^({VARIANT_HEADER}|{TRAFFIC_HEADER}|{VALUE_HEADER}|{LAMBDA_HEADER}|{REFUSED_HEADER}|{ORDERED_HEADER})$"
)


def metrics_env(ports: Ports, host: str = LOOPBACK) -> dict[str, str]:
    """The steps' way to the server's own metrics endpoint (``[degrade]`` reads the queue wait there)."""
    reachable = LOOPBACK if host in ("", "0.0.0.0", "::") else host  # noqa: S104 (a listening address)
    return {METRICS_URL_ENV: f"http://{reachable}:{ports.metrics}/metrics"}


def server_command(
    repository: Path,
    ports: Ports,
    host: str = LOOPBACK,
    extra: list[str] | None = None,
    security: Security | None = None,
    exit_timeout_s: int = 30,
) -> list[str]:
    """The tritonserver command line: loopback by default, model control ``none``, admin APIs locked."""
    runtime = prepare_runtime()
    security = security or Security()
    return [
        str(runtime / "bin" / "tritonserver"),
        f"--model-repository={repository.resolve()}",
        f"--backend-directory={runtime / 'backends'}",
        f"--cache-directory={runtime / 'caches'}",
        f"--http-address={host}",
        f"--http-port={ports.http}",
        f"--grpc-address={host}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-address={host}",
        f"--metrics-port={ports.metrics}",
        *security.arguments(),
        f"--exit-timeout-secs={exit_timeout_s}",
        f"--http-header-forward-pattern={FORWARDED_HEADERS}",
        f"--grpc-header-forward-pattern={FORWARDED_HEADERS}",
        "--log-verbose=0",
        *(extra or []),
    ]


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """True when something already listens on ``host:port``."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class TritonServer(ChildProcess):
    """A tritonserver child process: started, watched until ready, stopped with SIGINT.

    Use as a context manager. The server log goes to ``log_path`` (or, when None, to this process's
    stdout, its last lines kept for :meth:`log_tail`). ``config_name`` serves
    ``<model>/configs/<name>.pbtxt`` where a model has one (a hardware or queue policy); ``cpus``
    pins tritonserver, and with it every stub it starts, to those cores. The Python backend's
    shared-memory regions are named with ``shm_prefix``, and removed once the server is stopped.
    """

    def __init__(
        self,
        repository: Path,
        ports: Ports | None = None,
        log_path: Path | None = None,
        host: str = LOOPBACK,
        security: Security | None = None,
        exit_timeout_s: int = 30,
        config_name: str | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        super().__init__(log_path)
        self.repository = repository
        self.ports = ports or Ports()
        self.host = host
        self.security = security or Security()
        self.exit_timeout_s = exit_timeout_s
        self.config_name = config_name
        self.cpus = cpus
        self.watchdog: StubWatchdog | None = None
        self._tail: deque[str] = deque(maxlen=200)  # the last lines, when log_path is None
        self._echo_thread: threading.Thread | None = None  # copies them, when log_path is None
        self._stopping = threading.Event()  # set by stop(): a start in progress gives up
        self.shm_prefix = region_prefix()

    def renewed(self) -> TritonServer:
        """A new, unstarted server with the same settings (to start after this one died)."""
        return TritonServer(
            self.repository,
            self.ports,
            self.log_path,
            self.host,
            self.security,
            self.exit_timeout_s,
            self.config_name,
            self.cpus,
        )

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint."""
        return f"{LOOPBACK}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint."""
        return f"{LOOPBACK}:{self.ports.grpc}"

    def start(self, timeout_s: float = 180.0) -> TritonServer:
        """Start and wait until ``/v2/health/ready``; refuse to start over a busy port."""
        for port in (self.ports.http, self.ports.grpc, self.ports.metrics):
            if port_in_use(port):
                raise ServerProcessError(f"port {port} is already in use; is another tritonserver running?")
        if self._stopping.is_set() and self.process is None:  # stopped before it started
            raise ServerProcessError("tritonserver was stopped before it started")
        self._stopping.clear()
        extra = [*config_arguments(self.config_name), backend_argument(self.shm_prefix)]
        cpus = self.cpus
        self.spawn(
            server_command(
                self.repository,
                self.ports,
                self.host,
                extra,
                security=self.security,
                exit_timeout_s=self.exit_timeout_s,
            ),
            env={**server_env(), **metrics_env(self.ports, self.host)},
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        if self.log_path is None:
            self._echo_thread = threading.Thread(target=self._echo, name="tritonserver-log", daemon=True)
            self._echo_thread.start()
        self.wait_ready(timeout_s)
        if self.security.model_control == "explicit":
            self.watchdog = StubWatchdog(self, expected_stubs(self.repository))
            self.watchdog.start()
        return self

    def _echo(self) -> None:
        """Copy the server's output to this process's stdout, keeping the last lines."""
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self._tail.append(line.decode(errors="replace").rstrip("\n"))
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()

    def is_ready(self) -> bool:
        """True when ``/v2/health/ready`` answers 200 and the metrics port listens now.

        tritonserver opens its metrics endpoint after the HTTP one, so a ready HTTP endpoint alone
        does not mean ``/metrics`` answers yet.
        """
        if not port_in_use(self.ports.metrics):
            return False
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Poll readiness; raise with the log's tail if the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServerProcessError(
                    f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if self._stopping.is_set():
                raise ServerProcessError("tritonserver was stopped while starting")
            if self.is_ready():
                return
            time.sleep(0.25)
        self.stop()
        raise ServerProcessError(f"tritonserver not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stubs(self) -> dict[int, str]:
        """Live Python-backend stub processes of this server: pid -> model name."""
        return stub_processes(self.process.pid) if self.process is not None else {}

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of the server log."""
        if not self.log_path:
            exited = self.process is not None and self.process.poll() is not None
            if exited and self._echo_thread is not None:
                # its last lines may still be in the pipe (its stubs, alive a moment longer, hold it open)
                self._echo_thread.join(ECHO_DRAIN_S)
            return "\n".join(list(self._tail)[-lines:]) or "(no output)"
        return read_tail(self.log_path, lines, missing="(log not captured)")

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop taking ensemble requests and wait until the accepted ones have finished.

        tritonserver alone, on SIGINT/SIGTERM, stops every model's scheduler at once, so an ensemble
        request between two steps is refused by the next one. With model control ``explicit`` the
        ensembles are unloaded first instead: new requests are refused at the door, the composing
        models stay up until every accepted request is through. Returns False when nothing could
        be drained (model control ``none``) or time ran out.
        """
        if (
            self.security.model_control != "explicit"
            or self.process is None
            or self.process.poll() is not None
        ):
            return False
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        headers = self.security.headers("grpc")
        ensembles = ensemble_names(self.repository)
        deadline = time.monotonic() + timeout_s
        try:
            with grpcclient.InferenceServerClient(self.grpc_url) as client:
                for name in ensembles:
                    client.unload_model(name, headers=headers)
                while time.monotonic() < deadline:
                    index = client.get_model_repository_index(headers=headers, as_json=True).get("models", [])
                    if not any(
                        m.get("name") in ensembles and m.get("state") in ("READY", "UNLOADING") for m in index
                    ):
                        return True
                    time.sleep(0.05)
        except InferenceServerException as exc:
            LOGGER.warning("draining failed, stopping anyway: %s", exc)
        return False

    def stop(self, timeout_s: float = 60.0, signum: int = signal.SIGINT) -> int | None:
        """Drain (model control ``explicit``), signal, then SIGKILL after ``timeout_s``.

        Returns the exit code.
        """
        self._stopping.set()
        if self.process is None:
            return None
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.process.poll() is None:
            self.drain()
        self.halt(timeout_s, signum)
        for stub in orphaned_stubs(self.process.pid):  # left by a server that was killed
            LOGGER.warning("killing stub %d left by the dead tritonserver %d", stub, self.process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(stub, signal.SIGKILL)
        freed = remove_regions(self.shm_prefix)
        if freed:
            LOGGER.warning(
                "removed %d bytes of shared memory left by tritonserver %d", freed, self.process.pid
            )
        return self.process.returncode


def run_child(command: list[str], env: dict[str, str]) -> int:
    """Run tritonserver as a child until it exits (``--mps``); SIGINT/SIGTERM are passed on to it."""
    process = subprocess.Popen(command, env=env)

    def forward(signum: int, frame: object) -> None:
        process.send_signal(signal.SIGINT)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
