"""The shared shape of the processes recserve starts: spawn with a log, read its tail, stop by signal.

:class:`Started` makes anything with ``start()`` and ``stop()`` a context manager. :class:`ChildProcess`
adds one child process whose output (stdout and stderr together) goes to a log file, or to a pipe
when there is none, and which is stopped with a signal, a timeout and SIGKILL: to its PID, or to its
whole process group when it was started in a session of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, TypeVar

_S = TypeVar("_S", bound="Started")


def stop_process(
    process: subprocess.Popen[bytes], timeout_s: float, signum: int = signal.SIGTERM, group: bool = False
) -> int:
    """Send ``signum`` to a running child, SIGKILL it after ``timeout_s``; returns its exit code.

    Args:
        process: the child.
        timeout_s: how long to wait after ``signum`` before SIGKILL.
        signum: the first signal.
        group: signal the child's process group (it was started with ``start_new_session``), and
            SIGKILL whatever is left of the group once the child has exited.
    """

    def send(signum: int) -> None:
        if group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)

    if process.poll() is None:
        send(signum)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            process.wait()
    if group:  # children of the child share the group; make sure none outlives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode


def read_tail(path: Path, lines: int, missing: str = "(no log)") -> str:
    """The last ``lines`` lines of a log file, or ``missing`` when there is no such file."""
    if not path.exists():
        return missing
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Started:
    """A context manager over ``start()`` and ``stop()``: entering starts, leaving stops."""

    def start(self: _S) -> _S:
        """Start; returns self."""
        raise NotImplementedError

    def stop(self) -> object:
        """Stop (a no-op when not started)."""
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class ChildProcess(Started):
    """One child process with its output in ``log_path``, stopped by signal, timeout and SIGKILL.

    Args:
        log_path: where the child's stdout and stderr go (opened afresh by :meth:`spawn`, closed by
            :meth:`halt`); None: to a pipe, ``process.stdout``, for the subclass to read.
        new_group: start the child in a session of its own and signal its whole process group.
    """

    def __init__(self, log_path: Path | None, new_group: bool = False) -> None:
        self.log_path = log_path
        self.new_group = new_group
        self.process: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None  # the open log while running, when log_path is set

    @property
    def pid(self) -> int | None:
        """The process id once started."""
        return self.process.pid if self.process is not None else None

    def spawn(
        self,
        command: list[str],
        preexec_fn: Callable[[], None] | None = None,
        **popen: Any,
    ) -> subprocess.Popen[bytes]:
        """Start ``command`` with its output in the log; ``popen`` goes to :class:`subprocess.Popen`."""
        self._log = open(self.log_path, "wb") if self.log_path else None  # closed in halt()
        self.process = subprocess.Popen(
            command,
            stdout=self._log or subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
            start_new_session=self.new_group,
            **popen,
        )
        return self.process

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the log."""
        return read_tail(self.log_path, lines) if self.log_path else "(no log)"

    def halt(self, timeout_s: float, signum: int = signal.SIGTERM) -> int | None:
        """Signal the child, SIGKILL it after ``timeout_s``, close the log; returns the exit code."""
        if self.process is None:
            return None
        code = stop_process(self.process, timeout_s, signum, group=self.new_group)
        if self._log is not None:
            self._log.close()
            self._log = None
        return code
