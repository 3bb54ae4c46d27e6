"""CPU time per request of tritonserver and each Python-backend stub, under a closed loop.

Where a request's time goes in wall-clock terms (queue, compute) hides what a process spends while
others wait; on a machine of two cores, throughput under load is set by the CPU every request
costs across all processes. Read from ``/proc`` (Linux): the processes whose command line names
the repository folder, tritonserver and one stub per model instance.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from recserve.perf.harness.traffic import infer_inputs

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_STUB = re.compile(r"/([^/\s]+)/\d+/model\.py")


def server_processes(repository: Path) -> dict[int, str]:
    """Pid -> ``tritonserver`` or the model a stub serves, for the server of ``repository``."""
    found = {}
    marker = str(repository)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if marker not in command:
            continue
        stub = _STUB.search(command) if "python_backend_stub" in command else None
        if stub is not None:
            found[int(entry.name)] = stub.group(1)
        elif "tritonserver" in command.split(" ", 1)[0]:
            found[int(entry.name)] = "tritonserver"
    return found


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK_S


def cpu_per_request(
    url: str,
    repository: Path,
    model: str,
    requests: list[dict[str, np.ndarray]],
    concurrency: int,
    seconds: float,
    steps: tuple[str, ...],
) -> dict[str, Any]:
    """µs of CPU per request of tritonserver and ``steps``, ``concurrency`` closed loops for ``seconds``.

    Processes of the same name (instances of one model) are summed. Also the requests per second the
    loops got.
    """
    wanted = ("tritonserver", *steps)
    processes = {pid: name for pid, name in server_processes(repository).items() if name in wanted}
    done = [0] * concurrency
    stop = threading.Event()

    def loop(index: int) -> None:
        with grpcclient.InferenceServerClient(url) as client:
            inputs = [infer_inputs(grpcclient, r) for r in requests]
            while not stop.is_set():
                client.infer(model, inputs[done[index] % len(inputs)])
                done[index] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    time.sleep(min(1.0, seconds / 4))  # the loops are running
    counted, before, started = sum(done), {pid: cpu_seconds(pid) for pid in processes}, time.perf_counter()
    time.sleep(seconds)
    served = sum(done) - counted
    spent = {pid: cpu_seconds(pid) - before[pid] for pid in processes}
    elapsed = time.perf_counter() - started
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    per_process = dict.fromkeys(wanted, 0.0)
    for pid, name in processes.items():
        per_process[name] += spent[pid] / max(served, 1) * 1e6
    return {"requests_per_s": served / elapsed, "cpu_us": per_process}
