"""How well scores rank labels: ROC AUC, for training reports, verification and the learner's decisions."""

from __future__ import annotations

import numpy as np


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
