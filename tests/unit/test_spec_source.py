"""Without ``--spec``, a command pointed at a repository takes the spec the repository carries; verify
against float32 scores of a float16 table says why rows fail, and passes against the rounded weights."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import tomllib

from recserve.build.importer import import_repository
from recserve.build.synthetic import generate
from recserve.cli import main
from recserve.clients.writers import write_csv
from recserve.commands.spec_source import command_spec
from recserve.core.spec.parse import load_spec, parse_spec, spec_path
from recserve.errors import ArtifactError
from tests.model_exports import HandWrittenModel


@pytest.fixture(scope="module")
def fp16_import(tmp_path_factory):
    """The tiny spec with float16 categorical tables, imported from a hand-written model."""
    folder = tmp_path_factory.mktemp("fp16_import")
    doc = tomllib.loads(spec_path("tiny").read_text())
    doc["tables"]["C{1..4}"]["dtype"] = "fp16"
    spec = parse_spec(doc)
    model = HandWrittenModel(spec)
    model.write(folder / "hand.onnx", output="probability")
    tables = model.random_tables(spec, folder / "tables")
    import_repository(spec, folder / "tables", folder / "hand.onnx", folder / "repo", lambda line: None)
    rows = generate(spec, 64, seed=8)
    write_csv(folder / "rows.csv", rows, spec)
    return spec, model, tables, rows, folder


def test_explain_reads_the_spec_of_the_repository_it_is_pointed_at(fp16_import, capsys):
    spec, _, _, rows, folder = fp16_import
    assert spec.name != load_spec().name  # the default spec could not read these rows
    code = main(
        ["explain", "--repository", str(folder / "repo"), "--input", str(folder / "rows.csv"), "--json"]
    )
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["feature"] for r in records} >= {"C1", "C4", "target_item"}
    assert len({r["row"] for r in records}) == len(rows)


def _expected(folder: Path, scores: np.ndarray) -> Path:
    path = folder / "expected.txt"
    path.write_text("".join(f"{p:.9f}\n" for p in scores))
    return path


def test_verify_says_why_float32_scores_fail_and_passes_against_the_rounded_weights(
    fp16_import, capsys, tmp_path
):
    spec, model, tables, rows, folder = fp16_import
    args = ["verify", "--repository", str(folder / "repo"), "--rows", str(folder / "rows.csv")]
    float32 = _expected(tmp_path, model.reference(spec, tables, rows))
    assert main([*args, "--expected", str(float32)]) == 1
    out = capsys.readouterr().out
    assert "C1, C2, C3, C4 are stored as float16" in out and "Compare against the rounded weights" in out
    rounded = {
        name: {**entry, "vectors": entry["vectors"].astype(np.float16).astype(np.float32)}
        if name in spec.store.float16_tables
        else entry
        for name, entry in tables.items()
    }
    assert main([*args, "--expected", str(_expected(tmp_path, model.reference(spec, rounded, rows)))]) == 0
    assert "stored as float16" not in capsys.readouterr().out


def test_without_spec_and_without_a_built_repository_the_command_says_so(tmp_path):
    args = argparse.Namespace(spec="ctr", spec_given=False, repository=tmp_path, repository_given=True)
    with pytest.raises(ArtifactError, match="holds no built model; pass --spec"):
        command_spec(args)
    args.spec_given = True
    assert command_spec(args).name == load_spec("ctr").name
