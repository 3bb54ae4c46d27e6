"""The stub processes of a running tritonserver, and the watchdog that reloads a model whose stub died."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recserve.server.process import TritonServer

LOGGER = logging.getLogger(__name__)


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


def zombie_returncode(pid: int) -> int | None:
    """How a dead child that its parent has not reaped yet ended, as :attr:`Popen.returncode` reads.

    ``/proc/<pid>/stat`` of a zombie keeps its wait status (field 52, Linux 3.5 and later): a
    signal's number as a negative code, or the exit code. None when ``pid`` is gone, alive, or the
    field is not there.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "Z" or len(fields) < 50:  # fields[0] is field 3, the state
        return None
    status = int(fields[49])
    return -(status & 0x7F) if status & 0x7F else status >> 8


def dead_stubs(server_pid: int) -> list[int]:
    """Stub processes of a live tritonserver ``server_pid`` that died and were not reaped (zombies).

    The Python backend of tritonserver 2.51 does not wait for a stub that died under it, so a
    dead stub stays its zombie child: named (``triton_python_b``, the command truncated by the
    kernel) but without a command line.
    """
    found = []
    for pid in _children(server_pid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, _, rest = stat.partition(" (")[2].rpartition(")")
        if name.startswith("triton_python_b") and rest.split()[:1] == ["Z"]:
            found.append(pid)
    return found


def orphaned_stubs(server_pid: int) -> list[int]:
    """Stub processes still alive that tritonserver ``server_pid`` started before it died.

    A stub outlives a server killed with SIGKILL. Its command line names the server's pid (the
    argument after the two shared-memory sizes), which is how it is found once reparented.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            argv[0].endswith(b"triton_python_backend_stub")
            and len(argv) > 5
            and argv[5] == str(server_pid).encode()
        ):
            found.append(int(entry.name))
    return found


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

    def __init__(
        self, server: TritonServer, expected: dict[str, int], interval_s: float = 0.25, grace_s: float = 5.0
    ) -> None:
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
        """Poll until stopped or the server exits; reload a model with a dead stub (once per grace period).

        A poll that fails for any reason (a process gone while it was read, a server that answered
        nothing readable) is logged and the next one tries again: the watchdog never stops before
        the server does.
        """
        last: dict[str, float] = {}
        while not self._stop_event.wait(self.interval_s):
            process = self.server.process
            if process is None or process.poll() is not None:
                code = process and process.returncode
                LOGGER.warning("tritonserver exited (%s); the stub watchdog stops", code)
                return
            try:
                self._reload_missing(last)
            except Exception:
                LOGGER.exception("a poll of the stub watchdog failed; the next one tries again")

    def _reload_missing(self, last: dict[str, float]) -> None:
        """Reload each model short of a stub unless ``last`` (model -> when tried) is within the grace."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

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
