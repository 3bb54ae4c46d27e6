"""``recserve learn`` end to end: rows a real tritonserver logged, joined with clicks, trained, and the
touched rows published as deltas that the server serves when it starts again (higher scores, new versions);
with the dense network trained too, a new dense version that the running server loads (hot swap).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from recserve.backends.base.artifacts import read_manifest
from recserve.build.importer import import_repository
from recserve.build.repository import version_dir
from recserve.build.synthetic import generate
from recserve.clients import CTRClient, read_rows
from recserve.clients.feedback import FeedbackFile, to_events
from recserve.clients.writers import write_tsv
from recserve.commands.perf import log_skew
from recserve.core.names import DENSE
from recserve.core.sections.logging import LOG_DIR_ENV
from recserve.loop.join import Join
from recserve.loop.joiner import Joiner
from recserve.loop.sources import FeedbackFiles, LogSegments
from recserve.server import Ports, Security, TritonServer
from tests.integration.helpers import copy_repository, recserve
from tests.model_exports import export_tables

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


def clicked_examples(tmp_path) -> str:
    """Every row of request ``learn-0`` in the log under ``tmp_path`` clicked, joined into examples."""
    FeedbackFile(tmp_path / "feedback" / "a.jsonl").write(
        to_events([("learn-0", r, "click") for r in range(ROWS)])
    )
    joiner = Joiner(Join(300.0, 60.0), LogSegments(tmp_path / "log"), FeedbackFiles(tmp_path / "feedback"),
                    tmp_path / "examples", 1.0)  # fmt: skip
    joiner.recover()
    joiner.step()
    joiner.commit()
    assert joiner.examples_written == ROWS
    return str(tmp_path / "examples")


def imported(spec, repository, tmp_path) -> Path:
    """The built model brought back as a user's: its tables exported, its ONNX alone (no PyTorch weights)."""
    export_tables(spec, repository, tmp_path / "tables", dict.fromkeys(spec.table_names, "keyed"))
    shutil.copy(version_dir(repository, DENSE, spec) / "model.onnx", tmp_path / "model.onnx")
    import_repository(
        spec, tmp_path / "tables", tmp_path / "model.onnx", tmp_path / "repository", lambda _: None
    )
    assert "weights" not in read_manifest(version_dir(tmp_path / "repository", DENSE, spec))["files"]
    return tmp_path / "repository"


@pytest.mark.parametrize("model", ["built", "imported"])
def test_clicked_rows_score_higher_once_the_learner_published_their_rows(spec, repository, tmp_path, model):
    # an imported model's rows train through its own ONNX network, run under PyTorch (frozen)
    if model == "built":
        copy = copy_repository(repository, tmp_path / "repository")
    else:
        copy = imported(spec, repository, tmp_path)
    rows = read_rows(write_tsv(tmp_path / "rows.tsv", generate(spec, ROWS, seed=7), spec), spec)
    before = score(copy, spec, rows, tmp_path, log_dir=tmp_path / "log")
    examples = clicked_examples(tmp_path)
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


def test_a_trained_dense_version_is_loaded_by_the_running_server(spec, repository, tmp_path, monkeypatch):
    copy = copy_repository(repository, tmp_path / "repository")
    rows = read_rows(write_tsv(tmp_path / "rows.tsv", generate(spec, ROWS, seed=7), spec), spec)
    score(copy, spec, rows, tmp_path, log_dir=tmp_path / "log")
    examples = clicked_examples(tmp_path)
    (copy / "dense" / ".9.partial").mkdir()  # what a learner killed mid-write leaves: never served
    monkeypatch.setenv("RECSERVE_ADMIN_KEY", "learn-test-key")
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "served"))
    security = Security(model_control="explicit", admin_key="learn-test-key")
    with TritonServer(copy, Ports.free(), log_path=tmp_path / "server.log", security=security) as server:
        with CTRClient(server.grpc_url, timeout_s=30, spec=spec) as client:
            before = client.score_inputs(rows.to_inputs(spec), "learn-1")
            done = recserve(
                "learn",
                "--repository",
                str(copy),
                "--examples-dir",
                examples,
                "--once",
                "--learning-rate",
                "1e-6",
                "--batch-size",
                "8",
                "--dense-learning-rate",
                "0.05",
                "--servers",
                server.grpc_url,
            )  # fmt: skip (rows barely move: the weights score)
            assert done.returncode == 0, done.stderr[-2000:]
            lines = [json.loads(line) for line in done.stdout.splitlines()]
            assert lines[-2]["dense_published"] == 2  # published before the rows
            deadline = time.monotonic() + 20
            while True:  # the rows' deltas are served within the store's poll
                after = client.score_inputs(rows.to_inputs(spec), "learn-2")
                served = after.table_versions()
                if all(served[t] == v for t, v in lines[-1]["published"].items()):
                    break
                assert time.monotonic() < deadline, served
                time.sleep(0.5)
    assert before.dense_version == 1 and after.dense_version == 2  # swapped in the running server
    assert np.mean(after.probabilities) > np.mean(before.probabilities) + 0.01
    assert sorted(p.name for p in (copy / "dense").iterdir() if p.name[0] != ".") == [
        "1", "2", "config.pbtxt", "configs"
    ]  # fmt: skip
    # no skew across the swap: the rows served by version 2 scored again by version 2's network
    skew = log_skew(copy, tmp_path / "served")
    assert skew["skew_rows_rescored"] >= ROWS and skew["skew_max_abs"] <= 1e-6, skew
