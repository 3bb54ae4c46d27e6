"""GPUs on this machine and the NVIDIA MPS control daemon (``recserve serve --mps``)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from recserve.server.child import Started
from recserve.server.runtime import ServerProcessError

LOGGER = logging.getLogger(__name__)


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
    return (
        [line for line in done.stdout.splitlines() if line.startswith("GPU ")] if done.returncode == 0 else []
    )


def require_gpu() -> list[str]:
    """The visible GPUs; raise :class:`ServerProcessError` when there is none."""
    gpus = visible_gpus()
    if not gpus:
        raise ServerProcessError(
            "the gpu profile needs an NVIDIA GPU, and nvidia-smi lists none on this machine"
        )
    return gpus


class MpsDaemon(Started):
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
        """``nvidia-cuda-mps-control -d``; raise :class:`ServerProcessError` when it is absent or fails."""
        if self.control is None:
            raise ServerProcessError(
                f"--mps needs {MPS_CONTROL} (NVIDIA driver utilities) on PATH; it is not installed here"
            )
        require_gpu()
        for sub in ("pipe", "log"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [self.control, "-d"], env=self.env(), capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            raise ServerProcessError(f"{MPS_CONTROL} -d failed ({done.returncode}): {done.stderr.strip()}")
        self.running = True
        LOGGER.info("MPS control daemon started (pipes in %s)", self.folder / "pipe")
        return self

    def stop(self) -> None:
        """Send ``quit`` to the control daemon (it stops its server too)."""
        if not self.running or self.control is None:
            return
        subprocess.run(
            [self.control], input="quit\n", env=self.env(), capture_output=True, text=True, timeout=60
        )
        self.running = False
        LOGGER.info("MPS control daemon stopped")
