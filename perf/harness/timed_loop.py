"""Closed-loop load from threads: every thread connected and warmed up first, then timed together."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

#: Opens one thread's connection and yields its ``send``: one request, True when it was answered.
Sender = Callable[[], AbstractContextManager[Callable[[], bool]]]


def timed_closed_loop(
    open_sender: Sender, rows: int, concurrency: int, seconds: float, join_s: float
) -> dict[str, Any]:
    """Rows/s and latency percentiles of ``concurrency`` threads each sending in a loop for ``seconds``.

    Each thread opens its own sender and sends once untimed (the warm-up); the clock starts when all
    of them are ready. A request the sender reports unanswered (refused or lost) is counted in
    ``failures``, not timed. ``client_cpu`` is this process's CPU time over the wall time.
    """
    latencies: list[float] = []
    failures = [0]
    clock = {"began": 0.0, "deadline": 0.0}

    def go() -> None:  # run once, when every thread is connected and warmed up
        clock["began"] = time.perf_counter()
        clock["deadline"] = clock["began"] + seconds

    lock, start = threading.Lock(), threading.Barrier(concurrency, action=go)

    def worker() -> None:
        with open_sender() as send:
            send()  # warm-up
            mine, refused = [], 0
            start.wait()
            while time.perf_counter() < clock["deadline"]:
                began = time.perf_counter()
                if send():
                    mine.append((time.perf_counter() - began) * 1e3)
                else:
                    refused += 1
            with lock:
                latencies.extend(mine)
                failures[0] += refused

    cpu = time.process_time()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_s + seconds)
    elapsed = time.perf_counter() - clock["began"]
    p50, p99 = (float(v) for v in np.percentile(latencies, [50, 99])) if latencies else (np.inf, np.inf)
    return {
        "rows_per_s": len(latencies) * rows / elapsed,
        "p50_ms": p50,
        "p99_ms": p99,
        "requests": len(latencies),
        "failures": failures[0],
        "failures_per_s": failures[0] / elapsed,
        "client_cpu": (time.process_time() - cpu) / elapsed,
    }
