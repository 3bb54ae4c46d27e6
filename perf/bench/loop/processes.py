"""recserve bench-loop's processes: recserve join and recserve learn started, killed, their lines read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recserve.perf.bench.loop.bench import Recorded

#: The loop server's admin key (loopback only): the learner loads its dense versions with it.
ADMIN_KEY = "bench-loop"


def _recserve(spec_file: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "recserve.cli", "--spec", str(spec_file), *args]


def start_joiner(spec_file: Path, recorded: Recorded, stack: ExitStack) -> subprocess.Popen:
    """``recserve join`` as a process of its own (killed if the bench fails); it resumes from its commit."""
    folder = recorded.folder
    joiner = subprocess.Popen(
        _recserve(spec_file, "join", "--consumer", "bench-loop", "--log-dir", str(recorded.log_dir),
                  "--feedback-dir", str(folder / "feedback"), "--examples-dir", str(recorded.examples_dir)),
        stdout=subprocess.PIPE, stderr=open(folder / "joiner.log", "ab"), text=True,
    )  # fmt: skip
    stack.callback(joiner.kill)
    return joiner


def start_learner(
    spec_file: Path, recorded: Recorded, stack: ExitStack, loop_server: str
) -> tuple[subprocess.Popen, threading.Thread]:
    """``recserve learn`` as a process of its own, and the thread reading its lines into ``recorded``.

    With the grid's dense learning rate, it loads each dense version into ``loop_server`` (gRPC).
    """
    folder, grid = recorded.folder, recorded.grid
    rate = () if grid.learning_rate is None else ("--learning-rate", str(grid.learning_rate))
    dense: tuple[str, ...] = ()
    if grid.dense_learning_rate:
        every = str(grid.dense_publish_seconds)
        dense = ("--dense-learning-rate", str(grid.dense_learning_rate), "--dense-publish-seconds", every,
                 "--servers", loop_server)  # fmt: skip
    learner = subprocess.Popen(
        _recserve(spec_file, "learn", "--repository", str(recorded.loop_repository),
                  "--examples-dir", str(recorded.examples_dir),
                  "--publish-seconds", str(grid.publish_seconds),
                  *rate, *dense, "--batch-size", str(grid.batch_size)),
        stdout=subprocess.PIPE, stderr=open(folder / "learner.log", "ab"), text=True,
        env={**os.environ, "RECSERVE_ADMIN_KEY": ADMIN_KEY},
    )  # fmt: skip
    stack.callback(learner.kill)
    reader = threading.Thread(
        target=_read_lines, args=(learner, recorded.learner_lines, folder / "learner.jsonl"), daemon=True
    )
    reader.start()
    return learner, reader


def kill(
    process: subprocess.Popen, name: str, round_: int, recorded: Recorded, progress: Callable[[str], None]
) -> None:
    """``kill -9`` of ``process`` mid-run, recorded."""
    process.kill()
    process.wait(30)
    recorded.kills.append({"process": name, "round": round_, "at": round(time.time(), 3)})
    progress(f"[bench-loop] {name} killed (SIGKILL) before round {round_ + 1}; started again")


def _read_lines(process: subprocess.Popen, into: list[tuple[float, dict]], copy: Path) -> None:
    """The learner's JSON lines, each with when it was read (a publish line: just after the publish).

    They are copied to ``copy`` too, each with ``"seen"``.
    """
    assert process.stdout is not None
    with copy.open("a") as out:
        for line in process.stdout:
            try:
                into.append((time.time(), json.loads(line)))
            except json.JSONDecodeError:
                continue
            out.write(json.dumps({"seen": round(into[-1][0], 3), **into[-1][1]}) + "\n")
            out.flush()
