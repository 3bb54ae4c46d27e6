"""Restart a tritonserver that died on its own, or lost a stub: counted, logged with its cause, backed off.

tritonserver 2.51 can be killed by one request (a JSON body declaring a huge shape aborts it with
``std::bad_alloc``), and a killed server takes with it the process that watches it unless someone
starts it again. Worse, a Python-backend stub that dies (killed, out of memory) leaves its server
up and ready while every request through that model fails ("Stub process ... is not healthy"):
the backend never starts it again. :class:`Supervisor` watches named processes (``recserve
serve``'s server, or every replica and the proxy of ``recserve access``) and, when one exits
without being asked to or a server runs fewer stubs than it had when it became ready, stops what is
left (the server, its stubs, its shared-memory regions), keeps its log as ``<log>.previous``, waits
out the backoff and starts it again on the same ports. A deliberate stop (SIGINT/SIGTERM to the
stack) is never taken for a crash: the supervisor is stopped first, and a process that exits with
code 0 was told to stop by someone, so it is left down. Deaths and restarts are counted by cause
(:data:`~recserve.server.causes.CAUSE_KINDS`) in the status file and, beside it, as Prometheus text.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from recserve.server.causes import (
    CAUSE_KINDS,
    PROCESS_DIED,
    START_FAILED,
    STUB_DIED,
    dead_stub,
    error_line,
    exit_cause,
    start_error,
    stub_cause,
    stub_error,
)
from recserve.server.process import TritonServer
from recserve.server.runtime import ServerProcessError
from recserve.server.watchdog import dead_stubs

__all__ = ["Backoff", "Supervised", "Supervisor", "error_line", "exit_cause", "run_foreground"]

LOGGER = logging.getLogger(__name__)

#: How long a server that lost a stub gets to exit on its signal before SIGKILL: it never would on
#: its own (the model whose stub died does not unload, so it waits out its whole exit timeout).
STUB_DEATH_STOP_S = 1.0


class Supervised(Protocol):
    """What the supervisor uses of a process it watches (a :class:`TritonServer`, the proxy)."""

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The running (or dead) process; None before it was started."""

    @property
    def log_path(self) -> Path | None:
        """Its log file, if it has one."""

    def log_tail(self, lines: int = ...) -> str:
        """The last lines of its log."""

    def stop(self, timeout_s: float = ...) -> int | None:
        """Stop it and whatever it left (stubs, shared memory)."""


@dataclass(frozen=True)
class Backoff:
    """How long to wait before restarting a server that died: doubling, bounded.

    Args:
        initial_s: the wait before the first restart.
        factor: each further crash in a row multiplies the wait by this.
        max_s: the longest wait.
        stable_s: a server up this long before it died starts the schedule over.
    """

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    stable_s: float = 60.0

    def delay(self, crashes_in_row: int) -> float:
        """The wait before the restart after the ``crashes_in_row``-th crash in a row (1 = the first)."""
        return min(self.max_s, self.initial_s * self.factor ** max(0, crashes_in_row - 1))


@dataclass
class ServerRecord:
    """What the supervisor knows of one process, as written to its status file."""

    crashes: int = 0
    restarts: int = 0
    crashes_in_row: int = 0
    up: bool = True
    pid: int | None = None
    last_cause: str = ""
    last_error: str = ""
    last_crash_unix: float | None = None
    last_down_s: float | None = None  # crash -> ready again, the last time
    up_since: float = field(default_factory=time.monotonic, repr=False)
    due: float | None = field(default=None, repr=False)  # when to restart, while down
    down_at: float = field(default=0.0, repr=False)
    down_kind: str = field(default=PROCESS_DIED, repr=False)  # the cause kind that took it down
    stubs: dict[int, str] | None = field(default=None, repr=False)  # its stubs when it became ready
    stubs_of: int | None = field(default=None, repr=False)  # the pid those stubs belong to


_HIDDEN = ("up_since", "due", "down_at", "down_kind", "stubs", "stubs_of")


