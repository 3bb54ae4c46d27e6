"""Run the real tritonserver shipped in the nvidia-pytriton wheel, without a container.

The wheel carries ``tritonserver``, the Python backend and one stub per Python version. The stub
finds packages through the interpreter on ``PATH`` (it ignores ``PYTHONPATH``), so the server is
started with this environment's ``bin/`` first on ``PATH`` and its ``LIBDIR`` on
``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

LOGGER = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

#: Request header that unlocks the restricted APIs (HTTP header / gRPC metadata key).
ADMIN_HEADER = "recserve-admin-key"
#: Triton expects restricted-protocol metadata on gRPC under this prefix.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
#: APIs only a caller holding the admin key may use: loading and unloading models, changing log and
#: trace settings. Client shared memory is added unless it is asked for explicitly.
RESTRICTED_APIS = ("model-repository", "logging", "trace")
SHARED_MEMORY_API = "shared-memory"
MODEL_CONTROL_MODES = ("none", "explicit")


class ServerError(RuntimeError):
    """tritonserver could not be prepared, did not become ready, or died."""


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


def _site_packages_of(package: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ServerError(f"package {package!r} is not installed; run 'make install'")
    return Path(spec.origin).parent.parent


def runtime_dir() -> Path:
    """Where the writable copy of the server lives (inside this environment)."""
    return Path(sys.prefix) / "share" / "recserve" / "tritonserver"


def prepare_runtime(target: Path | None = None) -> Path:
    """Copy the wheel's server into a writable folder with the stub of this Python; idempotent."""
    target = target or runtime_dir()
    source = _site_packages_of("pytriton") / "pytriton" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = source / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"no Python-backend stub for Python {version} in {source}")
    installed_stub = target / "backends" / "python" / "triton_python_backend_stub"
    if not installed_stub.is_file():
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
        shutil.copy2(stub, staging / "backends" / "python" / "triton_python_backend_stub")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: this venv's interpreter first on PATH, its libs on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    libs = [
        str(_site_packages_of("pytriton") / "nvidia_pytriton.libs"),
        str(sysconfig.get_config_var("LIBDIR")),
    ]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("PYTHONPATH", None)
    return env


