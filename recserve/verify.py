"""``recserve verify``: does recserve score the user's rows as the user's own framework did?

The user brings raw rows (any file ``recserve predict`` reads) and the scores their framework gave
those rows, one probability per line in row order. recserve scores the same rows in process (the
served ONNX graph with the served store, or the PyTorch reference) and, given ``--url``, through the
live server, and compares: max and p99 of ``|Δ|``, rows over the tolerance, AUC and logloss of both
on labelled rows, and the worst rows with what ``explain`` says about their features.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from recserve.backends.steps.explain import explain
from recserve.backends.store.tiered import TieredStore
from recserve.build.evaluation import logloss
from recserve.clients.rows import Rows
from recserve.core.ranking import roc_auc
from recserve.core.spec.model import ModelSpec
from recserve.errors import shorten

DEFAULT_TOLERANCE = 1e-5
WORST_ROWS = 5
#: Characters of a library's explanation (which may quote the file) kept in a message.
EXPLANATION_LIMIT = 160

Read = TypeVar("Read")


@dataclass(frozen=True)
class Comparison:
    """recserve's scores from one source against the expected scores."""

    source: str
    rows: int
    max_abs: float
    p99_abs: float
    over: int  # rows with |Δ| above the tolerance
    tolerance: float
    worst: tuple[int, ...]  # row numbers (0-based), largest |Δ| first
    auc: float | None = None  # of recserve's scores, on labelled rows
    logloss: float | None = None

    @property
    def passed(self) -> bool:
        """True when no row is over the tolerance."""
        return self.over == 0


def read_named(path: Path, read: Callable[[Path], Read]) -> Read:
    """``read(path)``, every way it fails turned into one ValueError that names the file.

    Raises:
        ValueError: the file is missing, unreadable, not UTF-8 text, a broken ``.gz``, or ``read``
            refused its content (its message, prefixed with the file's name when it lacks it).
    """
    try:
        return read(path)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        reason = shorten(str(exc) or type(exc).__name__, EXPLANATION_LIMIT)
        raise ValueError(f"{path.name} cannot be read as text ({reason})") from None
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if path.name in message else f"{path.name}: {message}") from None


def read_expected(path: Path) -> np.ndarray:
    """One probability per line (``.gz`` too); blank lines at the end are allowed.

    Raises:
        ValueError: a line is not a finite number in [0, 1], naming the line.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8-sig") as fh:
        lines = fh.read().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    values = np.empty(len(lines), np.float64)
    for number, line in enumerate(lines, 1):
        try:
            value = float(line.strip().split(",")[-1])
        except ValueError:
            raise ValueError(f"{path}, line {number}: {shorten(line.strip())} is not a probability") from None
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"{path}, line {number}: {value} is not a probability in [0, 1]")
        values[number - 1] = value
    return values


def compare(
    source: str,
    scores: np.ndarray,
    expected: np.ndarray,
    labels: np.ndarray | None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Comparison:
    """Compare ``scores`` with ``expected`` row by row.

    Raises:
        ValueError: the two have different lengths.
    """
    scores = np.asarray(scores, np.float64).reshape(-1)
    if scores.shape != expected.shape:
        raise ValueError(
            f"{len(expected)} expected scores for {len(scores)} rows: one score per row is needed"
        )
    delta = np.abs(scores - expected)
    return Comparison(
        source=source,
        rows=int(scores.size),
        max_abs=float(delta.max(initial=0.0)),
        p99_abs=float(np.quantile(delta, 0.99)) if delta.size else 0.0,
        over=int((delta > tolerance).sum()),
        tolerance=tolerance,
        worst=tuple(int(i) for i in np.argsort(-delta, kind="stable")[:WORST_ROWS] if delta[i] > tolerance),
        auc=None if labels is None else roc_auc(labels, scores),
        logloss=None if labels is None else logloss(labels, scores),
    )


def score_in_batches(rows: Rows, spec: ModelSpec, predict: Callable[..., np.ndarray]) -> np.ndarray:
    """Scores of all rows through ``predict`` (raw request tensors in), ``max_batch_size`` at a time."""
    parts = [
        np.asarray(predict(batch.to_inputs(spec))).reshape(-1)
        for batch in rows.batches(spec.model.max_batch_size)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def explain_rows(spec: ModelSpec, store: TieredStore, rows: Rows, numbers: Sequence[int]) -> list[str]:
    """``explain``'s records of the given rows, one line each (numbers are the rows' 0-based places)."""
    if not numbers:
        return []
    picked = rows.take(np.asarray(numbers))
    lines = []
    for record in explain(spec, store, picked.to_inputs(spec)):
        record = {**record, "row": numbers[int(record["row"])]}
        lines.append("  " + " ".join(f"{key}={value}" for key, value in record.items()))
    return lines


def rounding_note(spec: ModelSpec) -> str:
    """Why rows may fail against float32 scores: the tables the spec stores as float16 ("": none)."""
    rounded = spec.store.float16_tables
    if not rounded:
        return ""
    return (
        f"note: table(s) {', '.join(rounded)} are stored as float16, so their float32 weights were rounded "
        "(recserve import reported the largest change of a weight per table): scores of the float32 "
        "weights differ by about that much. Compare against the rounded weights: score your model with "
        "those tables rounded to float16 (in PyTorch: weight.data = weight.data.half().float()) and "
        'verify against those scores; or store the tables as float32 (dtype = "fp32" in [tables.<name>]).'
    )


def format_report(comparisons: Sequence[Comparison], expected: np.ndarray, labels: np.ndarray | None) -> str:
    """The comparison table, plus the expected scores' own AUC and logloss."""
    lines = [
        "| source | rows | max abs diff | p99 abs diff | rows over tolerance | AUC | logloss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    if labels is not None:
        auc, loss = _number(roc_auc(labels, expected)), _number(logloss(labels, expected))
        lines.append(f"| expected (yours) | {expected.size} | | | | {auc} | {loss} |")
    for c in comparisons:
        lines.append(
            f"| {c.source} | {c.rows} | {c.max_abs:.3g} | {c.p99_abs:.3g} | {c.over} (> {c.tolerance:g}) "
            f"| {_number(c.auc)} | {_number(c.logloss)} |"
        )
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"
