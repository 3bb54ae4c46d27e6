"""What the steps share: the call's Context, a Step, its StepResult and the Skip it may raise."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import tail


@dataclass
class StepResult:
    """One step's outcome."""

    name: str
    part: int
    status: str  # ok, failed, skipped
    seconds: float = 0.0
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


class Skip(Exception):
    """Raised by a step that does not apply here; the message is the reason."""


class Failed(Exception):
    """Raised by a step that failed with results worth keeping (a measurement cut short)."""

    def __init__(self, message: str, data: dict[str, Any]) -> None:
        super().__init__(message)
        self.data = data


@dataclass
class Context:
    """What the steps share."""

    root: Path
    kit: Path
    work: Path
    output: Path
    dry_run: bool
    gpus: list[str]
    tensorrt: bool = False
    deadline: float = 0.0
    #: the bench's ``embedding_lookup`` instances (None: the spec's ``[serving.instances]``)
    lookup_instances: int | None = None
    logs: Path = field(init=False)
    #: what steps hand on to later steps of the call (the bench's server, its figures)
    shared: dict[str, Any] = field(default_factory=dict)
    #: closes what steps opened for later ones (the bench's server), when the call's steps are done
    stack: ExitStack = field(default_factory=ExitStack)
    #: set by the runner: ``partial(step, data)`` rewrites the outputs with a running step's data so far
    partial: Callable[[str, dict[str, Any]], None] = field(default=lambda step, data: None)

    def __post_init__(self) -> None:
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    @property
    def venv(self) -> Path:
        """The environment the GPU steps run in (this interpreter's in a dry run)."""
        return Path(sys.prefix) if self.dry_run else self.work / "venv"

    @property
    def python(self) -> str:
        """Its interpreter."""
        return sys.executable if self.dry_run else str(self.venv / "bin" / "python")

    @property
    def repository(self) -> Path:
        """The built model repository."""
        return self.root / "model_repository"

    def env(self) -> dict[str, str]:
        """Environment of the steps' commands: the venv first on PATH, the kit's libb64 found."""
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), env.get("PATH", "")])
        libs = [str(self.work / "lib"), env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
        env.pop("PYTHONPATH", None)
        return env

    def remaining(self) -> float:
        """Seconds left in this call."""
        return self.deadline - time.monotonic()

    def sh(self, name: str, command: Sequence[str], timeout: float, check: bool = True) -> str:
        """Run ``command`` (its output appended to ``logs/name.log``); raise on failure or time-out."""
        timeout = min(timeout, max(self.remaining() - 5, 1))
        with open(self.logs / f"{name}.log", "a") as fh:
            fh.write(f"\n$ {' '.join(command)}\n")
        try:
            done = subprocess.run(
                list(command),
                cwd=self.root,
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            with open(self.logs / f"{name}.log", "a") as fh:
                fh.write(out)
            raise RuntimeError(
                f"timed out after {timeout:.0f} s: {' '.join(command[:4])}\n{tail(out)}"
            ) from exc
        with open(self.logs / f"{name}.log", "a") as fh:
            fh.write(done.stdout + done.stderr + f"\n(exit {done.returncode})\n")
        if check and done.returncode != 0:
            raise RuntimeError(
                f"exit {done.returncode}: {' '.join(command[:4])}\n{tail(done.stdout + done.stderr)}"
            )
        return done.stdout

    def watch(
        self, name: str, command: Sequence[str], timeout: float, tick: Callable[[], None], every: float = 5.0
    ) -> None:
        """Run ``command`` like :meth:`sh`, calling ``tick`` every ``every`` seconds while it runs.

        Raises:
            RuntimeError: the command failed or ran past ``timeout`` (then it is killed).
        """
        timeout = min(timeout, max(self.remaining() - 5, 1))
        with open(self.logs / f"{name}.log", "a") as fh:
            fh.write(f"\n$ {' '.join(command)}\n")
            fh.flush()
            process = subprocess.Popen(
                list(command),
                cwd=self.root,
                env=self.env(),
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            limit = time.monotonic() + timeout
            while process.poll() is None and time.monotonic() < limit:
                try:
                    process.wait(min(every, max(limit - time.monotonic(), 0.1)))
                except subprocess.TimeoutExpired:
                    tick()
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                fh.write(f"\n(killed after {timeout:.0f} s)\n")
                raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(command[:4])}")
            fh.write(f"\n(exit {process.returncode})\n")
        tick()
        if process.returncode != 0:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
            raise RuntimeError(f"exit {process.returncode}: {' '.join(command[:4])}\n{tail(text)}")


@dataclass(frozen=True)
class Step:
    """A step of the run: its part, time limit and whether it needs a GPU (or TensorRT)."""

    name: str
    part: int
    timeout_s: float
    body: Callable[[Context], tuple[str, dict[str, Any]]]
    gpu: bool = False
    tensorrt: bool = False
    what: str = ""
    #: a GPU step that a dry run walks on the CPU (``device="cpu"``, tiny sizes) instead of skipping
    walks_dry: bool = False
    #: the other parts it runs in (the install runs in the bench's call too)
    also: tuple[int, ...] = ()


def detect_gpus() -> list[str]:
    """GPU names from nvidia-smi ([] without one)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
