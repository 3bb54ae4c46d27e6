"""The rollback watch of ``recserve learn``: a published version judged against the rows it replaced.

After a publish the learner watches the examples its new versions served. Each is scored twice on
the same features through the same frozen network: by the new version (the score served, or, where
the example carries none, the published rows scored again) and by the rows the publish replaced
(scored again: the rows as served before it, the store's where it published a row for the first
time). Once ``watch_examples`` came, with both labels where both weigh, the two weighted log losses
are compared: the version is rolled back when its own is worse by more than the margin.

Both losses are measured on the same examples, so a stretch of harder rows on a drifting stream
raises them together and does not read as a worse version (the watch once compared the served loss
after a publish with the served loss before it, on different examples, and rolled back good
versions for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from recserve.core.ranking import roc_auc

#: (table id, key): a row
Key = tuple[int, int]


@dataclass
class Watch:
    """A publish being watched: its versions, the rows it published and those it replaced, what it scored."""

    versions: dict[str, int]
    rows: dict[Key, np.ndarray]  # each row as this publish published it
    # each published row's value and accumulator before (None: the store's row, a new accumulator)
    replaced: dict[Key, tuple[np.ndarray, float] | None]
    # the positives' weighted share of the examples before it: the watched examples' log loss is
    # weighed to it, since the positives of a serving come at once and its negatives only as their
    # windows close, so the first examples a new version served are mostly clicks
    positive_share: float = 0.0
    # label, weight, the new version's score, the replaced rows' score: per example it served
    scored: list[np.ndarray] = field(default_factory=list)

    @property
    def previous(self) -> dict[Key, np.ndarray | None]:
        """The rows before the publish, as a learner's overlay (None: the store's)."""
        return {key: None if value is None else value[0] for key, value in self.replaced.items()}

    def judge(self, watch_examples: int) -> tuple[float, float] | None:
        """The weighted log losses (the new version's, the replaced rows') once enough came; else None."""
        return judge(self.scored, self.positive_share, watch_examples)


def judge(scored_parts: list[np.ndarray], share: float, watch_examples: int) -> tuple[float, float] | None:
    """The weighted log losses of columns 2 and 3 of ``scored_parts`` (label, weight, new, before).

    None until ``watch_examples`` came with both kinds of label where both weigh; the positives
    and negatives are weighed to ``share``, the positives' share before the publish.
    """
    scored = _joined(scored_parts)
    positive = scored[:, 0] > 0.5
    if len(scored) < watch_examples or (share > 0 and not positive.any()) or (
        share < 1 and positive.all()
    ):  # fmt: skip
        return None  # not yet, or not both kinds of label when both weigh
    losses = [
        sum(
            part * log_loss(scored[kind, column], scored[kind, 0], scored[kind, 1])
            for part, kind in ((share, positive), (1 - share, ~positive))
            if part > 0
        )
        for column in (2, 3)
    ]
    return float(losses[0]), float(losses[1])


def log_loss(p: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> float:
    """The weighted log loss of probabilities ``p``."""
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(np.sum(weights * -(labels * np.log(p) + (1 - labels) * np.log(1 - p))) / weights.sum())


def progressive_check(scored_parts: list[np.ndarray]) -> tuple[float, float]:
    """The weighted log losses (learner's progressive scores, served scores) of ``scored_parts``.

    Each part holds, per example: the learner's progressive probability, the label, the weight and
    the served score (NaN: none came). Measured on the examples that carry their served score
    (NaN, NaN: none does).
    """
    scored = _with_served(scored_parts)
    if not len(scored):
        return float("nan"), float("nan")
    labels, weights = scored[:, 1], scored[:, 2]
    return log_loss(scored[:, 0], labels, weights), log_loss(scored[:, 3], labels, weights)


def positive_share(scored_parts: list[np.ndarray]) -> float:
    """The positives' weighted share of ``scored_parts`` (as :func:`progressive_check` reads them)."""
    scored = _joined(scored_parts)
    weights = scored[:, 2].sum()
    return float((scored[:, 2] * scored[:, 1]).sum() / weights) if weights > 0 else 0.0


def progressive_auc(scored_parts: list[np.ndarray]) -> tuple[float, float]:
    """The AUCs (learner's progressive scores, served scores) of ``scored_parts``.

    As :func:`progressive_check`, on the examples that carry their served score; NaN, NaN where
    they hold one label alone.
    """
    scored = _with_served(scored_parts)
    learner, served = roc_auc(scored[:, 1], scored[:, 0]), roc_auc(scored[:, 1], scored[:, 3])
    return (float("nan"), float("nan")) if learner is None or served is None else (learner, served)


def worse(
    losses: tuple[float, float],
    aucs: tuple[float, float],
    max_loss_increase: float | None,
    max_auc_drop: float | None,
) -> str:
    """Why the learner's scores are worse than the served ones by more than a margin ('': they are not).

    ``losses`` and ``aucs`` are (learner, served); a margin of None is not checked, nor a NaN figure.
    """
    if max_loss_increase is not None and losses[0] > losses[1] + max_loss_increase:
        return f"log loss {losses[0]:.5f} against {losses[1]:.5f} (margin {max_loss_increase:g})"
    if max_auc_drop is not None and aucs[0] < aucs[1] - max_auc_drop:
        return f"AUC {aucs[0]:.4f} against {aucs[1]:.4f} (margin {max_auc_drop:g})"
    return ""


def watched_auc(scored_parts: list[np.ndarray]) -> tuple[float, float]:
    """The AUCs (the new version's, the replaced one's) of a watch's examples; NaN with one label alone.

    Unlike the log loss it needs no weighing to the positives' share: a rank statistic does not
    move with the classes' proportions, so the clicks coming first do not bias it.
    """
    scored = _joined(scored_parts)
    new, before = roc_auc(scored[:, 0], scored[:, 2]), roc_auc(scored[:, 0], scored[:, 3])
    return (float("nan"), float("nan")) if new is None or before is None else (new, before)


def _joined(scored_parts: list[np.ndarray]) -> np.ndarray:
    """The batches' ``[examples, 4]`` arrays one under the other (none: an empty one)."""
    return np.concatenate(scored_parts) if scored_parts else np.zeros((0, 4))


def _with_served(scored_parts: list[np.ndarray]) -> np.ndarray:
    """The examples of ``scored_parts`` that carry their served score (column 3 not NaN)."""
    scored = _joined(scored_parts)
    return scored[~np.isnan(scored[:, 3])]
