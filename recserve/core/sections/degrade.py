"""``[degrade]``: value-aware degradation, the cheaper ways to serve a request and how one is chosen.

Off by default: without the section (or with ``enabled = false``) nothing changes, no config gains a
tensor and every request is served in full. On, each request carries a value (the ``recserve-value``
header or request parameter: a number, or a tier name of ``[degrade.tiers]``; without one it is
``default``'s), and the first step serves it at one of the levels: ``full`` (level 0), the cheaper
``[[degrade.levels]]`` in order (1, 2, ...), and last ``refused`` (UNAVAILABLE). A level caps the
candidates scored per list (the caller's order is its prior: the first ``max_candidates`` are scored,
the rest get ``fallback_score``), the history (its newest ``history_length`` items) and, with
``small_dense``, the network: a smaller one of ``[degrade.small_dense]``'s sizes, distilled from the
full one by ``recserve build`` and served beside it (recserve.build.distill). The level
is chosen by the controller (recserve.backends.steps.degrade_control), which maximises
``value x quality - lambda x cost`` with lambda following the steps' queue wait against
``target_queue_ms``. With ``priority_value``, the requests worth most are also batched first (Triton
priority levels in both steps). See docs/design/degrade.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from recserve.core.sections.base import SpecError
from recserve.core.sections.serving import DenseNetSection
from recserve.errors import InvalidParameter, shorten

#: The request header (gRPC metadata key) and request parameter carrying a request's value.
VALUE_HEADER = "recserve-value"
#: The header the access layer's door sets on a request it lets through: the lambda it chose the
#: request's level at (recserve.access.value_door); the first step serves it at that lambda at least.
#: Only the door sets it: the proxy removes one a caller sent.
LAMBDA_HEADER = "recserve-lambda"
#: The header on which the door reports the requests it refused since the last one it let through (on
#: that Envoy worker), by value tier: ``tier:count,...``; the first step counts them as refused.
REFUSED_HEADER = "recserve-door-refused"
#: The same report of the requests the door sent to the caller's-order model (a level with
#: ``caller_order``) since the last one it let through; the first step counts them at that level.
ORDERED_HEADER = "recserve-door-ordered"
#: The model answering a level with ``caller_order`` in front of an ensemble: ``<ensemble>`` + this.
CALLER_ORDER_SUFFIX = "__caller_order"
#: The tier columns of the counts beside the spec's tiers: a request that gave a number, and one that
#: gave no value (the default's).
NUMBER_TIER = "number"
DEFAULT_TIER = "default"
#: The most refusals one report may carry, and a count's form (ASCII digits, no more than it has).
MAX_REPORTED = 1_000_000
_COUNT = re.compile(f"[0-9]{{1,{len(str(MAX_REPORTED))}}}")
#: The smallest lambda a door chooses (below it every request is served in full), and how many
#: lambdas it chooses among, spaced geometrically up to ``max_lambda``.
LAMBDA_FLOOR = 1e-3
LAMBDA_STEPS = 64
#: A door's window of arrivals, in seconds: the rate it holds against the capacity.
WINDOW_S = 0.05
#: The served level of every response, ``[rows or users, 1]`` INT32 (0: full).
DEGRADE_LEVEL = "degrade_level"
#: ``dense``'s input in the candidates ensemble with ``[degrade]`` on: the list's targets as the
#: caller sent them, ``[users, candidates, 1]``, so a list scored only in part is answered in full.
REQUESTED_CANDIDATES = "requested_candidates"
#: The environment variable holding the server's metrics endpoint (``http://host:port/metrics``), set
#: by ``TritonServer`` for its steps: the first step reads the queue wait there.
METRICS_URL_ENV = "RECSERVE_METRICS_URL"
#: The names of the levels around the spec's own: the first and the last.
FULL = "full"
REFUSED = "refused"


def value_text(value: float | str) -> str:
    """A request's value as its header carries it: a tier name, or a number >= 0.

    Raises:
        ValueError: neither a tier-like name (an identifier) nor a finite number >= 0.
    """
    if isinstance(value, str) and value.isidentifier():
        return value
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return repr(float(value))
    raise ValueError(f"value must be a tier name or a number >= 0, got {shorten(value)}")


@dataclass(frozen=True)
class DegradeLevel:
    """One ``[[degrade.levels]]`` entry: a cheaper way to serve, its cost and quality against full.

    ``cost`` and ``quality`` are fractions of the full level's (compute spent, value retained).
    """

    name: str
    cost: float
    quality: float
    max_candidates: int = 0  # candidates scored per list (0: all)
    history_length: int = 0  # history items kept, the newest (0: all); one of the sequence buckets
    small_dense: bool = False  # scored by the smaller network of [degrade.small_dense]
    # answered by the access layer's door with the caller's order (every candidate fallback_score)
    # from a one-step model beside the ensemble: no feature, lookup nor network runs. The last level;
    # the steps never choose it (a request that reached them is past it)
    caller_order: bool = False


@dataclass(frozen=True)
class DegradeSection:
    """``[degrade]``: the tiers, the default value, the levels and the controller's target."""

    enabled: bool = False
    # tier name -> value; a request names a tier or gives a number
    tiers: dict[str, float] = field(default_factory=dict)
    default: str = ""  # the value of a request without one: a tier name or a number ("": 1.0)
    levels: tuple[DegradeLevel, ...] = ()
    refuse: bool = True  # the last level: refusal (false: the cheapest level serves everything)
    # what a refusal at the first step still costs, of the full level's compute (the request is
    # received, queued and answered): measure it (recserve lab degrade --costs)
    refuse_cost: float = 0.0
    # > 0: a request worth at least this is always served in full (never degraded nor refused by
    # the controller): the traffic that must not be touched, whatever degrading it would save
    full_value: float = 0.0
    fallback_score: float = 0.0  # the score of a candidate past a level's cap
    target_queue_ms: float = 5.0  # lambda rises while the steps' expected queue wait is above this
    interval_s: float = 0.25  # how often lambda is updated from the measured queue wait
    gain: float = 0.5  # lambda's step per update: lambda *= exp(gain x (load - 1)), load = wait / target
    fixed_lambda: float = -1.0  # >= 0: lambda held there, no feedback (a drill; tests); < 0: feedback
    # lambda's ceiling, in value per unit of cost (past the top values, everything is refused)
    max_lambda: float = 100.0
    # the share of the measured capacity the door lets a spike's arrivals cost: lower keeps the
    # steps' queues shorter through a spike, and degrades and refuses more
    headroom: float = 0.9
    # > 0: the full-cost requests per second the server is known to serve (measured in advance: a
    # list is a request), so the door holds a spike from its first batch; 0: learned from the first
    # backlog and kept for the next run (only a repository's first run meets its first spike with the
    # queue-wait loop alone). Learning goes on
    capacity: float = 0.0
    # > 0: the steps' batchers get two priority levels, and a request worth at least this is sent
    # at the first (the SDK sets it): it is batched ahead of the others; 0: one level, as before.
    # On tritonserver 2.51 priority levels stall the batcher (docs/design/degrade.md): leave it 0
    priority_value: float = 0.0
    # the sizes of the smaller network a level with ``small_dense`` is scored by ([dense_net]'s keys;
    # distilled from the full network by recserve build, served beside it); None: no such network
    small_dense: DenseNetSection | None = None

    @property
    def small_levels(self) -> frozenset[int]:
        """The numbers of the levels scored by the smaller network (1 is the first cheaper level)."""
        if not self.enabled:
            return frozenset()
        return frozenset(i for i, level in enumerate(self.levels, start=1) if level.small_dense)

    @property
    def order_level(self) -> int | None:
        """The number of the level answered in the caller's order (the last spec level), or None."""
        if self.enabled and self.levels and self.levels[-1].caller_order:
            return len(self.levels)
        return None

    @property
    def level_names(self) -> tuple[str, ...]:
        """Every level's name by number: ``full``, the spec's, and ``refused`` where it refuses."""
        return (FULL, *(level.name for level in self.levels), *((REFUSED,) if self.refuse else ()))

    @property
    def tier_columns(self) -> tuple[str, ...]:
        """The tiers requests are counted by: the spec's, :data:`NUMBER_TIER` and :data:`DEFAULT_TIER`."""
        return (*self.tiers, NUMBER_TIER, DEFAULT_TIER)

    @property
    def costs(self) -> tuple[float, ...]:
        """Each level's cost by number: full (1), the spec's, the refusal's (``refuse_cost``) if any."""
        return (1.0, *(level.cost for level in self.levels), *((self.refuse_cost,) if self.refuse else ()))

    @property
    def qualities(self) -> tuple[float, ...]:
        """Each level's quality by number: full (1), the spec's, the refusal's (0) where it refuses."""
        return (1.0, *(level.quality for level in self.levels), *((0.0,) if self.refuse else ()))

    @property
    def lambda_grid(self) -> tuple[float, ...]:
        """The lambdas a door chooses among: from :data:`LAMBDA_FLOOR` x ``max_lambda`` to ``max_lambda``."""
        last = LAMBDA_STEPS - 1
        return tuple(self.max_lambda * LAMBDA_FLOOR ** ((last - k) / last) for k in range(LAMBDA_STEPS))

    def lambda_of(self, raw: object) -> float:
        """The lambda a request's :data:`LAMBDA_HEADER` names (absent: 0), at most ``max_lambda``.

        Raises:
            InvalidParameter: not a finite number >= 0.
        """
        if raw is None or raw == "":
            return 0.0
        number = math.nan
        if isinstance(raw, str | int | float) and not isinstance(raw, bool):
            try:
                number = float(raw)
            except ValueError:
                pass
        if not math.isfinite(number) or number < 0:
            raise InvalidParameter(LAMBDA_HEADER, f"must be a number >= 0, got {shorten(raw)}")
        return min(number, self.max_lambda)

    def door_counts(self, raw: object, header: str = REFUSED_HEADER) -> dict[str, int]:
        """The door's refusals (or caller's-order answers) a request reports in ``header``, by tier column.

        Absent: none.

        Raises:
            InvalidParameter: not ``tier:count`` pairs of known tier columns and counts in 1..1e6.
        """
        if raw is None or raw == "":
            return {}
        columns = set(self.tier_columns)
        pairs = [pair.partition(":") for pair in str(raw)[:4096].split(",")]
        if len(pairs) > len(columns) or any(
            tier not in columns or not _COUNT.fullmatch(count) or not 0 < int(count) <= MAX_REPORTED
            for tier, _, count in pairs
        ):
            raise InvalidParameter(header, f"must be tier:count pairs, got {shorten(raw)}")
        found: dict[str, int] = {}
        for tier, _, count in pairs:
            found[tier] = found.get(tier, 0) + int(count)
        return found

    @property
    def default_value(self) -> float:
        """The value of a request that carries none."""
        return self.value_of(self.default) if self.default else 1.0

    def value_of(self, raw: object) -> float:
        """A request's value from its header or parameter: a tier name or a non-negative number.

        Raises:
            InvalidParameter: neither a tier name nor a finite number >= 0.
        """
        if raw is None or raw == "":
            return self.default_value
        if isinstance(raw, str):
            if raw in self.tiers:
                return self.tiers[raw]
            try:
                number = float(raw)
            except ValueError:
                number = math.nan
        elif isinstance(raw, int | float) and not isinstance(raw, bool):
            number = float(raw)
        else:
            number = math.nan
        if not math.isfinite(number) or number < 0:
            tiers = f"one of the tiers {', '.join(self.tiers)} or " if self.tiers else ""
            raise InvalidParameter(VALUE_HEADER, f"must be {tiers}a number >= 0, got {shorten(raw)}")
        return number

    def priority_of(self, raw: object) -> int:
        """The Triton priority a request of value ``raw`` is sent at: 1 (first) or 2; 0 (the default) off.

        A value the server would refuse gets 0: the server names what is wrong with it.
        """
        if not self.enabled or self.priority_value <= 0:
            return 0
        try:
            return 1 if self.value_of(raw) >= self.priority_value else 2
        except InvalidParameter:
            return 0

    def value_from(self, parameters: Mapping[str, object]) -> float:
        """The value named by a request's parameters (Triton's ``request.parameters()``, parsed)."""
        return self.value_of(parameters.get(VALUE_HEADER))

    def check(self, sequence_buckets: tuple[int, ...]) -> None:
        """Raise :class:`SpecError` on a value out of range, a level out of order or an unknown tier."""
        if not self.enabled:
            return
        for name, value in self.tiers.items():
            if not name.isidentifier() or not math.isfinite(value) or value < 0:
                raise SpecError(
                    f"[degrade.tiers] {name!r} needs an identifier name and a value >= 0, got {value}"
                )
        if self.default:
            try:
                self.value_of(self.default)
            except InvalidParameter as exc:
                raise SpecError(f"[degrade] default {self.default!r}: {exc.detail}") from None
        names = [level.name for level in self.levels]
        if len(set(names)) != len(names) or {FULL, REFUSED} & set(names):
            raise SpecError(
                f"[degrade.levels] need distinct names other than {FULL!r} and {REFUSED!r}: {names}"
            )
        previous_cost, previous_quality = 1.0, 1.0
        for level in self.levels:
            where = f"[degrade.levels] {level.name!r}"
            if not 0.0 < level.cost < previous_cost or not 0.0 < level.quality <= previous_quality:
                raise SpecError(
                    f"{where}: each level costs less than the one before (full: 1) and keeps at most its "
                    f"quality, both above 0; got cost {level.cost}, quality {level.quality}"
                )
            if level.max_candidates < 0 or (
                level.history_length and level.history_length not in sequence_buckets
            ):
                raise SpecError(
                    f"{where}: max_candidates >= 0 (0: all) and history_length 0 (all) or one of the "
                    f"sequence buckets {list(sequence_buckets)}, "
                    f"got {level.max_candidates}, {level.history_length}"
                )
            scores = level.max_candidates or level.history_length or level.small_dense
            if level.caller_order and (level is not self.levels[-1] or scores):
                raise SpecError(
                    f"{where}: caller_order is the last level, and scores nothing (no max_candidates, "
                    "history_length nor small_dense)"
                )
            if level.small_dense and self.small_dense is None:
                raise SpecError(f"{where}: small_dense needs the network's sizes in [degrade.small_dense]")
            previous_cost, previous_quality = level.cost, level.quality
        cheapest = self.levels[-1].cost if self.levels else 1.0
        if not 0.0 <= self.refuse_cost < cheapest or not 0.0 <= self.full_value < math.inf:
            raise SpecError(
                f"[degrade] refuse_cost must be >= 0 and under the cheapest level's cost ({cheapest}), "
                f"full_value >= 0 and finite; got {self.refuse_cost}, {self.full_value}"
            )
        if not self.levels and not self.refuse:
            raise SpecError("[degrade] needs levels or refuse = true: there is nothing cheaper to serve")
        if not 0.0 < self.headroom <= 1.0:
            raise SpecError(f"[degrade] headroom lies in (0, 1], got {self.headroom}")
        if not 0.0 <= self.capacity <= 1e9 or math.isnan(self.capacity):
            raise SpecError(f"[degrade] capacity lies in [0, 1e9] requests per second, got {self.capacity}")
        positive = (self.target_queue_ms, self.interval_s, self.gain, self.max_lambda)
        finite = all(math.isfinite(x) for x in (self.fallback_score, self.fixed_lambda, self.priority_value))
        if not all(math.isfinite(x) and x > 0 for x in positive) or not finite:
            raise SpecError(
                "[degrade] target_queue_ms, interval_s, gain and max_lambda must be > 0, fallback_score, "
                f"fixed_lambda and priority_value finite, got {self.target_queue_ms}, {self.interval_s}, "
                f"{self.gain}, {self.max_lambda}, {self.fallback_score}, {self.fixed_lambda}, "
                f"{self.priority_value}"
            )
