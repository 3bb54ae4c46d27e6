"""The degradation controller: which level serves a request, and lambda following the load.

Each level ``l`` (0: full, then the spec's ``[[degrade.levels]]``, last the refusal) has a cost
``c_l`` and a quality ``q_l`` against the full level's (1, 1; the refusal's quality is 0, its cost
``[degrade] refuse_cost``: what refusing at the first step still spends). A request of value ``v``
(in the units of ``[degrade.tiers]``; lambda in value per unit of cost) is served at the level that
maximises ``v x q_l - lambda x c_l``, unless it is worth at least ``full_value`` (then always in
full): at ``lambda = 0`` every request is served in full; as lambda grows the lowest values move to
cheaper levels first, and are refused last (DCAF's choice of how much to compute per request).

Lambda is set at the first step's door, at every batch, from the arrivals it sees
(:meth:`DegradeController.arrived`): the values of the requests that reached it in the last
``WINDOW_S`` against the capacity the steps showed (:meth:`DegradeController.capacity`). It is the
smallest lambda at which what those arrivals would cost, each at the level lambda gives it, fits
``[degrade] headroom`` of that capacity: so it follows a change of rate within a batch or two, falls back as
soon as the arrivals do, and between the two spends the capacity on the highest values per unit of
cost. The capacity is learned from tritonserver's counters, read every ``[degrade] interval_s``
(recserve.backends.steps.queue_wait): the cost the steps served per second while a backlog kept
them busy; without a backlog it is at least what they served, and it is probed upwards while the
door held arrivals back.

Until a backlog has shown the capacity, lambda follows the steps' expected queue wait ``w`` from
the same readings through a multiplicative feedback loop: ``lambda *= exp(gain x (w / target -
1))`` against ``target_queue_ms`` (the rise bounded per update and held while the wait is already
falling, the fall ``FALL`` times as steep); below a floor lambda is 0, and it never passes
``[degrade] max_lambda``.

Plain Python, without Triton: the first step's adapter feeds it the readings and each batch's
values and asks it for each request's level; times are passed in, so tests run on a synthetic clock.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

from recserve.core.sections.degrade import LAMBDA_FLOOR, WINDOW_S, DegradeSection

#: The most lambda grows in one update (``exp(gain x MAX_EXCESS)``): a burst moves it by steps.
MAX_EXCESS = 6.0
#: Lambda falls this many times faster than it rises: once the queue is drained, the requests after a
#: spike are served in full again within a few updates.
FALL = 4.0
#: A wait under this share of the previous one is draining: lambda is held, not raised.
DRAINING = 0.9
#: Without a backlog the capacity is at least what the steps served over this share.
HEADROOM = 0.9
#: A capacity reading's weight against the ones before (an exponential average).
CAPACITY_WEIGHT = 0.5
#: While the door's floor held arrivals back and no backlog formed, the capacity may be more than
#: measured: it is raised by this factor per reading until a backlog says where it is.
PROBE = 1.1


class ArrivalRate:
    """The values of the requests that reached the door in the last ``window_s`` seconds."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, float]] = deque()

    def add(self, now: float, values: Sequence[float]) -> np.ndarray:
        """Record a batch's values at ``now``; the values seen within the window, this batch's included."""
        self._seen.extend((now, v) for v in values)
        while self._seen and self._seen[0][0] < now - self.window_s:
            self._seen.popleft()
        return np.fromiter((v for _, v in self._seen), float, len(self._seen))


