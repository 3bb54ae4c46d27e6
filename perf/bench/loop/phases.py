"""The bench's two cost phases, after the rounds, with the joiner and the learner stopped.

Each drives the servers **alone, by turns**, so that one server's background work (the loop
server's log writer) never lands inside another's request:

* **throughput**: closed loop, ``throughput_clients`` requests in flight, loop and frozen in the
  order loop, frozen, frozen, loop, ...: rows answered per second;
* **latency**: one client at ``latency_rate`` requests a second, the loop, the frozen and the
  control server (a second frozen one, logging off) in an order that turns round each turn: every
  request's latency. The control gives the A/A: what two servers of the same repository differ by
  at p99 on this machine, measured exactly as the loop server is against the frozen one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING

import numpy as np

from recserve.clients import CTRClient
from recserve.core.spec.model import ModelSpec
from recserve.server import TritonServer

if TYPE_CHECKING:
    from recserve.perf.bench.loop.bench import LoopGrid, Recorded

#: the servers of the latency phase, in their first turn's order
LATENCY_SIDES = ("loop", "frozen", "control")
#: the requests a phase sends round, as the SDK's inputs
Requests = list[dict[str, np.ndarray]]


def throughput(
    spec: ModelSpec, requests: Requests, servers: Mapping[str, TritonServer], recorded: Recorded
) -> None:
    """Closed-loop turns of the loop and frozen servers alone (loop, frozen, frozen, loop, ...)."""
    grid = recorded.grid
    for turn in range(grid.throughput_turns):
        for side in ("loop", "frozen") if turn % 2 == 0 else ("frozen", "loop"):
            began = time.monotonic()
            answered = _closed_loop(spec, servers[side].grpc_url, requests, grid, f"t{turn}-{side}")
            recorded.throughput_seconds[side] += time.monotonic() - began
            recorded.throughput_rows[side] += answered * grid.rows
            if side == "loop":
                recorded.loop_rows_sent += answered * grid.rows


def latency(
    spec: ModelSpec, requests: Requests, servers: Mapping[str, TritonServer], recorded: Recorded
) -> None:
    """Paced turns of each of :data:`LATENCY_SIDES` alone: each request's latency, per server.

    A first turn of each, not recorded, warms them: the control server has served nothing before
    this phase, and its first requests would be slow for it alone (its p99 and the A/A with it).
    """
    grid = recorded.grid
    count = max(1, round(grid.latency_rate * grid.latency_seconds))
    with ExitStack() as stack:
        clients = {
            side: stack.enter_context(CTRClient(servers[side].grpc_url, timeout_s=30, spec=spec))
            for side in LATENCY_SIDES
        }
        turns: list[tuple[str, tuple[str, ...]]] = [("w", LATENCY_SIDES)]  # warm, then recorded ones
        for k in range(grid.latency_turns):
            shift = k % len(LATENCY_SIDES)
            turns.append((str(k), LATENCY_SIDES[shift:] + LATENCY_SIDES[:shift]))
        for turn, sides in turns:
            for side in sides:
                latencies = _paced(clients[side], requests, count, grid.latency_rate, f"p{turn}-{side}")
                if turn != "w":
                    recorded.latency_s[side] += latencies
                if side == "loop":  # logged: every request sent to it counts
                    recorded.loop_rows_sent += count * grid.rows


def _paced(client: CTRClient, requests: Requests, count: int, rate: float, prefix: str) -> list[float]:
    """``count`` requests at ``rate`` a second, one at a time: each one's latency (s)."""
    latencies = []
    start = time.monotonic()
    for k in range(count):
        wait = start + k / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        began = time.perf_counter()
        client.score_inputs(requests[k % len(requests)], f"{prefix}-{k}")
        latencies.append(time.perf_counter() - began)
    return latencies


def _closed_loop(spec: ModelSpec, url: str, requests: Requests, grid: LoopGrid, prefix: str) -> int:
    """``throughput_clients`` closed loops against ``url`` for ``throughput_seconds``: requests answered."""
    counts = [0] * grid.throughput_clients
    deadline = time.monotonic() + grid.throughput_seconds

    def drive(worker: int) -> None:
        with CTRClient(url, timeout_s=30, spec=spec) as client:
            while time.monotonic() < deadline:
                k = counts[worker]
                client.score_inputs(requests[k % len(requests)], f"{prefix}-{worker}-{k}")
                counts[worker] += 1

    threads = [threading.Thread(target=drive, args=(w,)) for w in range(grid.throughput_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts)
