"""One real tritonserver for the integration tests, on free loopback ports, stopped with SIGINT."""

from __future__ import annotations

from pathlib import Path

import pytest

from recserve.server import Ports, TritonServer

_SERVER: TritonServer | None = None


@pytest.fixture(scope="session")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory):
    global _SERVER
    log = tmp_path_factory.mktemp("tritonserver") / "server.log"
    _SERVER = TritonServer(repository, Ports.free(), log_path=log)
    with _SERVER as running:
        yield running
    _SERVER = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _SERVER is not None:
        report.sections.append(("tritonserver log (tail)", _SERVER.log_tail(80)))