class Supervisor(threading.Thread):
    """Watch processes by name and start again each one that died on its own or lost a stub.

    Args:
        servers: returns the processes to watch now, by name (read at every poll: a restart may
            replace one). A process with a ``stubs()`` method (a :class:`TritonServer`) is also
            checked for its stubs, unless a stub watchdog of its own reloads their models.
        restart: starts the named process again (on the same ports) and returns it once ready;
            raises :class:`ServerProcessError` when it does not become ready.
        backoff: the restart schedule.
        status_path: where the counts go as JSON after every change, and as Prometheus text
            beside it (``.prom``); None: not written.
        interval_s: how often the processes are polled.
    """

    def __init__(
        self,
        servers: Callable[[], Mapping[str, Supervised]],
        restart: Callable[[str], Supervised],
        backoff: Backoff | None = None,
        status_path: Path | None = None,
        interval_s: float = 0.2,
    ) -> None:
        super().__init__(name="server-supervisor", daemon=True)
        self.servers = servers
        self.restart = restart
        self.backoff = backoff or Backoff()
        self.status_path = status_path
        self.interval_s = interval_s
        self.records: dict[str, ServerRecord] = {}
        self.deaths: Counter[tuple[str, str]] = Counter()  # (name, cause kind)
        self.restarts: Counter[tuple[str, str]] = Counter()  # (name, the kind of cause it ended)
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def stop(self, timeout_s: float = 0.0) -> None:
        """Stop restarting (before a deliberate stop of the servers); wait up to ``timeout_s``."""
        self._stopping.set()
        if timeout_s > 0 and self.is_alive():
            self.join(timeout_s)

    def status(self) -> dict[str, dict[str, object]]:
        """Per process: crashes, restarts, whether it is up, its pid, the last cause and error line."""
        with self._lock:
            return {
                name: {k: v for k, v in asdict(r).items() if k not in _HIDDEN}
                for name, r in self.records.items()
            }

    def exposition(self) -> str:
        """The counts as Prometheus text: deaths and restarts by process and cause, and who is up."""
        with self._lock:
            names = sorted(self.records)
            lines = []
            for metric, counts, what in (
                ("deaths", self.deaths, "processes found dead or short of a stub"),
                ("restarts", self.restarts, "processes started again, by the cause of their outage"),
            ):
                lines += [
                    f"# HELP recserve_supervisor_{metric}_total {what.capitalize()}.",
                    f"# TYPE recserve_supervisor_{metric}_total counter",
                ]
                lines += [
                    f'recserve_supervisor_{metric}_total{{process="{name}",cause="{kind}"}} '
                    f"{counts[(name, kind)]}"
                    for name in names
                    for kind in CAUSE_KINDS
                ]
            lines += [
                "# HELP recserve_supervisor_up 1 while the process serves.",
                "# TYPE recserve_supervisor_up gauge",
            ]
            lines += [f'recserve_supervisor_up{{process="{n}"}} {int(self.records[n].up)}' for n in names]
        return "\n".join(lines) + "\n"

    def run(self) -> None:
        """Poll until stopped."""
        for name, server in self.servers().items():
            self.records[name] = ServerRecord(pid=server.process.pid if server.process else None)
            self._note_stubs(self.records[name], server)
        self._save()
        while not self._stopping.wait(self.interval_s):
            for name, server in list(self.servers().items()):
                if self._stopping.is_set():
                    return
                self.check(name, server)

    def check(self, name: str, server: Supervised) -> None:
        """Note ``server``'s death or a dead stub, or restart it when it is down and its backoff is over."""
        record = self.records.setdefault(name, ServerRecord())
        process = server.process
        if record.up and process is not None and process.poll() is not None:
            if process.returncode == 0:
                if record.last_cause != "exit code 0":
                    LOGGER.warning("%s (pid %d) exited with code 0: left stopped", name, process.pid)
                    record.last_cause = "exit code 0"
                return
            error = error_line(server.log_tail(80), process.pid)
            self._died(name, server, exit_cause(process.returncode), error, PROCESS_DIED)
        elif record.up and process is not None:
            self._check_stubs(name, record, server)
        if not record.up and record.due is not None and time.monotonic() >= record.due:
            self._restart(name)

    def _note_stubs(self, record: ServerRecord, server: Supervised) -> None:
        """Keep the stubs of a ready server (None for a process without stubs or with a watchdog)."""
        stubs = getattr(server, "stubs", None)
        watched = getattr(server, "watchdog", None) is not None  # it reloads a model whose stub died
        record.stubs = stubs() if callable(stubs) and not watched else None
        record.stubs_of = server.process.pid if server.process is not None else None

    def _check_stubs(self, name: str, record: ServerRecord, server: Supervised) -> None:
        assert server.process is not None
        if record.stubs_of != server.process.pid:  # started by someone else: note its stubs once ready
            is_ready = getattr(server, "is_ready", None)
            if callable(is_ready) and is_ready():
                self._note_stubs(record, server)
            return
        stubs = getattr(server, "stubs", None)
        if record.stubs is None or not callable(stubs):
            return
        zombies = dead_stubs(server.process.pid)  # died before or after the stubs were noted
        dead = (zombies[0], record.stubs.get(zombies[0])) if zombies else dead_stub(record.stubs, stubs())
        if dead is None or server.process.poll() is not None:  # a dying server takes its stubs along
            return
        pid, model = dead
        cause, error = stub_cause(pid, model), stub_error(server.log_tail(80), model)
        self._died(name, server, cause, error, STUB_DIED)

    def _died(self, name: str, server: Supervised, cause: str, error: str, kind: str) -> None:
        record = self.records[name]
        now = time.monotonic()
        with self._lock:
            record.crashes += 1
            self.deaths[(name, kind)] += 1
            stable = record.up and now - record.up_since >= self.backoff.stable_s  # a failed start never is
            record.crashes_in_row = 1 if stable else record.crashes_in_row + 1
            if record.up:
                record.down_kind, record.down_at = kind, now
            record.up, record.last_cause, record.last_error = False, cause, error
            record.last_crash_unix = time.time()
            record.due = now + self.backoff.delay(record.crashes_in_row)
        LOGGER.error(
            "%s (pid %s) died: %s; last error: %s; crash %d (%d in a row), restart in %.1f s",
            name,
            server.process.pid if server.process else "-",
            cause,
            error,
            record.crashes,
            record.crashes_in_row,
            record.due - now,
        )
        # its stubs and shared-memory regions; a server short of a stub never exits by itself
        server.stop(timeout_s=STUB_DEATH_STOP_S) if kind == STUB_DIED else server.stop()
        if server.log_path is not None and server.log_path.exists():
            server.log_path.replace(server.log_path.with_name(server.log_path.name + ".previous"))
        self._save()

    def _restart(self, name: str) -> None:
        record = self.records[name]
        try:
            server = self.restart(name)
        except ServerProcessError as exc:
            if self._stopping.is_set():
                return
            failed = self.servers()[name]
            error = start_error(str(exc), failed.process.pid if failed.process else None)
            self._died(name, failed, "did not start again", error, START_FAILED)
            return
        if self._stopping.is_set():  # a deliberate stop came while it started
            server.stop()
            return
        now = time.monotonic()
        with self._lock:
            record.restarts += 1
            self.restarts[(name, record.down_kind)] += 1
            record.up, record.due, record.up_since = True, None, now
            record.pid = server.process.pid if server.process else None
            record.last_down_s = round(now - record.down_at, 3)
        self._note_stubs(record, server)
        LOGGER.warning(
            "%s restarted (pid %s, restart %d) %.1f s after it went down (%s)",
            name,
            record.pid,
            record.restarts,
            record.last_down_s,
            record.down_kind,
        )
        self._save()

    def _save(self) -> None:
        if self.status_path is None:
            return
        for path, text in (
            (self.status_path, json.dumps(self.status(), indent=2, sort_keys=True)),
            (self.status_path.with_suffix(".prom"), self.exposition()),
        ):
            partial = path.with_name(path.name + ".partial")
            try:
                partial.write_text(text)
                partial.replace(path)
            except OSError as exc:
                LOGGER.warning("could not write %s: %s", path, exc)


def run_foreground(
    server: TritonServer, backoff: Backoff | None = None, status_path: Path | None = None
) -> int:
    """Run ``server`` (``recserve serve``), restarting it whenever it dies on its own.

    SIGINT or SIGTERM drains, then stops it (no restart then). Also returns when the server exited
    with code 0 (someone else stopped it). Returns its exit code.
    """
    stopping = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stopping.set()

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    current = {"tritonserver": server}

    def restart(name: str) -> TritonServer:
        current[name] = current[name].renewed()  # visible to the stop below even while it starts
        return current[name].start()

    supervisor = Supervisor(lambda: dict(current), restart, backoff, status_path)
    try:
        server.start()
        supervisor.start()
        while not stopping.wait(0.5):
            process = current["tritonserver"].process
            if process is not None and process.poll() == 0:
                break
    finally:
        supervisor.stop()
        running = current["tritonserver"]
        code = running.stop(timeout_s=running.exit_timeout_s + 10, signum=signal.SIGTERM)
        if supervisor.is_alive():
            supervisor.join(30)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code or 0
