"""How well scores rank and fit labels: ROC AUC and logloss, for training reports and verification."""

from __future__ import annotations

import numpy as np

PROBABILITY_EPSILON = 1e-7  # probabilities are clipped to [eps, 1 - eps] for the logloss


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """Area under the ROC curve as a rank statistic, tied scores sharing their mean rank.

    Returns:
        The AUC, or None when the labels hold only one class (or nothing).
    """
    positives = np.asarray(labels, np.float64).reshape(-1) > 0.5
    scores = np.asarray(scores, np.float64).reshape(-1)
    pos, neg = int(positives.sum()), int((~positives).sum())
    if pos == 0 or neg == 0:
        return None
    ranks = np.empty(scores.size, np.float64)
    ranks[np.argsort(scores, kind="stable")] = np.arange(1, scores.size + 1)
    _, tie = np.unique(scores, return_inverse=True)
    ranks = (np.bincount(tie, ranks) / np.bincount(tie))[tie]
    return float((ranks[positives].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


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
