"""Restart a tritonserver that died on its own: counted, logged with its cause, with a bounded backoff.

tritonserver 2.51 can be killed by one request (a JSON body declaring a huge shape aborts it with
``std::bad_alloc``), and a killed server takes with it the process that watches it unless someone
starts it again. :class:`Supervisor` watches named servers (``recserve serve``'s one, or every
replica of ``recserve access``) and, when one exits without being asked to, stops what it left
(its stubs, its shared-memory regions), keeps its log as ``<log>.previous``, waits out the backoff
and starts it again on the same ports. A deliberate stop (SIGINT/SIGTERM to the stack) is never
taken for a crash: the supervisor is stopped first, and a server that exits with code 0 was told
to stop by someone, so it is left down.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from recserve.server.process import TritonServer
from recserve.server.runtime import ServerProcessError

LOGGER = logging.getLogger(__name__)

_STACK_FRAME = re.compile(r"^\s*\d+# ")
_LOG_LEVEL = re.compile(r"^([IWEF])\d{4} ")  # tritonserver's own lines: Info, Warning, Error, Fatal
_ABORT_REASON = re.compile(r"what\(\):")  # the C++ runtime's line before an uncaught exception aborts
_ERROR_WORDS = re.compile(r"what\(\):|terminate called|error|exception|abort", re.IGNORECASE)


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


def exit_cause(returncode: int) -> str:
    """``killed by SIGABRT`` or ``exit code 1``: how a process ended, from its return code."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def error_line(log_tail: str) -> str:
    """The last line of a server log that tells an error, or ``(no error in the log)``.

    The C++ runtime's reason for an abort (``what():  std::bad_alloc``) wins: the server's stubs,
    dying a moment after it, print errors of their own below it. Otherwise tritonserver's own lines
    count at levels E and F only (a warning that mentions an error is not one); other lines (the
    C++ runtime's, a backend's) when they name an error or an abort. Stack frames are skipped.
    """
    lines = log_tail.splitlines()
    for line in reversed(lines):
        if _ABORT_REASON.search(line):
            return line.strip()[:300]
    for line in reversed(lines):
        line = line.strip()
        if not line or _STACK_FRAME.match(line):
            continue
        level = _LOG_LEVEL.match(line)
        if (level.group(1) in "EF") if level else bool(_ERROR_WORDS.search(line)):
            return line[:300]
    return "(no error in the log)"


@dataclass
class ServerRecord:
    """What the supervisor knows of one server, as written to its status file."""

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


class Supervisor(threading.Thread):
    """Watch servers by name and start again each one that died on its own.

    Args:
        servers: returns the servers to watch now, by name (read at every poll: a restart may
            replace a server object).
        restart: starts the named server again (a new process on the same ports) and returns it
            once ready; raises :class:`ServerProcessError` when it does not become ready.
        backoff: the restart schedule.
        status_path: where the counts go as JSON after every change (None: not written).
        interval_s: how often the servers are polled.
    """

    def __init__(
        self,
        servers: Callable[[], Mapping[str, TritonServer]],
        restart: Callable[[str], TritonServer],
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
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def stop(self, timeout_s: float = 0.0) -> None:
        """Stop restarting (before a deliberate stop of the servers); wait up to ``timeout_s``."""
        self._stopping.set()
        if timeout_s > 0 and self.is_alive():
            self.join(timeout_s)

    def status(self) -> dict[str, dict[str, object]]:
        """Per server: crashes, restarts, whether it is up, its pid, the last cause and error line."""
        with self._lock:
            return {
                name: {k: v for k, v in asdict(r).items() if k not in ("up_since", "due", "down_at")}
                for name, r in self.records.items()
            }

    def run(self) -> None:
        """Poll until stopped."""
        for name, server in self.servers().items():
            self.records[name] = ServerRecord(pid=server.process.pid if server.process else None)
        self._save()
        while not self._stopping.wait(self.interval_s):
            for name, server in list(self.servers().items()):
                if self._stopping.is_set():
                    return
                self.check(name, server)

    def check(self, name: str, server: TritonServer) -> None:
        """Note ``server``'s death, or restart it when it is down and its backoff is over."""
        record = self.records.setdefault(name, ServerRecord())
        process = server.process
        if record.up and process is not None and process.poll() is not None:
            if process.returncode == 0:
                if record.last_cause != "exit code 0":
                    LOGGER.warning("server %s (pid %d) exited with code 0: left stopped", name, process.pid)
                    record.last_cause = "exit code 0"
                return
            self._died(name, server, exit_cause(process.returncode), error_line(server.log_tail(80)))
        if not record.up and record.due is not None and time.monotonic() >= record.due:
            self._restart(name)

    def _died(self, name: str, server: TritonServer, cause: str, error: str) -> None:
        record = self.records[name]
        now = time.monotonic()
        with self._lock:
            record.crashes += 1
            stable = record.up and now - record.up_since >= self.backoff.stable_s  # a failed start never is
            record.crashes_in_row = 1 if stable else record.crashes_in_row + 1
            record.up, record.last_cause, record.last_error = False, cause, error
            record.last_crash_unix, record.down_at = time.time(), now
            record.due = now + self.backoff.delay(record.crashes_in_row)
        LOGGER.error(
            "server %s (pid %s) died: %s; last error: %s; crash %d (%d in a row), restart in %.1f s",
            name,
            server.process.pid if server.process else "-",
            cause,
            error,
            record.crashes,
            record.crashes_in_row,
            record.due - now,
        )
        server.stop()  # its stubs and shared-memory regions
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
            lines = str(exc).splitlines()
            self._died(name, self.servers()[name], "did not start again", error_line("\n".join(lines[-80:])))
            return
        if self._stopping.is_set():  # a deliberate stop came while it started
            server.stop()
            return
        now = time.monotonic()
        with self._lock:
            record.restarts += 1
            record.up, record.due, record.up_since = True, None, now
            record.pid = server.process.pid if server.process else None
            record.last_down_s = round(now - record.down_at, 3)
        LOGGER.warning(
            "server %s restarted (pid %s, restart %d) %.1f s after it died",
            name,
            record.pid,
            record.restarts,
            record.last_down_s,
        )
        self._save()

    def _save(self) -> None:
        if self.status_path is None:
            return
        partial = self.status_path.with_name(self.status_path.name + ".partial")
        try:
            partial.write_text(json.dumps(self.status(), indent=2, sort_keys=True))
            partial.replace(self.status_path)
        except OSError as exc:
            LOGGER.warning("could not write %s: %s", self.status_path, exc)


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
