"""The degradation controller: which level serves a request, and lambda following the load.

Each level ``l`` (0: full, then the spec's ``[[degrade.levels]]``, last the refusal) has a cost
``c_l`` and a quality ``q_l`` against the full level's (1, 1; the refusal's are 0, 0). A request of
value ``v`` (in the units of ``[degrade.tiers]``; lambda in value per unit of cost) is served at
the level that maximises ``v x q_l - lambda x c_l``: at ``lambda = 0`` every request is served in
full; as lambda grows the lowest values move to cheaper levels first, and are refused last (DCAF's
choice of how much to compute per request). Lambda follows the load through a multiplicative
feedback loop: every ``[degrade] interval_s`` the steps' mean queue wait ``w`` is compared with
``target_queue_ms`` and ``lambda *= exp(gain x (w / target - 1))`` (the rise bounded per update and
held while the wait is already falling, the fall ``FALL`` times as steep);
below a floor lambda is 0, and it never passes ``[degrade] max_lambda``.

Plain Python, without Triton: the first step's adapter feeds it the measured wait
(recserve.backends.steps.queue_wait) and asks it for each request's level.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

from recserve.core.sections.degrade import DegradeSection

#: Below this lambda is 0: every request is served in full.
LAMBDA_FLOOR = 1e-3
#: The most lambda grows in one update (``exp(gain x MAX_EXCESS)``): a burst moves it by steps.
MAX_EXCESS = 6.0
#: Lambda falls this many times faster than it rises: once the queue is drained, the requests after a
#: spike are served in full again within a few updates.
FALL = 4.0
#: A wait under this share of the previous one is draining: lambda is held, not raised.
DRAINING = 0.9


class DegradeController:
    """Chooses each request's level; lambda is updated from the measured queue wait.

    Thread-safe: the wait arrives from a background thread, levels are asked for on the request path.

    Args:
        section: the spec's ``[degrade]`` (its ``fixed_lambda``, when >= 0, holds lambda there).
    """

    def __init__(self, section: DegradeSection) -> None:
        self.section = section
        levels = section.levels
        self.costs = (1.0, *(level.cost for level in levels), *((0.0,) if section.refuse else ()))
        self.qualities = (1.0, *(level.quality for level in levels), *((0.0,) if section.refuse else ()))
        self.fixed = section.fixed_lambda >= 0
        self._lambda = max(section.fixed_lambda, 0.0)
        self.load = 0.0  # the latest wait over the target
        self._lock = threading.Lock()

    @property
    def lam(self) -> float:
        """The current lambda (value per unit of cost a level must earn)."""
        return self._lambda

    @property
    def refused_level(self) -> int | None:
        """The refusal's level number (the last), or None where the spec never refuses."""
        return len(self.costs) - 1 if self.section.refuse else None

    def update(self, wait_ms: float | None) -> float:
        """Lambda after one measurement of the expected queue wait (None: idle, no load).

        Over the target lambda rises, unless the wait is already falling (by a tenth or more since the
        last measurement): the requests queued before lambda rose are still being drained, and
        raising it further would refuse what the steps can now serve (the overshoot of a loop whose
        measurement lags).
        """
        load = 0.0 if wait_ms is None else max(wait_ms, 0.0) / self.section.target_queue_ms
        with self._lock:
            previous, self.load = self.load, load
            if self.fixed:
                return self._lambda
            lam = self._lambda
            if load > 1.0 and load >= DRAINING * previous:
                lam = max(lam, LAMBDA_FLOOR) * math.exp(self.section.gain * min(load - 1.0, MAX_EXCESS))
            elif load > 1.0:  # over the target but draining: held
                pass
            else:
                lam *= math.exp(self.section.gain * FALL * (load - 1.0))
            self._lambda = 0.0 if lam < LAMBDA_FLOOR else min(lam, self.section.max_lambda)
            return self._lambda

    def level(self, value: float) -> int:
        """The level serving a request of ``value``: best ``v x quality - lambda x cost`` (ties: fuller)."""
        lam = self._lambda
        if lam == 0.0:
            return 0
        gains = [value * q - lam * c for q, c in zip(self.qualities, self.costs, strict=True)]
        best = max(gains)
        return gains.index(best)

    def levels(self, values: Sequence[float]) -> list[int]:
        """:meth:`level` of each value."""
        return [self.level(v) for v in values]
