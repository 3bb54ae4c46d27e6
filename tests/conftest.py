"""Shared fixtures: the spec and a built model repository (built once if missing)."""

from __future__ import annotations

from pathlib import Path

import pytest
from recserve.build.repository import build_repository, is_built

from recserve.spec import ModelSpec, load_spec

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"


@pytest.fixture(scope="session")
def spec() -> ModelSpec:
    return load_spec()


@pytest.fixture(scope="session")
def repository(spec: ModelSpec) -> Path:
    """The default repository, built from the spec (``make build`` does this before the tests)."""
    if not is_built(spec, REPOSITORY):
        build_repository(spec, REPOSITORY)
    return REPOSITORY
