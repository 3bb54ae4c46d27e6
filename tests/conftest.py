"""Shared fixtures: the default spec (the built default repository: tests/integration/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def spec() -> ModelSpec:
    return load_spec()
