import numpy as np
import pytest

from recserve.build.repository import is_built, reference_pipeline
from recserve.build.synthetic import generate
from recserve.build.train import split_holdout
from recserve.cli import main
from recserve.clients.rows import read_rows
from recserve.clients.writers import write_csv, write_tsv
from recserve.core.spec.parse import load_spec
from recserve.verify import score_in_batches
from tests.unit.conftest import TINY_SPEC


def test_rows_read_from_a_file_are_the_rows_written(tiny_spec, tmp_path):
    raw = generate(tiny_spec, 50, seed=4)
    back = read_rows(write_tsv(tmp_path / "rows.tsv", raw, tiny_spec, with_label=True), tiny_spec).to_raw(
        tiny_spec
    )
    for name in ("dense_missing", "categorical", "target", "lengths", "labels"):
        np.testing.assert_array_equal(getattr(back, name), getattr(raw, name), err_msg=name)
    np.testing.assert_array_equal(back.dense, np.where(raw.dense_missing, 0.0, raw.dense))
    width = back.history.shape[1]
    np.testing.assert_array_equal(back.history, raw.history[:, :width])


def test_unlabelled_rows_cannot_be_trained_on(tiny_spec, tmp_path):
    path = write_tsv(tmp_path / "rows.tsv", generate(tiny_spec, 5, seed=4), tiny_spec, with_label=False)
    rows = read_rows(path, tiny_spec)
    with pytest.raises(ValueError, match="need a label column"):
        rows.to_raw(tiny_spec)


def test_the_holdout_split_is_seeded_and_disjoint(tiny_spec):
    raw = generate(tiny_spec, 101, seed=1)
    train, held = split_holdout(raw, seed=3)
    again, _ = split_holdout(raw, seed=3)
    assert (len(train), len(held)) == (91, 10)
    np.testing.assert_array_equal(train.labels, again.labels)
    with pytest.raises(ValueError, match="at least 2"):
        split_holdout(raw.take(slice(0, 1)), seed=3)


def test_build_trains_on_the_users_rows(tiny_spec, tmp_path, capsys):
    rows = write_csv(tmp_path / "rows.csv", generate(tiny_spec, 900, seed=21), tiny_spec, with_label=True)
    repository = tmp_path / "repository"
    argv = ["--spec", TINY_SPEC, "build", "--repository", str(repository), "--train-data", str(rows)]
    assert main([*argv, "--max-rows", "800"]) == 0
    err = capsys.readouterr().err
    assert "read 800 labelled rows" in err and "your rows: 720 to train on, 80 held out" in err
    assert "held-out AUC" in err and "logloss" in err
    assert is_built(tiny_spec, repository)
    served = reference_pipeline(tiny_spec, repository, "onnx")
    scores = score_in_batches(read_rows(rows, tiny_spec), tiny_spec, served.predict)
    assert scores.shape == (900,) and np.isfinite(scores).all()


def test_build_trains_on_an_avazu_export(tmp_path, capsys):
    """Avazu's own columns: ``id`` (above 2^63, ignored) first, ``click`` as the label, CRLF."""
    spec = load_spec("avazu")
    rows = write_csv(tmp_path / "rows.csv", generate(spec, 600, seed=22), spec, with_label=True)
    lines = rows.read_text().splitlines()
    exported = tmp_path / "train.csv"
    exported.write_text(
        "\r\n".join(
            [f"id,{lines[0]}", *(f"{10000174058809263569 + i},{line}" for i, line in enumerate(lines[1:]))]
        )
    )
    repository = tmp_path / "repository"
    assert (
        main(["--spec", "avazu", "build", "--repository", str(repository), "--train-data", str(exported)])
        == 0
    )
    assert "your rows: 540 to train on, 60 held out" in capsys.readouterr().err
    assert is_built(spec, repository)
