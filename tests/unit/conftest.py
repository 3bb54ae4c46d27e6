"""Unit-test fixtures: a tiny spec and a tiny repository built from it (seconds, into a tmp folder).

Unit tests never train or read the default model: tests that need a built repository use
``tiny_repository`` (built from ``build/specs/tiny.toml``); the trained default repository is for
tests/integration only, and asking for it here fails at once (see ``repository`` below).
The drift tests read the committed, git-tracked config.pbtxt files of the default spec
(``COMMITTED_CONFIGS``), which need no build.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recserve.build.repository import build_repository
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from tests.conftest import ROOT

TINY_SPEC = "tiny"  # build/specs/tiny.toml; `recserve --spec tiny ...` names it too
# The config.pbtxt files checked in for the default spec (no version folders are read from here).
COMMITTED_CONFIGS = ROOT / "model_repository"


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    return load_spec(TINY_SPEC)


@pytest.fixture(scope="session")
def tiny_repository(tiny_spec: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete repository (tables, ONNX, weights, adapters, configs) of the tiny spec."""
    path = tmp_path_factory.mktemp("tiny_repository")
    build_repository(tiny_spec, path)
    return path


@pytest.fixture(scope="session")
def repository() -> Path:
    pytest.fail(
        "unit tests do not use the trained default repository (it takes minutes to build): "
        "use tiny_spec / tiny_repository, or move the test to tests/integration"
    )
