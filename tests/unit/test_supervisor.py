"""The supervisor's pure parts: the backoff schedule, the shared-memory regions of one server, the cause.

The last tests run the supervisor over real child processes that exit as a crashed tritonserver
does (SIGABRT) or as a stopped one does (code 0): what is under test is the schedule and the
counting, which do not depend on what the child serves; the real server is in
``tests/integration/test_supervisor.py``.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recserve.server.runtime import ServerProcessError
from recserve.server.shm import backend_argument, leftover_regions, region_prefix, remove_regions
from recserve.server.supervisor import Backoff, Supervisor, error_line, exit_cause

CRASH_LOG = """\
I1126 05:38:23.792417 6108 http_server.cc:362] "Started Metrics Service at 127.0.0.1:45957"
terminate called after throwing an instance of 'std::bad_alloc'
  what():  std::bad_alloc
Signal (6) received.
 0# 0x0000555E348BB52D in /opt/tritonserver/bin/tritonserver
 1# 0x00007F05B945A050 in /lib/x86_64-linux-gnu/libc.so.6
 3# gsignal in /lib/x86_64-linux-gnu/libc.so.6
 4# abort in /lib/x86_64-linux-gnu/libc.so.6
"""


def test_backoff_doubles_from_the_first_wait_up_to_its_bound():
    backoff = Backoff(initial_s=0.5, factor=2.0, max_s=30.0)
    assert [backoff.delay(n) for n in range(1, 9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.delay(1000) == 30.0  # bounded, however long the loop


def test_region_prefixes_are_distinct_and_none_starts_another():
    prefixes = [region_prefix(pid) for pid in (1, 12, 123) for _ in range(12)]
    assert len(set(prefixes)) == len(prefixes)
    for a in prefixes:
        assert [b for b in prefixes if b != a and b.startswith(a)] == []
    assert backend_argument("recserve_1_2_") == "--backend-config=python,shm-region-prefix-name=recserve_1_2_"


def test_the_regions_of_one_server_are_its_own_and_only_those(tmp_path: Path):
    names = [
        "recserve_7_1_79de35a5",
        "recserve_7_1_ac977ade",
        "recserve_7_12_0c951c03",  # another server of the same process
        "recserve_71_1_d1593e34",  # a server of another process
        "triton_python_backend_shm_region_bd3b50cf",  # a server recserve did not start
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 1024)
    assert [p.name for p in leftover_regions("recserve_7_1_", tmp_path)] == names[:2]
    assert remove_regions("recserve_7_1_", tmp_path) == 2048
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    assert remove_regions("recserve_7_1_", tmp_path) == 0


@pytest.mark.parametrize(
    "prefix", ["", "recserve_", "recserve__", "triton_python_backend_shm_region_", "recserve_7"]
)
def test_a_prefix_that_could_match_other_servers_regions_is_refused(tmp_path: Path, prefix: str):
    with pytest.raises(ValueError, match="not a recserve region prefix"):
        leftover_regions(prefix, tmp_path)


def test_the_cause_names_the_signal_or_the_exit_code_and_the_last_error_line():
    assert exit_cause(-6) == "killed by SIGABRT"
    assert exit_cause(-9) == "killed by SIGKILL"
    assert exit_cause(1) == "exit code 1"
    assert error_line(CRASH_LOG) == "what():  std::bad_alloc"
    stubs_dying_after = CRASH_LOG + (
        "\nFatal Python error: PyThreadState_Get: the function must be called with the GIL held"
    )
    assert error_line(stubs_dying_after) == "what():  std::bad_alloc"  # the server's reason, not a stub's
    assert error_line("I1126 one\nE1126 12:00:00 1 server.cc:1] failed to load 'ctr'\nI1126 two") == (
        "E1126 12:00:00 1 server.cc:1] failed to load 'ctr'"
    )
    killed = (
        "I1126 05:48:20.7 1 server.cc:1] up\n"
        'W1126 05:48:20.7 1 metrics.cc:798] "DCGM unable to start: DCGM initialization error"'
    )
    assert error_line(killed) == "(no error in the log)"  # SIGKILL: nothing logged; a warning is not an error
    assert error_line("") == "(no error in the log)"


class Child:
    """A child process with the parts of a server the supervisor uses (process, log, stop)."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.log_path: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.starts: list[float] = []

    def start(self) -> Child:
        self.process = subprocess.Popen([sys.executable, "-c", self.code])
        self.starts.append(time.monotonic())
        return self

    def log_tail(self, lines: int = 60) -> str:
        return CRASH_LOG

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        return self.process.wait() if self.process is not None else None


