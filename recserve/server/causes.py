"""Why a supervised process went down: its exit, a dead stub, and the log line that tells the cause.

A tritonserver's log mixes its own lines with those of its Python-backend stubs, which die a moment
after it and print their own last words below its reason (``Fatal Python error: PyThreadState_Get``
and a thread dump when the parent is gone). :func:`error_line` picks the server's reason first.
"""

from __future__ import annotations

import re
import signal
from collections import Counter
from collections.abc import Mapping

from recserve.server.watchdog import zombie_returncode

#: The kinds of cause the supervisor counts (the ``cause`` label of its counters).
PROCESS_DIED = "process_died"
STUB_DIED = "stub_died"
START_FAILED = "start_failed"
CAUSE_KINDS = (PROCESS_DIED, STUB_DIED, START_FAILED)
NO_ERROR = "(no error in the log)"

_STACK_FRAME = re.compile(r"^\s*\d+# ")
# glog lines (tritonserver's, gRPC core's, the stubs'): level, date, time, pid, source file
_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+(\d+) ([^:\]\s]+):\d+\]")
_STUB_SOURCE = re.compile(r"^pb_")  # the stub's own sources: pb_stub.cc, pb_utils.cc, ...
_ABORT_REASON = re.compile(r"what\(\):")  # the C++ runtime's line before an uncaught exception aborts
_ERROR_WORDS = re.compile(r"what\(\):|terminate called|error|exception|abort|in use", re.IGNORECASE)
# what a stub prints when its server went away under it: a consequence, never the cause
_STUB_LAST_WORDS = re.compile(r"^Fatal Python error")
_THREAD_DUMP = re.compile(r"^(Python runtime state|Thread 0x|Current thread|File \"|<no Python frame>)")


def exit_cause(returncode: int) -> str:
    """``killed by SIGABRT`` or ``exit code 1``: how a process ended, from its return code."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def error_line(log_tail: str, server_pid: int | None = None) -> str:
    """The line of a server log that tells why it went down, or ``(no error in the log)``.

    In this order, the last line of the first kind found: the C++ runtime's reason for an abort
    (``what():  std::bad_alloc``); tritonserver's own lines at level E or F (from ``server_pid``
    when given, not from a stub's source file; a warning that mentions an error is not one); any
    other line that names an error (a stub's error, a backend's message); last, what a stub printed
    as its server went away (``Fatal Python error: ...``). Stack frames are skipped.

    Args:
        log_tail: the last lines of the log.
        server_pid: the server's process id, to tell its glog lines from its stubs'.
    """
    lines = [line.strip() for line in log_tail.splitlines()]
    lines = [line for line in lines if line and not _STACK_FRAME.match(line)]
    for line in reversed(lines):
        if _ABORT_REASON.search(line):
            return line[:300]
    others: list[str] = []
    last_words: list[str] = []
    for line in reversed(lines):
        glog = _GLOG.match(line)
        if glog is not None:
            level, pid, source = glog.groups()
            if level not in "EF":
                continue
            own = not _STUB_SOURCE.match(source) and (server_pid is None or int(pid) == server_pid)
            if own:
                return line[:300]
            others.append(line)
        elif _STUB_LAST_WORDS.match(line):
            last_words.append(line)
        elif _THREAD_DUMP.match(line):
            continue
        elif _ERROR_WORDS.search(line):
            others.append(line)
    return (others or last_words or [NO_ERROR])[0][:300]


def start_error(message: str, server_pid: int | None = None) -> str:
    """The cause in a failed start's message: its log's error line, else the message's first line."""
    picked = error_line(message, server_pid)
    if picked == NO_ERROR and message.strip():
        return message.strip().splitlines()[0][:300]
    return picked


def dead_stub(ready: Mapping[int, str], now: Mapping[int, str]) -> tuple[int, str] | None:
    """A stub that a server had when it became ready and has no more: (pid, model), or None.

    A model counts as short of a stub when it runs fewer stub processes than it had then (the
    Python backend of tritonserver 2.51 never starts a dead one again: every request to that model
    fails until the model is loaded again). The pid is one of the model's stubs that is gone.

    Args:
        ready: the server's stubs when it became ready, pid -> model.
        now: its live stubs now, pid -> model.
    """
    had, has = Counter(ready.values()), Counter(now.values())
    for model, count in had.items():
        if has[model] < count:
            gone = [pid for pid, name in ready.items() if name == model and pid not in now]
            return (gone[0] if gone else -1), model
    return None


def stub_error(log_tail: str, model: str | None) -> str:
    """The last error line of the log that names ``model`` (None: any stub): its health, its requests."""
    for line in reversed(log_tail.splitlines()):
        glog = _GLOG.match(line.strip())
        if glog is not None and glog.group(1) in "EF" and (model or "Stub process") in line:
            return line.strip()[:300]
    return NO_ERROR


def stub_cause(pid: int, model: str | None) -> str:
    """``stub of 'dense' (pid 12) killed by SIGKILL``: how a stub ended, read before it is reaped."""
    returncode = zombie_returncode(pid) if pid > 0 else None
    whose = f"stub of {model!r}" if model else "a stub"
    return f"{whose} (pid {pid}) " + ("gone" if returncode is None else exit_cause(returncode))
