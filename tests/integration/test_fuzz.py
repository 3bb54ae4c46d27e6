"""The quick form of ``recserve lab fuzz``: 20 s of seeded bodies through the proxy to two supervised servers.

Every case (valid requests in other spellings, escaped shape bombs, duplicate and unknown keys,
number forms, nesting, truncation, stray bytes, unicode, the binary form, shapes and bodies near and
over the limits) goes through Envoy's front door to real tritonservers of the tiny spec. No server
may die, every valid request must be served, every request the front door promises to refuse must
get a 4xx. On the front door before the strict parse, the escaped bombs abort a tritonserver.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recserve.build.repository import build_repository
from recserve.core.spec.parse import load_spec
from recserve.perf.lab.fuzz.run import format_report, run_fuzz

pytestmark = pytest.mark.integration

SECONDS = 20.0


@pytest.fixture(scope="module")
def tiny_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "tiny"
    build_repository(load_spec("tiny"), path)
    return path


def test_seeded_bodies_through_the_proxy_kill_nothing_and_every_valid_one_is_served(
    tiny_repository, tmp_path
):
    report = run_fuzz(load_spec("tiny"), tiny_repository, SECONDS, seed=48, workdir=tmp_path / "layer")
    text = format_report(report)
    assert report.crashes == 0, text
    assert report.failed_valid == 0, text
    assert report.invalid_passed == 0, text
    assert report.cases >= 300, text  # about 60 a second here
    assert report.expected["valid"] >= 50 and report.expected["invalid"] >= 100, text
    assert len(report.mutations) >= 13, text
