"""The process base of the wrappers: a child with its log, its tail, a stop by signal, timeout, SIGKILL."""

import os
import signal
import sys
import time
from pathlib import Path

from recserve.server.child import ChildProcess, Started, read_tail, stop_process

#: a child that ignores SIGTERM: only SIGKILL ends it
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('up', flush=True); time.sleep(60)"
)


class Sleeper(ChildProcess):
    """The smallest wrapper: a Python child that prints, then waits to be stopped."""

    def __init__(self, log_path: Path | None, code: str, new_group: bool = False) -> None:
        super().__init__(log_path, new_group=new_group)
        self.code = code

    def start(self) -> "Sleeper":
        self.spawn([sys.executable, "-c", self.code])
        return self

    def stop(self) -> int | None:
        return self.halt(5.0)


def wait_for(path: Path, text: str) -> None:
    deadline = time.monotonic() + 10
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} never reached {path}"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a killed zombie, not yet reaped by init, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_child_writes_both_streams_to_its_log_and_the_tail_reads_the_last_lines(tmp_path):
    log = tmp_path / "child.log"
    code = (
        "import sys, time\nfor i in range(50): print(f'line {i}')\n"
        "sys.stderr.write('to stderr\\n')\ntime.sleep(60)"
    )
    with Sleeper(log, code) as child:
        assert child.pid == child.process.pid
        wait_for(log, "to stderr")
        assert child.log_tail(3).splitlines() == ["line 48", "line 49", "to stderr"]
    assert child.process.returncode == -signal.SIGTERM
    assert child._log is None  # closed by the stop


def test_a_child_that_ignores_the_signal_is_killed_after_the_timeout(tmp_path):
    log = tmp_path / "stubborn.log"
    child = Sleeper(log, STUBBORN).start()
    wait_for(log, "up")
    started = time.monotonic()
    assert child.halt(0.3) == -signal.SIGKILL
    assert 0.3 <= time.monotonic() - started < 5


def test_the_signal_asked_for_is_the_one_sent(tmp_path):
    # SIGINT's default action, whatever was inherited (a shell's background job starts with it ignored)
    code = (
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
        "print('up', flush=True); time.sleep(60)"
    )
    child = Sleeper(tmp_path / "int.log", code).start()
    wait_for(tmp_path / "int.log", "up")
    assert child.halt(30.0, signal.SIGINT) == -signal.SIGINT


def test_a_child_in_its_own_group_takes_its_children_with_it(tmp_path):
    log = tmp_path / "group.log"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}])\n"
        "print('grandchild', p.pid, flush=True)\ntime.sleep(60)"
    )
    child = Sleeper(log, code, new_group=True).start()
    wait_for(log, "up")
    grandchild = int(next(line for line in log.read_text().splitlines() if "grandchild" in line).split()[1])
    assert os.getpgid(grandchild) == child.pid
    child.stop()
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:  # reaped by init once killed
        time.sleep(0.02)
    assert not alive(grandchild)


def test_without_a_log_file_the_output_goes_to_a_pipe(tmp_path):
    child = Sleeper(None, "print('piped', flush=True); import time; time.sleep(60)").start()
    assert child.process.stdout is not None
    assert child.process.stdout.readline() == b"piped\n"
    assert child.log_tail() == "(no log)"
    child.stop()
    child.process.stdout.close()


def test_stopping_what_never_started_is_a_no_op_and_an_exited_child_is_not_signalled(tmp_path):
    assert Sleeper(tmp_path / "never.log", "").halt(1.0) is None
    child = Sleeper(tmp_path / "done.log", "raise SystemExit(3)").start()
    child.process.wait(10)
    assert stop_process(child.process, 1.0) == 3


def test_the_tail_of_a_missing_log_says_so(tmp_path):
    assert read_tail(tmp_path / "absent.log", 5) == "(no log)"
    assert read_tail(tmp_path / "absent.log", 5, missing="(log not captured)") == "(log not captured)"


def test_leaving_the_block_stops_even_after_an_error():
    calls = []

    class Recorder(Started):
        def start(self) -> "Recorder":
            calls.append("start")
            return self

        def stop(self) -> None:
            calls.append("stop")

    try:
        with Recorder() as entered:
            assert isinstance(entered, Recorder)
            raise ValueError("inside")
    except ValueError:
        pass
    assert calls == ["start", "stop"]


def test_torchserve_is_stopped_with_its_whole_group_and_its_log_read_from_its_workdir(tmp_path):
    from recserve.perf.peers.torchserve import TorchServe

    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}])\n"
        "print('worker', p.pid, flush=True)\ntime.sleep(60)"
    )
    server = TorchServe(tmp_path / "spec.toml", tmp_path / "repository", tmp_path)
    server.spawn([sys.executable, "-c", code])  # stands in for the Java frontend and its workers
    log = tmp_path / "torchserve.log"
    wait_for(log, "up")
    worker = int(next(line for line in log.read_text().splitlines() if "worker" in line).split()[1])
    server.stop()
    assert server.process is None
    deadline = time.monotonic() + 5
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(worker)
    assert "worker" in server.log_tail()
