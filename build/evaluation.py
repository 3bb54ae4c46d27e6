"""How well scores fit labels: logloss, and the figures of training reports (ROC AUC: core.ranking)."""

from __future__ import annotations

import numpy as np

PROBABILITY_EPSILON = 1e-7  # probabilities are clipped to [eps, 1 - eps] for the logloss


def logloss(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """Mean binary cross-entropy of probabilities ``scores``; None for no rows."""
    labels = np.asarray(labels, np.float64).reshape(-1)
    if labels.size == 0:
        return None
    clipped = np.clip(
        np.asarray(scores, np.float64).reshape(-1), PROBABILITY_EPSILON, 1.0 - PROBABILITY_EPSILON
    )
    return float(-np.mean(labels * np.log(clipped) + (1.0 - labels) * np.log(1.0 - clipped)))


def figure(value: float | None) -> str:
    """A metric for a report line: four decimals, or ``n/a`` where it is not defined."""
    return "n/a" if value is None else f"{value:.4f}"
