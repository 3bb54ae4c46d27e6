"""``[loop]``: the closed loop's joiner (its feedback, window, down-sampling, output) and learner.

``recserve join`` pairs the records the steps logged (``[logging]``: where it reads them) with the
feedback events that follow (:mod:`recserve.core.feedback`); ``recserve learn`` trains the served
rows on its examples. See docs/design/loop.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from recserve.core.sections.base import SpecError

FEEDBACK_SOURCES = ("files", "redis")


@dataclass(frozen=True)
class LoopSection:
    """``[loop]``: the join window, late horizon, negatives' rate, feedback and output; the learner's step."""

    # a click within this many seconds of the row being served makes a positive; a row whose
    # window closes unclicked makes a negative
    window_seconds: float = 300.0
    # a closed row is kept this much longer: a click in that time re-emits it as a (late) positive
    late_seconds: float = 3600.0
    # the share of negatives kept (w, decided by a hash of request id and row); each example
    # records its rate, so a learner corrects for it (ln w in the logit)
    negative_rate: float = 1.0
    # true: a row that closes without an impression event was not shown and makes no example
    require_impression: bool = False
    feedback: str = "files"  # "files": JSON lines in feedback_directory; "redis": streams on [store]
    feedback_directory: str = "feedback"
    feedback_prefix: str = "rs:loop"  # streams ``<prefix>:feedback:{<shard>}``
    feedback_streams: int = 4
    examples_directory: str = "examples"  # the joiner's output segments (and its state, in .state/)
    commit_seconds: float = 5.0  # examples are written (and inputs acknowledged) this often
    # a click waits at most this long for its row's score record (the dense step logs it apart from
    # the features) before its positive is emitted without it (counted examples_without_score)
    score_wait_seconds: float = 2.0
    # recserve learn's step on the embedding rows (row-wise Adagrad: each row's step is this over the
    # square root of its accumulated squared gradient); chosen by `recserve bench-loop --replay`
    learning_rate: float = 0.005
    # a publish is refused when the learner's log loss is above the served scores' by more than this,
    # and a published version is rolled back when it scores worse than the rows before it by more
    max_loss_increase: float = 0.02
    # and when its progressive AUC is below the served scores' by more than this (the first interval's
    # large first steps cost 0.01 to 0.03 of AUC and pay back after: bench-loop, docs/design/loop.md)
    max_auc_drop: float = 0.05
    watch_examples: int = 256  # a published version is judged on this many examples it served
    # the tables whose rows recserve learn trains (the others are served as they are); empty: all.
    # Name those whose ids drift (items, ads): a low-cardinality table's rows are in nearly every
    # example, each takes a full step per batch, and their steps add up in every example's logit
    train_tables: tuple[str, ...] = ()
    # recserve learn's Adagrad step on the dense network's weights, trained on the same batches as the
    # rows; 0: the network stays frozen (as served)
    dense_learning_rate: float = 0.0
    # the trained weights are published as a new dense version this often (a version folder written,
    # checked and loaded by the servers: slower than the rows' deltas)
    dense_publish_seconds: float = 300.0

    def check(self, tables: Iterable[str] = ()) -> None:
        """Raise :class:`SpecError` on a value out of range or a ``train_tables`` name not in ``tables``."""
        for name in ("window_seconds", "late_seconds", "commit_seconds"):
            value = getattr(self, name)
            if not 0.0 < value <= 30 * 86400.0 or math.isnan(value):
                raise SpecError(f"[loop] {name} lies in (0, 30 days], got {value}")
        if not 0.0 <= self.score_wait_seconds <= 600.0 or math.isnan(self.score_wait_seconds):
            raise SpecError(f"[loop] score_wait_seconds lies in [0, 600], got {self.score_wait_seconds}")
        if not 0.0 < self.negative_rate <= 1.0 or math.isnan(self.negative_rate):
            raise SpecError(f"[loop] negative_rate lies in (0, 1], got {self.negative_rate}")
        if not 0.0 < self.learning_rate <= 10.0 or math.isnan(self.learning_rate):
            raise SpecError(f"[loop] learning_rate lies in (0, 10], got {self.learning_rate}")
        if not 0.0 <= self.dense_learning_rate <= 10.0 or math.isnan(self.dense_learning_rate):
            raise SpecError(f"[loop] dense_learning_rate lies in [0, 10], got {self.dense_learning_rate}")
        if not 1.0 <= self.dense_publish_seconds <= 30 * 86400.0 or math.isnan(self.dense_publish_seconds):
            raise SpecError(
                f"[loop] dense_publish_seconds lies in [1, 30 days], got {self.dense_publish_seconds}"
            )
        if not 0.0 <= self.max_loss_increase <= 10.0 or math.isnan(self.max_loss_increase):
            raise SpecError(f"[loop] max_loss_increase lies in [0, 10], got {self.max_loss_increase}")
        if not 0.0 <= self.max_auc_drop <= 1.0 or math.isnan(self.max_auc_drop):
            raise SpecError(f"[loop] max_auc_drop lies in [0, 1], got {self.max_auc_drop}")
        if not 1 <= self.watch_examples <= 10_000_000:
            raise SpecError(f"[loop] watch_examples lies in 1..10000000, got {self.watch_examples}")
        if self.feedback not in FEEDBACK_SOURCES:
            raise SpecError(
                f"[loop] feedback must be one of {', '.join(FEEDBACK_SOURCES)}, got {self.feedback!r}"
            )
        if not 1 <= self.feedback_streams <= 1024:
            raise SpecError(f"[loop] feedback_streams lies in 1..1024, got {self.feedback_streams}")
        if not self.feedback_directory or not self.examples_directory:
            raise SpecError("[loop] feedback_directory and examples_directory must not be empty")
        if not self.feedback_prefix or any(c in self.feedback_prefix for c in "{} "):
            raise SpecError(
                f"[loop] feedback_prefix: non-empty, no braces or spaces, got {self.feedback_prefix!r}"
            )
        known = tuple(tables)
        unknown = [name for name in self.train_tables if name not in known]
        if unknown:
            raise SpecError(
                f"[loop] train_tables names {', '.join(map(repr, unknown))}, not a table of the spec "
                f"(its tables: {', '.join(known) or 'none'})"
            )
        if len(set(self.train_tables)) < len(self.train_tables):
            raise SpecError(f"[loop] train_tables names a table twice: {list(self.train_tables)}")
