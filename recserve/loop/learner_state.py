"""What a restarted ``recserve learn`` keeps of the one before it: each published row's Adagrad accumulator.

The rows themselves are the served ones (the update log has every publish), and what was trained
is ``learner.json``'s segment; without the accumulators a restarted learner would take a new row's
large first steps again on rows it had already slowed down. They are written with each publish, as
they stood for the rows published (not what was trained after), to an ``.npz`` of plain arrays
(no pickle), atomically. The rollback watches are not kept: a version published before a restart
is no longer watched.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from recserve.loop.learner import Learner


def save(learner: Learner, path: Path) -> None:
    """The accumulators of the rows as last published, to ``path`` (replaced whole)."""
    published = {**learner.restored, **learner.published_accumulators}
    keys = list(published)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        np.savez(
            handle,
            tables=np.array([t for t, _ in keys], np.int16),
            keys=np.array([k for _, k in keys], np.int64),
            sums=np.array([published[k] for k in keys], np.float64),
        )
    os.replace(temporary, path)


def restore(learner: Learner, path: Path) -> int:
    """Give ``learner`` the accumulators saved at ``path`` (none there: nothing). Returns how many."""
    if not path.exists():
        return 0
    with np.load(path, allow_pickle=False) as saved:
        tables, keys, sums = saved["tables"], saved["keys"], saved["sums"]
        if not tables.shape == keys.shape == sums.shape:
            raise ValueError(f"{path}: the saved accumulators do not line up")
        restored = dict(zip(zip(tables.tolist(), keys.tolist(), strict=True), sums.tolist(), strict=True))
    learner.accumulators.update(restored)
    learner.restored.update(restored)
    return len(restored)