@dataclass(frozen=True)
class Security:
    """Who may do what on a served repository.

    Attributes:
        model_control: ``none`` (the repository is fixed at start) or ``explicit`` (models are loaded
            and reloaded through the model-repository API, which needs the admin key).
        admin_key: value of the ``recserve-admin-key`` header that unlocks the restricted APIs; when
            None a random key is made and never shown, so those APIs stay closed to everyone.
        client_shared_memory: leave the shared-memory registration API open to every client.
    """

    model_control: str = "none"
    admin_key: str | None = None
    client_shared_memory: bool = False

    def __post_init__(self) -> None:
        if self.model_control not in MODEL_CONTROL_MODES:
            raise ServerError(f"model control must be one of {MODEL_CONTROL_MODES}, got {self.model_control!r}")
        if self.model_control == "explicit" and not self.admin_key:
            raise ServerError("model control 'explicit' needs an admin key (--admin-key or RECSERVE_ADMIN_KEY)")

    @property
    def restricted_apis(self) -> tuple[str, ...]:
        """APIs behind the admin key."""
        return RESTRICTED_APIS if self.client_shared_memory else (*RESTRICTED_APIS, SHARED_MEMORY_API)

    def arguments(self) -> list[str]:
        """tritonserver flags for model control and the key-restricted APIs (HTTP and gRPC alike)."""
        key = self.admin_key or secrets.token_urlsafe(32)
        restriction = f"{','.join(self.restricted_apis)}:{ADMIN_HEADER}={key}"
        model_control = [f"--model-control-mode={self.model_control}"]
        if self.model_control == "explicit":
            model_control.append("--load-model=*")
        return [*model_control, f"--http-restricted-api={restriction}", f"--grpc-restricted-protocol={restriction}"]

    def headers(self, protocol: str = "grpc") -> dict[str, str]:
        """Headers a client sends to use the restricted APIs (gRPC metadata carries Triton's prefix)."""
        if not self.admin_key:
            return {}
        return {(GRPC_HEADER_PREFIX if protocol == "grpc" else "") + ADMIN_HEADER: self.admin_key}


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
        "--log-verbose=0",
        *(extra or []),
    ]


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """True when something already listens on ``host:port``."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class TritonServer:
    """A tritonserver child process: started, watched until ready, stopped with SIGINT.

    Use as a context manager. The server log goes to ``log_path`` (or is inherited when None).
    ``config_name`` serves ``<model>/configs/<name>.pbtxt`` where a model has one (a hardware or
    queue profile); ``cpus`` pins tritonserver, and with it every stub it starts, to those cores.
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
        self.repository = repository
        self.ports = ports or Ports()
        self.log_path = log_path
        self.host = host
        self.security = security or Security()
        self.exit_timeout_s = exit_timeout_s
        self.config_name = config_name
        self.cpus = cpus
        self.process: subprocess.Popen[bytes] | None = None
        self.watchdog: StubWatchdog | None = None

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
                raise ServerError(f"port {port} is already in use; is another tritonserver running?")
        log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115 - closed in stop()
        self._log = log
        extra = [f"--model-config-name={self.config_name}"] if self.config_name else None
        cpus = self.cpus
        self.process = subprocess.Popen(
            server_command(self.repository, self.ports, self.host, extra, security=self.security, exit_timeout_s=self.exit_timeout_s),
            env=server_env(),
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        self.wait_ready(timeout_s)
        if self.security.model_control == "explicit":
            self.watchdog = StubWatchdog(self, expected_stubs(self.repository))
            self.watchdog.start()
        return self

    def is_ready(self) -> bool:
        """True when ``/v2/health/ready`` answers 200 now."""
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
                raise ServerError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"tritonserver not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stubs(self) -> dict[int, str]:
        """Live Python-backend stub processes of this server: pid -> model name."""
        return stub_processes(self.process.pid) if self.process is not None else {}

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of the server log."""
        if not self.log_path or not self.log_path.exists():
            return "(log not captured)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop taking ensemble requests and wait until the accepted ones have finished.

        tritonserver alone, on SIGINT/SIGTERM, stops every model's scheduler at once, so an ensemble
        request between two steps is refused by the next one. With model control ``explicit`` the
        ensembles are unloaded first instead: new requests are refused at the door, the composing
        models stay up until every accepted request is through. Returns False when nothing could
        be drained (model control ``none``) or time ran out.
        """
        if self.security.model_control != "explicit" or self.process is None or self.process.poll() is not None:
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
                    if not any(m.get("name") in ensembles and m.get("state") in ("READY", "UNLOADING") for m in index):
                        return True
                    time.sleep(0.05)
        except InferenceServerException as exc:
            LOGGER.warning("draining failed, stopping anyway: %s", exc)
        return False

    def stop(self, timeout_s: float = 60.0, signum: int = signal.SIGINT) -> int | None:
        """Drain (model control ``explicit``), signal, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.process is None:
            return None
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.process.poll() is None:
            self.drain()
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "_log", None):
            self._log.close()
        return self.process.returncode

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


MPS_CONTROL = "nvidia-cuda-mps-control"


def visible_gpus() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (empty when there is no driver or no GPU)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in done.stdout.splitlines() if line.startswith("GPU ")] if done.returncode == 0 else []


def require_gpu() -> list[str]:
    """The visible GPUs; raise :class:`ServerError` when there is none."""
    gpus = visible_gpus()
    if not gpus:
        raise ServerError("the gpu profile needs an NVIDIA GPU, and nvidia-smi lists none on this machine")
    return gpus


class MpsDaemon:
    """The NVIDIA MPS control daemon, started before tritonserver and stopped after it.

    With MPS, the CUDA contexts of all instance processes (one per Python-backend instance) share
    the GPU through one server instead of time-slicing. The daemon's pipe and log folders live in
    ``folder``; tritonserver gets the same ``CUDA_MPS_*`` variables so its processes find it.
    """

    def __init__(self, folder: Path, control: str | None = None) -> None:
        self.folder = folder
        self.control = control or shutil.which(MPS_CONTROL)
        self.running = False

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (or the current environment) with the daemon's pipe and log folders."""
        env = dict(os.environ if base is None else base)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.folder / "pipe")
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.folder / "log")
        return env

    def start(self) -> MpsDaemon:
        """``nvidia-cuda-mps-control -d``; raise :class:`ServerError` when it is absent or fails."""
        if self.control is None:
            raise ServerError(f"--mps needs {MPS_CONTROL} (NVIDIA driver utilities) on PATH; it is not installed here")
        require_gpu()
        for sub in ("pipe", "log"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        done = subprocess.run([self.control, "-d"], env=self.env(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise ServerError(f"{MPS_CONTROL} -d failed ({done.returncode}): {done.stderr.strip()}")
        self.running = True
        LOGGER.info("MPS control daemon started (pipes in %s)", self.folder / "pipe")
        return self

    def stop(self) -> None:
        """Send ``quit`` to the control daemon (it stops its server too)."""
        if not self.running or self.control is None:
            return
        subprocess.run([self.control], input="quit\n", env=self.env(), capture_output=True, text=True, timeout=60)
        self.running = False
        LOGGER.info("MPS control daemon stopped")

    def __enter__(self) -> MpsDaemon:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


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


def _children(pid: int) -> list[int]:
    """Child processes of ``pid``, forked by any of its threads (models load on worker threads)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def stub_processes(server_pid: int) -> dict[int, str]:
    """Python-backend stub processes started by tritonserver ``server_pid``: pid -> model name.

    The stub is started with its ``model.py`` path as first argument
    (``.../<model>/<version>/model.py``), which names the model.
    """
    stubs = {}
    for pid in _children(server_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"triton_python_backend_stub") and len(argv) > 1:
            stubs[pid] = Path(argv[1].decode(errors="replace")).parent.parent.name
    return stubs


def _configs(repository: Path) -> dict[str, Any]:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    configs = {}
    for path in sorted(repository.glob("*/config.pbtxt")):
        config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        configs[config.name or path.parent.name] = config
    return configs


def expected_stubs(repository: Path) -> dict[str, int]:
    """Python-backend models of a repository and how many stub processes (instances) each runs."""
    return {
        name: sum(g.count or 1 for g in config.instance_group) or 1
        for name, config in _configs(repository).items()
        if config.backend == "python"
    }


def ensemble_names(repository: Path) -> list[str]:
    """The ensembles of a repository (what clients call)."""
    return [name for name, config in _configs(repository).items() if config.platform == "ensemble"]


class StubWatchdog(threading.Thread):
    """Reload a model whose stub process died, so service returns without a server restart.

    The bundled Python backend does not restart a killed stub: every later request to that model
    fails ("Stub process ... is not healthy"). The watchdog polls the server's stub processes and,
    when a model runs fewer than its instance count while the server is ready, reloads it through
    the key-restricted model-repository API (model control ``explicit``).
    """

    def __init__(self, server: TritonServer, expected: dict[str, int], interval_s: float = 0.25, grace_s: float = 5.0) -> None:
        super().__init__(name="stub-watchdog", daemon=True)
        self.server = server
        self.expected = expected
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.reloads: list[tuple[float, str]] = []
        self._stop_event = threading.Event()

    def stop(self) -> None:
        """Stop watching (before the server is stopped, so that its exit is not taken for a crash)."""
        self._stop_event.set()
        self.join(30)

    def missing(self) -> list[str]:
        """Models running fewer stubs than their instance count."""
        counts: dict[str, int] = {}
        for model in self.server.stubs().values():
            counts[model] = counts.get(model, 0) + 1
        return [model for model, count in self.expected.items() if counts.get(model, 0) < count]

    def run(self) -> None:
        """Poll until stopped; reload each model with a dead stub (at most once per grace period)."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        last: dict[str, float] = {}
        while not self._stop_event.wait(self.interval_s):
            process = self.server.process
            if process is None or process.poll() is not None:
                return
            for model in self.missing():
                if time.monotonic() - last.get(model, -self.grace_s) < self.grace_s or not self.server.is_ready():
                    continue
                last[model] = time.monotonic()
                LOGGER.warning("a stub process of model %r died; reloading the model", model)
                try:
                    with grpcclient.InferenceServerClient(self.server.grpc_url) as client:
                        client.load_model(model, headers=self.server.security.headers("grpc"))
                    self.reloads.append((time.monotonic(), model))
                except InferenceServerException as exc:
                    LOGGER.error("reloading model %r failed: %s", model, exc)


def run_foreground(server: TritonServer) -> int:
    """Run ``server`` until it exits (``recserve serve``); SIGINT or SIGTERM drains, then stops it."""
    stopping = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    server.start()
    assert server.process is not None
    while server.process.poll() is None and not stopping.wait(0.5):
        pass
    return server.stop(timeout_s=server.exit_timeout_s + 10, signum=signal.SIGTERM) or 0