def _supervise(child: Child, backoff: Backoff) -> Supervisor:
    def restart(name: str) -> Child:
        return child.start()

    supervisor = Supervisor(lambda: {"server": child}, restart, backoff, interval_s=0.02)
    supervisor.start()
    return supervisor


def test_a_server_crashing_in_a_loop_is_restarted_no_faster_than_the_backoff_and_counted(tmp_path: Path):
    child = Child("import os; os.abort()").start()
    backoff = Backoff(initial_s=0.08, factor=2.0, max_s=0.32, stable_s=60.0)
    supervisor = _supervise(child, backoff)
    try:
        deadline = time.monotonic() + 30
        while len(child.starts) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        supervisor.stop(timeout_s=10)
    gaps = [b - a for a, b in itertools.pairwise(child.starts)]
    assert len(gaps) >= 4
    for crash, gap in enumerate(gaps[:4], start=1):
        assert gap >= backoff.delay(crash), (crash, gaps)  # 0.08, 0.16, 0.32, 0.32
    status = supervisor.status()["server"]
    assert status["crashes"] >= 4 and status["restarts"] >= 4
    assert status["last_cause"] == "killed by SIGABRT"
    assert status["last_error"] == "what():  std::bad_alloc"


def test_a_server_that_exits_with_code_0_was_stopped_on_purpose_and_stays_down():
    child = Child("pass").start()
    supervisor = _supervise(child, Backoff(initial_s=0.0))
    try:
        time.sleep(0.4)  # twenty of its polls
    finally:
        supervisor.stop(timeout_s=10)
    assert len(child.starts) == 1
    assert supervisor.status()["server"]["crashes"] == 0


def test_no_restart_after_the_supervisor_is_stopped():
    child = Child("import time, os; time.sleep(0.3); os.abort()").start()
    supervisor = _supervise(child, Backoff(initial_s=0.0))
    supervisor.stop(timeout_s=10)
    assert child.process is not None
    child.process.wait()
    time.sleep(0.3)
    assert len(child.starts) == 1


def test_a_server_that_fails_to_start_again_backs_off_however_long_it_ran_before():
    child = Child("import os; os.abort()").start()
    attempts: list[float] = []

    def restart(name: str) -> Child:
        attempts.append(time.monotonic())
        raise ServerProcessError(
            "tritonserver exited with 1:\nE1126 00:00:00 1 server.cc:1] failed to load 'ctr'"
        )

    backoff = Backoff(initial_s=0.05, factor=2.0, max_s=0.2, stable_s=0.0)  # every run counts as stable
    supervisor = Supervisor(lambda: {"server": child}, restart, backoff, interval_s=0.02)
    supervisor.start()
    try:
        deadline = time.monotonic() + 30
        while len(attempts) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        supervisor.stop(timeout_s=10)
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert len(gaps) >= 3
    for crash, gap in enumerate(gaps[:3], start=2):
        assert gap >= backoff.delay(crash), (crash, gaps)  # 0.1, 0.2, 0.2: not 0.05 each time
    status = supervisor.status()["server"]
    assert status["restarts"] == 0 and status["crashes_in_row"] >= 4
    assert status["last_cause"] == "did not start again"
    assert status["last_error"] == "E1126 00:00:00 1 server.cc:1] failed to load 'ctr'"
