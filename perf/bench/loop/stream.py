"""The bench's drifting stream: requests whose clicks a hidden ground-truth model makes, seeded.

Every row of a request is a synthetic row of the spec (its numeric values, categories and history,
from :func:`recserve.build.synthetic.generate`) with its target item replaced by one drawn from the
items alive at that time, by their popularity (and so is every other attention target over the
same table: the candidate is the query of each behaviour, a cart's as a view's). Each item's
appeal and popularity rise and fall on periods of their own (a few rounds), and new items (ids
never seen in training) appear every round with a launch boost to their popularity. The hidden
model clicks with probability ``sigmoid(bias + row_logit_j + appeal_i(t))``: ``row_logit_j`` is the
starting model's own logit of the pool row ``j`` (as drawn, with its own item), so the starting
model is right about the rows and blind to the drift; ``appeal_i(t)`` is item ``i``'s appeal now,
which rises and falls. A frozen model cannot follow it; a model that learns from the clicks can.

``t`` is the stream's time in rounds (round ``r`` covers ``[r, r + 1)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from recserve.build.synthetic import generate
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec

#: New items get ids from here on: far above every table's cardinality, so training never saw them.
NEW_ITEM_BASE = 10_000_000
#: The starting model's logit of a row, bounded to this (a confident model's 0s and 1s stay learnable).
LOGIT_BOUND = 4.0
#: The synthetic rows a request's rows are drawn from (their features; the item is replaced).
POOL_ROWS = 2048


@dataclass(frozen=True)
class StreamSettings:
    """The stream's shape: items alive at the start, new ones per round, the hidden model's scale."""

    items: int = 60
    new_items: int = 6  # items appearing at the start of each round after the first
    bias: float = 0.0  # added to the hidden model's logit (0: the starting model's calibration)
    appeal_spread: float = 1.0  # the standard deviation of an item's mean appeal
    appeal_swing: float = 1.2  # how far an item's appeal rises and falls around its mean (at most)
    popularity_swing: float = 1.5  # the same for the log of its popularity
    launch_boost: float = 3.0  # a new item's popularity, times this at its launch, fading over a round
    seed: int = 46


class DriftingStream:
    """Requests and their clicks over ``rounds`` rounds (see the module).

    Args:
        spec: the served spec (its target feature carries the item).
        rounds: how many rounds the stream lasts (new items appear at each round's start).
        settings: the stream's shape and seed.
        row_logits: the starting model's logits of rows (None: 0 for every row).
    """

    def __init__(
        self,
        spec: ModelSpec,
        rounds: int,
        settings: StreamSettings | None = None,
        row_logits: Callable[[Rows], np.ndarray] | None = None,
    ) -> None:
        if not spec.targets:
            raise ValueError(f"spec {spec.name!r} has no target item: the stream drifts by item")
        self.settings = s = settings or StreamSettings()
        rng = np.random.default_rng(s.seed)
        new = s.new_items * max(rounds - 1, 0)
        self.ids = np.concatenate([np.arange(1, s.items + 1), NEW_ITEM_BASE + np.arange(new)]).astype(
            np.int64
        )
        self.born = np.concatenate([np.zeros(s.items), 1 + np.arange(new) // max(s.new_items, 1)])
        count = len(self.ids)
        self.mean = rng.normal(0.0, s.appeal_spread, count)
        self.swing = rng.uniform(0.3, 1.0, count) * s.appeal_swing
        self.period = rng.uniform(2.0, 6.0, count)  # rounds
        self.phase = rng.uniform(0.0, 2 * np.pi, count)
        self.popularity_period = rng.uniform(2.0, 6.0, count)
        self.popularity_phase = rng.uniform(0.0, 2 * np.pi, count)
        self.pool = generate(spec, POOL_ROWS, seed=s.seed)
        logits = np.zeros(POOL_ROWS) if row_logits is None else np.asarray(row_logits(self.pool), np.float64)
        self.row_logits = np.clip(logits.reshape(-1), -LOGIT_BOUND, LOGIT_BOUND)
        self.rng = np.random.default_rng(s.seed + 1)
        first = spec.targets[0]
        self.also_candidate = tuple(  # the other targets that look up the same table as the first
            dict.fromkeys(t.name for t in spec.targets if t.name != first.name and t.table == first.table)
        )

    def appeal(self, t: float) -> np.ndarray:
        """Every item's appeal (its logit over the bias) at time ``t``."""
        return self.mean + self.swing * np.sin(2 * np.pi * t / self.period + self.phase)

    def popularity(self, t: float) -> np.ndarray:
        """The probability of each item being a request's row at time ``t`` (0 before it is born)."""
        s = self.settings
        age = t - self.born
        weight = np.exp(
            s.popularity_swing * np.sin(2 * np.pi * t / self.popularity_period + self.popularity_phase)
        )
        weight = weight * (1.0 + (s.launch_boost - 1.0) * np.exp(-np.maximum(age, 0.0)))
        weight[age < 0] = 0.0
        return weight / weight.sum()

    def click_probability(self, pool_rows: np.ndarray, items: np.ndarray, t: float) -> np.ndarray:
        """The hidden model's click probability of pool rows with items (indices into :attr:`ids`) at t."""
        logit = self.settings.bias + self.row_logits[pool_rows] + self.appeal(t)[items]
        return 1.0 / (1.0 + np.exp(-logit))

    def request(self, t: float, rows: int) -> tuple[Rows, np.ndarray, np.ndarray]:
        """One request of ``rows`` rows at time ``t``: the rows, their items (indices) and their clicks."""
        pool_rows = self.rng.integers(0, len(self.pool), rows)
        drawn = self.pool.take(pool_rows)
        items = self.rng.choice(len(self.ids), size=rows, p=self.popularity(t))
        clicks = self.rng.random(rows) < self.click_probability(pool_rows, items, t)
        candidate = self.ids[items]
        # the candidate is the query of every behaviour over its table (a cart's as a view's)
        side = {**drawn.side, **dict.fromkeys(self.also_candidate, candidate)}
        return replace(drawn, target=candidate.copy(), side=side, labels=None), items, clicks
