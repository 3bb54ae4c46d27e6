"""The built default repository, and one real tritonserver on free loopback ports, stopped with SIGINT."""

from __future__ import annotations

from pathlib import Path

import pytest

from recserve.build.repository import build_repository, install_adapters, is_built
from recserve.core.spec.model import ModelSpec
from recserve.server import Ports, TritonServer
from tests.conftest import ROOT

REPOSITORY = ROOT / "model_repository"
_SERVER: TritonServer | None = None


@pytest.fixture(scope="session")
def repository(spec: ModelSpec) -> Path:
    """The default repository, built from the spec (``make build`` does this before the tests).

    A repository built earlier gets this tree's adapters, as ``recserve build --if-missing`` does.
    """
    if is_built(spec, REPOSITORY):
        install_adapters(spec, REPOSITORY)
    else:
        build_repository(spec, REPOSITORY)
    return REPOSITORY


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
