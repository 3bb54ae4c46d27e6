"""Helpers shared by unit-test modules (fixtures live in ``conftest.py``)."""

from __future__ import annotations

import tomllib

from recserve.core.spec_parse import spec_path


def ctr_spec_document() -> dict:
    """The bundled ``ctr`` spec as its parsed TOML document, for a test to edit and parse."""
    with open(spec_path("ctr"), "rb") as fh:
        return tomllib.load(fh)
