"""Run the real tritonserver shipped in the nvidia-pytriton wheel, without a container.

The wheel carries ``tritonserver``, the Python backend and one stub per Python version. The stub
finds packages through the interpreter on ``PATH`` (it ignores ``PYTHONPATH``), so the server is
started with this environment's ``bin/`` first on ``PATH`` and its ``LIBDIR`` on
``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

LOGGER = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


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


def server_command(repository: Path, ports: Ports, host: str = LOOPBACK, extra: list[str] | None = None) -> list[str]:
    """The tritonserver command line: loopback by default, model control ``none``."""
    runtime = prepare_runtime()
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
        "--model-control-mode=none",
        "--exit-timeout-secs=30",
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
    """

    def __init__(self, repository: Path, ports: Ports | None = None, log_path: Path | None = None, host: str = LOOPBACK) -> None:
        self.repository = repository
        self.ports = ports or Ports()
        self.log_path = log_path
        self.host = host
        self.process: subprocess.Popen[bytes] | None = None

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
        self.process = subprocess.Popen(
            server_command(self.repository, self.ports, self.host), env=server_env(), stdout=log, stderr=subprocess.STDOUT if log else None
        )
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Poll readiness; raise with the log's tail if the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"tritonserver not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of the server log."""
        if not self.log_path or not self.log_path.exists():
            return "(log not captured)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGINT, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
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


def run_foreground(command: list[str], env: dict[str, str]) -> int:
    """Run tritonserver as a child until it exits; SIGINT/SIGTERM are passed on to it."""
    process = subprocess.Popen(command, env=env)

    def forward(signum: int, frame: object) -> None:
        process.send_signal(signal.SIGINT)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
