"""TorchServe 0.12 serving the same model on loopback, installed and started by the benchmark.

TorchServe is not a dependency of recserve: :func:`ensure_installed` adds it to the running
environment with pip on first use (it needs Java 17). :class:`TorchServe` archives
:mod:`recserve.perf.peers.torchserve_handler`, starts ``torchserve --foreground`` in its own process
group and stops it with SIGTERM to that group.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from recserve.server import LOOPBACK, ChildProcess, Ports, port_in_use

LOGGER = logging.getLogger(__name__)

PACKAGES = ("torchserve==0.12.0", "torch-model-archiver==0.12.0", "pyyaml")
MODEL_NAME = "ctr"


#: TorchServe logs every request and metric at INFO by default; Triton logs none. Warnings only,
#: so that neither server pays for logging in the comparison.
QUIET_LOG4J = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <Console name="STDOUT" target="SYSTEM_OUT"><PatternLayout pattern="%d [%-5p] %t %c - %m%n"/></Console>
  </Appenders>
  <Loggers><Root level="warn"><AppenderRef ref="STDOUT"/></Root></Loggers>
</Configuration>
"""


class TorchServeError(RuntimeError):
    """TorchServe could not be installed, archived or started."""


@dataclass(frozen=True)
class TorchServeSettings:
    """Batching and workers as a TorchServe user would set them (TorchServe's default: a worker per core)."""

    workers: int = max(1, len(os.sched_getaffinity(0)))
    batch_size: int = 16
    max_batch_delay_ms: int = 2


def ensure_installed() -> None:
    """pip-install TorchServe, its archiver and pyyaml into this environment when missing."""
    if all(importlib.util.find_spec(m) for m in ("ts", "model_archiver", "yaml")):
        return
    if shutil.which("java") is None:
        raise TorchServeError("TorchServe needs Java 17 ('java' is not on PATH)")
    LOGGER.info("installing %s", " ".join(PACKAGES))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", *PACKAGES], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise TorchServeError(f"pip install {' '.join(PACKAGES)} failed:\n{done.stderr[-2000:]}")
    importlib.invalidate_caches()


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


class TorchServe(ChildProcess):
    """A TorchServe process serving ``ctr`` from the built repository, on free loopback ports."""

    def __init__(
        self, spec_path: Path, repository: Path, workdir: Path, settings: TorchServeSettings | None = None
    ) -> None:
        super().__init__(workdir / "torchserve.log", new_group=True)
        self.spec_path = spec_path
        self.repository = repository
        self.workdir = workdir
        self.settings = settings or TorchServeSettings()
        self.ports = Ports.free()

    @property
    def inference_url(self) -> str:
        """``host:port`` of the inference API."""
        return f"{LOOPBACK}:{self.ports.http}"

    def archive(self) -> Path:
        """``model_store/ctr.mar`` holding the handler, its settings and TorchServe's model config."""
        store = self.workdir / "model_store"
        store.mkdir(parents=True, exist_ok=True)
        settings = self.workdir / "recserve.json"
        settings.write_text(
            json.dumps({"spec": str(self.spec_path.resolve()), "repository": str(self.repository.resolve())})
        )
        model_config = self.workdir / "model-config.yaml"
        s = self.settings
        model_config.write_text(
            f"minWorkers: {s.workers}\nmaxWorkers: {s.workers}\nbatchSize: {s.batch_size}\n"
            f"maxBatchDelay: {s.max_batch_delay_ms}\nresponseTimeout: 120\n"
        )
        handler = Path(__file__).with_name("torchserve_handler.py")
        command = [
            _bin("torch-model-archiver"), "--model-name", MODEL_NAME, "--version", "1",
            "--handler", str(handler), "--extra-files", str(settings),
            "--config-file", str(model_config), "--export-path", str(store), "--force",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, cwd=self.workdir)
        if done.returncode != 0:
            raise TorchServeError(f"torch-model-archiver failed:\n{done.stderr[-2000:]}")
        return store

    def start(self, timeout_s: float = 180.0) -> TorchServe:
        """Archive, start, and wait until the model answers ``/ping`` and is loaded."""
        ensure_installed()
        store = self.archive()
        config = self.workdir / "config.properties"
        log_config = self.workdir / "log4j2.xml"
        log_config.write_text(QUIET_LOG4J)
        config.write_text(
            f"vmargs=-Dlog4j.configurationFile=file://{log_config}\n"
            f"inference_address=http://{LOOPBACK}:{self.ports.http}\n"
            f"management_address=http://{LOOPBACK}:{self.ports.grpc}\n"
            f"metrics_address=http://{LOOPBACK}:{self.ports.metrics}\n"
            f"model_store={store}\nload_models={MODEL_NAME}.mar\n"
            "disable_token_authorization=true\ninstall_py_dep_per_model=false\n"
            "enable_envvars_config=false\ndisable_system_metrics=true\n"
        )
        for port in (self.ports.http, self.ports.grpc, self.ports.metrics):
            if port_in_use(port):
                raise TorchServeError(f"port {port} is already in use")
        env = dict(
            os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        )
        env["LOG_LOCATION"] = str(self.workdir / "logs")
        env["METRICS_LOCATION"] = str(self.workdir / "logs")
        self.spawn(  # in a process group of its own: the Java frontend and the Python workers
            [_bin("torchserve"), "--start", "--foreground", "--ncs", "--disable-token-auth",
             "--ts-config", str(config), "--model-store", str(store)],
            cwd=self.workdir, env=env,
        )  # fmt: skip
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://{LOOPBACK}:{self.ports.grpc}/models/{MODEL_NAME}"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise TorchServeError(f"torchserve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    workers = json.load(response)[0].get("workers", [])
                    if workers and all(w.get("status") == "READY" for w in workers):
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError, IndexError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TorchServeError(f"torchserve not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the process group this object started, SIGKILL after ``timeout_s``.

        The Java frontend and the Python workers share the group: none outlives the stop.
        """
        self.halt(timeout_s)
        self.process = None
