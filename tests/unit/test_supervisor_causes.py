"""What took a server down: the log line that tells the cause, a stub's end, a server short of a stub.

The logs are the ones tritonserver 2.51 wrote: a gRPC port already in use, with the stubs' last words
printed below the server's reason as they died after it. The stub tests run real processes: a child
killed and not reaped yet, and a "server" whose children are named as the Python-backend stub is
(``triton_python_backend_stub <model>/1/model.py``), so the supervisor's stub check reads them from
``/proc`` as it reads a tritonserver's.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recserve.server.causes import (
    NO_ERROR,
    STUB_DIED,
    dead_stub,
    error_line,
    start_error,
    stub_cause,
)
from recserve.server.supervisor import Backoff, Supervisor
from recserve.server.watchdog import StubWatchdog, stub_processes, zombie_returncode

SERVER_PID = 4659
PORT_IN_USE_LOG = f"""\
I1204 22:56:30.290000 {SERVER_PID} server.cc:674] "Started GRPCInferenceService"
E1204 22:56:30.300442347    {SERVER_PID} chttp2_server.cc:1060]   UNKNOWN:No address added out of \
total 1 resolved for '127.0.0.1:59261' {{children:[UNKNOWN:Address already in use {{errno:98}}]}}
E1204 22:56:30.303923 {SERVER_PID} main.cc:245] "failed to start GRPC service: Unavailable - Socket \
'127.0.0.1:59261' already in use "
I1204 22:56:55.395498 5505 pb_stub.cc:2145]  Non-graceful termination detected.
E1204 22:56:55.395600 5505 pb_stub.cc:2150]  Failed to process the request(s): parent is gone
Fatal Python error: PyThreadState_Get: the function must be called with the GIL held, but the GIL is \
released (the current Python thread state is NULL)
Python runtime state: initialized

Thread 0x00007f579affd000 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/opt/recserve/python_backends/triton/publisher.py", line 55 in run
Thread 0x00007f57ef31f000 (most recent call first):
  <no Python frame>
