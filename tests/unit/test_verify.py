import gzip

import numpy as np
import pytest

from recserve.build.evaluation import logloss
from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.cli import main
from recserve.clients.rows import read_rows
from recserve.clients.writers import write_csv
from recserve.core.ranking import roc_auc
from recserve.verify import compare, read_expected, score_in_batches
from tests.unit.conftest import TINY_SPEC


def test_expected_scores_are_read_one_per_line(tmp_path):
    path = tmp_path / "scores.txt.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("0.25\n0.5\n1\n\n")
    np.testing.assert_array_equal(read_expected(path), [0.25, 0.5, 1.0])


@pytest.mark.parametrize(
    ("text", "message"), [("0.1\nabc\n", "line 2: 'abc'"), ("0.1\n1.5\n", "line 2: 1.5")]
)
def test_a_bad_expected_score_names_its_line(tmp_path, text, message):
    path = tmp_path / "scores.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_expected(path)


def test_compare_reports_the_rows_over_tolerance_worst_first():
    expected = np.array([0.1, 0.2, 0.3, 0.4])
    result = compare("here", expected + [0.0, 3e-5, 0.0, -1e-4], expected, None, tolerance=1e-5)
    assert (result.over, result.worst, result.passed) == (2, (3, 1), False)
    assert result.max_abs == pytest.approx(1e-4)
    assert compare("here", expected, expected, None).passed
    with pytest.raises(ValueError, match="3 expected scores for 4 rows"):
        compare("here", expected, expected[:3], None)


def test_auc_and_logloss():
    rng = np.random.default_rng(5)
    labels = (rng.random(500) < 0.3).astype(np.float32)
    scores = np.round(1 / (1 + np.exp(-(labels - 0.3 + rng.standard_normal(500)))), 2)  # many ties
    positive, negative = scores[labels == 1], scores[labels == 0]
    pairs = (positive[:, None] > negative[None, :]) + 0.5 * (positive[:, None] == negative[None, :])
    assert roc_auc(labels, scores) == pytest.approx(pairs.mean())  # every pair, ties counted half
    expected = -np.mean(labels * np.log(scores) + (1 - labels) * np.log(1 - scores))
    assert logloss(labels, scores) == pytest.approx(expected)
    assert roc_auc(np.array([1.0, 0.0]), np.array([0.5, 0.5])) == 0.5  # ties share their rank
    assert roc_auc(np.ones(3), np.full(3, 0.9)) is None  # one class: no AUC
    assert logloss(np.zeros(0), np.zeros(0)) is None


@pytest.fixture
def user_files(tiny_spec, tiny_repository, tmp_path):
    """Rows and "the user's framework's" scores: the PyTorch reference of the same model."""
    rows_path = tmp_path / "rows.csv"
    write_csv(rows_path, generate(tiny_spec, 300, seed=8), tiny_spec, with_label=True)
    rows = read_rows(rows_path, tiny_spec)
    reference = score_in_batches(
        rows, tiny_spec, reference_pipeline(tiny_spec, tiny_repository, "torch").predict
    )
    return rows_path, reference


def test_verify_passes_when_the_scores_agree(tiny_repository, user_files, tmp_path, capsys):
    rows_path, reference = user_files
    expected = tmp_path / "expected.txt"
    expected.write_text("".join(f"{p:.9f}\n" for p in reference))
    argv = ["--spec", TINY_SPEC, "verify", "--rows", str(rows_path), "--expected", str(expected)]
    assert main([*argv, "--repository", str(tiny_repository)]) == 0
    out = capsys.readouterr().out
    assert "| in process (onnx) | 300 |" in out and "| expected (yours) | 300 |" in out


def test_verify_fails_naming_the_rows_that_differ(tiny_repository, user_files, tmp_path, capsys):
    rows_path, reference = user_files
    shifted = reference.copy()
    shifted[[7, 123]] += [0.01, -0.003]
    expected = tmp_path / "expected.txt"
    expected.write_text("".join(f"{p:.9f}\n" for p in shifted))
    argv = ["--spec", TINY_SPEC, "verify", "--rows", str(rows_path), "--expected", str(expected)]
    assert main([*argv, "--repository", str(tiny_repository), "--runtime", "torch"]) == 1
    out = capsys.readouterr().out
    assert "2 rows differ by over 1e-05" in out
    assert out.index("row 7: expected") < out.index("row 123: expected")  # worst first
    assert "row=7 feature=" in out and "tier=" in out  # what explain says about them