class DegradeController:
    """Chooses each request's level; lambda follows the arrivals against the capacity (or the queue wait).

    Thread-safe: the wait arrives from a background thread, levels are asked for on the request path.

    Args:
        section: the spec's ``[degrade]`` (its ``fixed_lambda``, when >= 0, holds lambda there).
        at_steps: the steps' controller, which never chooses the level answered in the caller's
            order (``caller_order``: the access layer's door sends requests there; one that reached
            the steps is past it); False: every level, as the door chooses.
    """

    def __init__(self, section: DegradeSection, at_steps: bool = True) -> None:
        self.section = section
        #: each level's cost and quality, by level number (arrays: the choice is made on whole batches)
        self.costs = np.array(section.costs)
        self.qualities = np.array(section.qualities)
        #: what choosing each level loses beyond its cost: -inf where the steps cannot serve it
        self.excluded = np.zeros(len(self.costs))
        if at_steps and section.order_level is not None:
            self.excluded[section.order_level] = -np.inf
        self.grid = np.array(section.lambda_grid)  # the lambdas the door's floor is chosen among
        self.fixed = section.fixed_lambda >= 0
        self._lambda = max(section.fixed_lambda, 0.0)
        self.load = 0.0  # the latest wait over the target
        # full-cost requests the steps serve per second (inf: not known yet); [degrade] capacity: known
        self.capacity_per_s = section.capacity if section.capacity > 0 else math.inf
        self.floor = 0.0  # the door's floor under lambda, from the latest batch's arrivals
        self.arrivals = ArrivalRate()
        self._passed_cost = 0.0  # cost spent at the door's choices since the last capacity reading
        self._passed = 0  # requests let through (not refused) since then
        self._limited = False  # the door's floor held arrivals back since the last capacity reading
        self._lock = threading.Lock()

    @property
    def lam(self) -> float:
        """The current lambda (value per unit of cost a level must earn).

        The door's floor, or the loop's where a backlog still holds it higher.
        """
        return max(self._lambda, self.floor)

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

    def capacity(self, served_per_s: float, busy: bool) -> float:
        """The capacity after one reading: ``served_per_s`` requests finished per second by the steps.

        ``busy``: a backlog kept the steps busy through the reading, so what they served is what they
        can serve: in full-cost requests, their rate times the cost spent per request let through
        since the last reading, refusals' included (the average over busy readings). Without a
        backlog what they served fitted: the capacity is at least that over ``HEADROOM`` (so the
        floor never holds back a rate that was just served without a backlog); and where the door's
        floor held arrivals back meanwhile, the capacity is probed upwards (``PROBE``), so that a low
        reading (taken as lambda rose, or a slow start) does not hold it low.
        """
        with self._lock:
            mean_cost = self._passed_cost / self._passed if self._passed else 1.0
            limited, self._passed_cost, self._passed, self._limited = self._limited, 0.0, 0, False
            measured = served_per_s * mean_cost
            known = self.capacity_per_s
            if busy and measured > 0:
                self.capacity_per_s = (
                    measured if math.isinf(known) else known + CAPACITY_WEIGHT * (measured - known)
                )
            elif not math.isinf(known):
                self.capacity_per_s = max(known * PROBE if limited else known, measured / HEADROOM)
            return self.capacity_per_s

    def arrived(self, now: float, values: Sequence[float]) -> float:
        """The door's floor under lambda after a batch of ``values`` reached it at ``now``.

        The smallest lambda of a grid up to ``max_lambda`` at which the window's arrivals, each at the
        level that lambda gives it, cost at most ``headroom`` of the capacity per second (0 while the
        capacity is not known or they fit in full; ``max_lambda`` when nothing on the grid fits).
        """
        window = self.arrivals.add(now, values)
        budget = self.section.headroom * self.capacity_per_s * self.arrivals.window_s
        if self.fixed or len(window) <= budget:  # every one in full costs 1: it fits
            self.floor = 0.0
            return 0.0
        chosen = self._chosen(window[:, None], self.grid[None, :])  # per value and lambda of the grid
        spent = self.costs[chosen].sum(axis=0)
        fits = np.flatnonzero(spent <= budget)
        self.floor = float(self.grid[fits[0]]) if len(fits) else float(self.grid[-1])
        self._limited = True
        return self.floor

    def level(self, value: float) -> int:
        """The level serving a request of ``value`` (see :meth:`levels`)."""
        return self.levels([value])[0]

    def levels(self, values: Sequence[float], floors: Sequence[float] | None = None) -> list[int]:
        """The level serving each of ``values``: best ``v x quality - lambda x cost`` (ties: fuller).

        ``floors``: each request's lambda at least (the access layer's door chose its level at it:
        :data:`~recserve.core.sections.degrade.LAMBDA_HEADER`); None: none. What they cost (a
        refusal's too: the compute it took is not served) and how many pass are counted for the
        capacity's next reading.
        """
        lams = np.full(len(values), self.lam) if floors is None else np.maximum(self.lam, floors)
        refused = self.refused_level
        if not lams.any():  # normal load: everything in full, without the arithmetic
            chosen = np.zeros(len(values), np.intp)
        else:
            chosen = self._chosen(np.asarray(values, np.float64), lams)
        with self._lock:
            self._passed_cost += float(self.costs[chosen].sum())
            self._passed += len(chosen) if refused is None else int((chosen != refused).sum())
        return chosen.tolist()

    def _chosen(self, values: np.ndarray, lams: np.ndarray) -> np.ndarray:
        """Each value's level at its lambda (the two broadcast together), the one rule of :meth:`levels`.

        The best ``v x quality - lambda x cost``, ties to the fuller level (at lambda 0, full); a
        value of at least ``full_value`` (when set) always full.
        """
        gains = values[..., None] * self.qualities - lams[..., None] * self.costs + self.excluded
        chosen = gains.argmax(axis=-1)
        if self.section.full_value > 0:
            chosen[np.broadcast_to(values >= self.section.full_value, chosen.shape)] = 0
        return chosen
