"""``recserve learn`` end to end: rows a real tritonserver logged, joined with clicks, trained, and the
touched rows published as deltas that the server serves when it starts again (higher scores, new versions).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from recserve.build.synthetic import generate
from recserve.clients import CTRClient, read_rows
from recserve.clients.feedback import FeedbackFile, to_events
from recserve.clients.writers import write_tsv
from recserve.core.sections.logging import LOG_DIR_ENV
from recserve.loop.join import Join
from recserve.loop.joiner import Joiner
from recserve.loop.sources import FeedbackFiles, LogSegments
from recserve.server import Ports, TritonServer
from tests.integration.helpers import copy_repository, recserve

ROWS = 24


def score(repository, spec, rows, folder, log_dir=None):
    patch = pytest.MonkeyPatch()
    if log_dir is not None:
        patch.setenv(LOG_DIR_ENV, str(log_dir))
    try:
        with TritonServer(repository, Ports.free(), log_path=folder / "server.log") as server:
            with CTRClient(server.grpc_url, timeout_s=30, spec=spec) as client:
                return client.score_inputs(rows.to_inputs(spec), "learn-0")
    finally:
        patch.undo()


def test_clicked_rows_score_higher_once_the_learner_published_their_rows(spec, repository, tmp_path):
    copy = copy_repository(repository, tmp_path / "repository")
    rows = read_rows(write_tsv(tmp_path / "rows.tsv", generate(spec, ROWS, seed=7), spec), spec)
    before = score(copy, spec, rows, tmp_path, log_dir=tmp_path / "log")
    FeedbackFile(tmp_path / "feedback" / "a.jsonl").write(
        to_events([("learn-0", r, "click") for r in range(ROWS)])
    )
    joiner = Joiner(Join(300.0, 60.0), LogSegments(tmp_path / "log"), FeedbackFiles(tmp_path / "feedback"),
                    tmp_path / "examples", 1.0)  # fmt: skip
    joiner.recover()
    joiner.step()
    joiner.commit()
    assert joiner.examples_written == ROWS

    examples = str(tmp_path / "examples")
    done = recserve("learn", "--repository", str(copy), "--examples-dir", examples, "--once",
                    "--learning-rate", "0.1", "--batch-size", "8")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    published = lines[-1]["published"]
    assert lines[0]["log_loss"] > lines[-2]["log_loss"]  # progressive: each batch scored before it trains
    assert set(published) >= {spec.target.table}

    after = score(copy, spec, rows, tmp_path)
    assert np.mean(after.probabilities) > np.mean(before.probabilities) + 0.01
    assert (after.probabilities > before.probabilities).mean() > 0.8
    served = after.table_versions()
    assert all(served[table] == version for table, version in published.items())