"""
PORT_IN_USE = (
    f'E1204 22:56:30.303923 {SERVER_PID} main.cc:245] "failed to start GRPC service: Unavailable - Socket '
    "'127.0.0.1:59261' already in use \""
)


def test_the_servers_own_reason_wins_over_what_its_stubs_print_as_they_die():
    assert error_line(PORT_IN_USE_LOG, SERVER_PID) == PORT_IN_USE
    assert error_line(PORT_IN_USE_LOG) == PORT_IN_USE  # without the pid: the stub's source file tells it
    message = f"tritonserver exited with 1:\n{PORT_IN_USE_LOG}"
    assert start_error(message, SERVER_PID) == PORT_IN_USE


def test_a_stubs_error_and_its_last_words_are_the_fallbacks_in_that_order():
    stubs_only = PORT_IN_USE_LOG.replace(f" {SERVER_PID} ", " 1 ")
    assert "parent is gone" in error_line(stubs_only.split("\n", 3)[3])  # the stub's E line
    last_words = "I1204 1 server.cc:1] up\nFatal Python error: PyThreadState_Get: no GIL\nThread 0x01 (x):"
    assert error_line(last_words) == "Fatal Python error: PyThreadState_Get: no GIL"
    assert error_line("I1126 05:48:20.7 1 server.cc:1] up") == NO_ERROR


def test_a_start_refused_before_the_server_ran_names_the_busy_port():
    message = "port 8001 is already in use; is another tritonserver running?"
    assert start_error(message) == message
    assert start_error("") == NO_ERROR


def test_a_killed_child_not_reaped_yet_tells_its_signal_or_exit_code():
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    os.kill(killed.pid, signal.SIGKILL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and None in (
            zombie_returncode(killed.pid),
            zombie_returncode(exited.pid),
        ):
            time.sleep(0.02)
        assert zombie_returncode(killed.pid) == -signal.SIGKILL
        assert zombie_returncode(exited.pid) == 3
        assert stub_cause(killed.pid, "dense") == f"stub of 'dense' (pid {killed.pid}) killed by SIGKILL"
    finally:
        killed.wait()
        exited.wait()
    assert zombie_returncode(killed.pid) is None  # reaped: nothing left to read
    assert zombie_returncode(os.getpid()) is None  # alive
    assert stub_cause(killed.pid, "dense") == f"stub of 'dense' (pid {killed.pid}) gone"


def test_a_model_short_of_a_stub_is_found_and_a_replaced_stub_is_not():
    ready = {10: "embedding_lookup", 11: "embedding_lookup", 12: "dense"}
    assert dead_stub(ready, ready) is None
    assert dead_stub(ready, {10: "embedding_lookup", 12: "dense"}) == (11, "embedding_lookup")
    assert dead_stub(ready, {10: "embedding_lookup", 11: "embedding_lookup"}) == (12, "dense")
    assert dead_stub(ready, {10: "embedding_lookup", 13: "embedding_lookup", 12: "dense"}) is None


# A "server" that starts one stub per model named as the Python backend names its stub, then waits.
SERVER_CODE = """
import subprocess, sys, time
stub, models = sys.argv[1], sys.argv[2:]
children = [subprocess.Popen([stub, model]) for model in models]
time.sleep(600)
"""
STUB_CODE = "import time; time.sleep(600)\n"


class FakeServer:
    """A process with stub children, and the parts of a server the supervisor uses."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.log_path: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.watchdog = None
        self.stops: list[float] = []

    def start(self) -> FakeServer:
        stub = self.folder / "triton_python_backend_stub"
        if not stub.exists():
            stub.symlink_to(sys.executable)
        models = []
        for model in ("embedding_lookup", "dense"):
            path = self.folder / model / "1" / "model.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(STUB_CODE)
            models.append(str(path))
        self.process = subprocess.Popen([sys.executable, "-c", SERVER_CODE, str(stub), *models])
        deadline = time.monotonic() + 20
        while len(self.stubs()) < 2:
            assert time.monotonic() < deadline, "the fake stubs did not start"
            time.sleep(0.02)
        return self

    def stubs(self) -> dict[int, str]:
        return stub_processes(self.process.pid) if self.process is not None else {}

    def is_ready(self) -> bool:
        return len(self.stubs()) == 2

    def log_tail(self, lines: int = 60) -> str:
        return "E1204 00:00:00.1 1 python_be.cc:1] \"Stub process 'embedding_lookup_0_0' is not healthy.\""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        self.stops.append(timeout_s)
        if self.process is None:
            return None
        for pid in self.stubs():
            os.kill(pid, signal.SIGKILL)
        self.process.kill()
        return self.process.wait()


@pytest.fixture
def supervised(tmp_path: Path):
    servers = {"server": FakeServer(tmp_path).start()}

    def restart(name: str) -> FakeServer:
        servers[name] = FakeServer(tmp_path).start()
        return servers[name]

    supervisor = Supervisor(lambda: dict(servers), restart, Backoff(initial_s=0.1), tmp_path / "status.json")
    supervisor.start()
    yield servers, supervisor
    supervisor.stop(timeout_s=10)
    for server in servers.values():
        server.stop()


