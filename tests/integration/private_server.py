"""A tritonserver of a test's own, over a scratch copy of the repository (tests that change or break it)."""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from recserve.perf.harness.traffic import TrafficCounts, scratch_repository, traffic_worker
from recserve.server import Ports, Security, TritonServer


@contextlib.contextmanager
def private_server(
    repository: Path,
    scratch: Path,
    model_control: str = "explicit",
    exit_timeout_s: int = 30,
    prepare: Callable[[Path], None] | None = None,
) -> Iterator[TritonServer]:
    """Start a server over a copy of ``repository`` (changed by ``prepare`` first, when given)."""
    root = scratch_repository(repository, scratch / "repository")
    if prepare is not None:
        prepare(root)
    key = secrets.token_urlsafe(32) if model_control == "explicit" else None
    server = TritonServer(
        root,
        Ports.free(),
        log_path=scratch / "server.log",
        security=Security(model_control, key),
        exit_timeout_s=exit_timeout_s,
    )
    with server:
        yield server


@contextlib.contextmanager
def background_traffic(
    server: TritonServer, spec, protocols=("grpc", "grpc", "http")
) -> Iterator[TrafficCounts]:
    """Valid requests from one thread per protocol entry until the block ends."""
    stop, counts = threading.Event(), TrafficCounts()
    threads = [
        threading.Thread(
            target=traffic_worker, args=(server, spec, p, stop, counts, 0.0, 500 + i), daemon=True
        )
        for i, p in enumerate(protocols)
    ]
    for thread in threads:
        thread.start()
    try:
        yield counts
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