def test_a_server_whose_stub_died_is_stopped_restarted_and_counted_by_cause(supervised, tmp_path: Path):
    servers, supervisor = supervised
    first = servers["server"]
    time.sleep(0.3)  # the supervisor has noted the stubs of the ready server
    victim = next(pid for pid, model in first.stubs().items() if model == "embedding_lookup")
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while supervisor.status()["server"]["restarts"] < 1:
        assert time.monotonic() < deadline, supervisor.status()
        time.sleep(0.05)
    status = supervisor.status()["server"]
    assert status["crashes"] == 1 and status["up"]
    assert status["last_cause"] == f"stub of 'embedding_lookup' (pid {victim}) killed by SIGKILL"
    assert "is not healthy" in str(status["last_error"])
    assert servers["server"] is not first and first.stops[0] <= 1.0  # not the server's whole exit timeout
    assert supervisor.deaths[("server", STUB_DIED)] == 1 and supervisor.restarts[("server", STUB_DIED)] == 1
    line = 'recserve_supervisor_restarts_total{process="server",cause="stub_died"} 1'
    while line not in (prom := (tmp_path / "status.prom").read_text()):  # written just after
        assert time.monotonic() < deadline, prom
        time.sleep(0.05)
    assert 'recserve_supervisor_deaths_total{process="server",cause="process_died"} 0' in prom
    assert 'recserve_supervisor_up{process="server"} 1' in prom
    # the restarted server's stubs are watched in turn
    victim = next(pid for pid, model in servers["server"].stubs().items() if model == "dense")
    time.sleep(0.3)
    os.kill(victim, signal.SIGKILL)
    while supervisor.status()["server"]["restarts"] < 2:
        assert time.monotonic() < deadline + 20, supervisor.status()
        time.sleep(0.05)
    assert supervisor.restarts[("server", STUB_DIED)] == 2
    assert supervisor.status()["server"]["last_cause"] == f"stub of 'dense' (pid {victim}) killed by SIGKILL"


def test_a_stub_that_died_before_the_supervisor_looked_is_found_by_its_zombie(tmp_path: Path):
    servers = {"server": FakeServer(tmp_path).start()}
    victim = next(iter(servers["server"].stubs()))
    os.kill(victim, signal.SIGKILL)  # before the stubs of the ready server are noted
    deadline = time.monotonic() + 10
    while zombie_returncode(victim) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)

    def restart(name: str) -> FakeServer:
        servers[name] = FakeServer(tmp_path).start()
        return servers[name]

    supervisor = Supervisor(lambda: dict(servers), restart, Backoff(initial_s=0.1))
    supervisor.start()
    try:
        deadline = time.monotonic() + 20
        while supervisor.status().get("server", {}).get("restarts", 0) < 1:
            assert time.monotonic() < deadline, supervisor.status()
            time.sleep(0.05)
    finally:
        supervisor.stop(timeout_s=10)
        for server in servers.values():
            server.stop()
    assert supervisor.status()["server"]["last_cause"] == f"a stub (pid {victim}) killed by SIGKILL"


def test_a_server_with_a_stub_watchdog_of_its_own_is_left_to_it(supervised, tmp_path: Path):
    servers, supervisor = supervised
    supervisor.stop(timeout_s=10)
    watched = FakeServer(tmp_path).start()
    watched.watchdog = object()  # it reloads the model itself (model control explicit)
    own = Supervisor(lambda: {"server": watched}, lambda name: watched.start(), Backoff(initial_s=0.1))
    own.start()
    try:
        time.sleep(0.3)
        os.kill(next(iter(watched.stubs())), signal.SIGKILL)
        time.sleep(0.6)
        assert own.status()["server"]["crashes"] == 0
    finally:
        own.stop(timeout_s=10)
        watched.stop()


def test_the_stub_watchdog_outlives_a_poll_that_fails(tmp_path: Path):
    server = FakeServer(tmp_path).start()
    calls = []

    def is_ready() -> bool:  # a server that first answers nothing readable, then is not ready
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise http.client.BadStatusLine("")
        return False

    server.is_ready = is_ready  # type: ignore[method-assign]
    watchdog = StubWatchdog(server, {"embedding_lookup": 1, "dense": 1}, interval_s=0.02)  # type: ignore[arg-type]
    watchdog.start()
    try:
        (victim,) = [pid for pid, model in server.stubs().items() if model == "dense"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(calls) >= 3 and watchdog.is_alive()
    finally:
        watchdog.stop()
        server.stop()
    assert not watchdog.is_alive()
