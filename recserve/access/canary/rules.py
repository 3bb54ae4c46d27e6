"""The canary's decision rules: compare the canary with stable, step through the stages, keep the decision.

Pure logic over :class:`~recserve.access.canary.figures.Window` figures and the spec's
:class:`~recserve.core.sections.serving.CanarySection`; the controller that reads the running stack and
puts each decision on the proxy is :mod:`~recserve.access.canary.controller`, which re-exports every
name here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recserve.access.canary.figures import Window, psi
from recserve.access.config import AccessError
from recserve.core.files import write_text_atomically
from recserve.core.sections.serving import AccessSection, CanarySection

STATE_FILE = "rules.json"
#: Weights are out of this total, so that a step of 0.5 % is still a whole number.
WEIGHT_TOTAL = 10_000
RUNNING, PROMOTED, ROLLED_BACK = "running", "promoted", "rolled_back"
#: Timed requests each side needs before p99s are compared (fewer make the p99 their maximum).
P99_MIN_REQUESTS = 100


# --- the comparison ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """One comparison of the canary with stable over the same window.

    Attributes:
        rollback: why the canary must go (empty: it may stay).
        judged: every comparison had enough requests and rows on both sides, and the canary
            served ``min_requests`` (the stage may end).
        figures: the compared figures (``error_rate_increase``, ``p99_ratio``, ``psi``,
            ``mean_ratio``), those measured; and, never compared, the client errors each side
            answered (``client_errors_stable``, ``client_errors_canary``).
        skipped: comparisons that could not be made (e.g. no score histogram exported).
    """

    rollback: str = ""
    judged: bool = False
    figures: Mapping[str, float] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()


def judge(rules: CanarySection, stable: Window, canary: Window) -> Verdict:
    """Compare ``canary`` with ``stable`` (both over the same window) against the thresholds.

    A comparison counts once each side has ``min_judged`` requests (timed requests for p99, at least
    :data:`P99_MIN_REQUESTS`; scored rows for the score checks). A failed comparison rolls back even
    while others still wait. Client errors are reported in the figures and judged by nothing.
    """
    figures = {
        "client_errors_stable": stable.client_errors,
        "client_errors_canary": canary.client_errors,
    }
    reasons, waiting, skipped = [], [], []
    need = rules.min_judged
    if min(stable.requests, canary.requests) >= need:
        figures["error_rate_increase"] = canary.error_rate - stable.error_rate
        if figures["error_rate_increase"] > rules.max_error_rate_increase:
            reasons.append(
                f"error rate {canary.error_rate:.3f} vs stable's {stable.error_rate:.3f} "
                f"(more than +{rules.max_error_rate_increase:g})"
            )
    else:
        waiting.append("requests")
    stable_p99, canary_p99 = stable.p99_ms(), canary.p99_ms()
    timed = min(stable.timed, canary.timed) >= max(need, P99_MIN_REQUESTS)
    if timed and stable_p99 is not None and canary_p99 is not None:
        figures["p99_ratio"] = canary_p99 / max(stable_p99, 1e-9)
        if figures["p99_ratio"] > rules.max_p99_ratio and canary_p99 - stable_p99 > rules.p99_slack_ms:
            reasons.append(
                f"p99 {canary_p99:.1f} ms vs stable's {stable_p99:.1f} ms (over {rules.max_p99_ratio:g}x)"
            )
    else:
        waiting.append("timed requests")
    if not stable.scores or not canary.scores:
        skipped.append("scores (no served-probability histogram exported)")
    elif sorted(stable.scores) != sorted(canary.scores):
        skipped.append("scores (the variants' histograms have different buckets)")
    elif min(stable.scored, canary.scored) >= need:
        figures["psi"] = psi(stable.score_shares(), canary.score_shares())
        stable_mean, canary_mean = stable.mean_score(), canary.mean_score()
        if stable_mean and canary_mean is not None:
            figures["mean_ratio"] = canary_mean / stable_mean
        if figures["psi"] > rules.max_psi:
            reasons.append(f"score distribution moved: PSI {figures['psi']:.3f} (over {rules.max_psi:g})")
        low, high = rules.mean_ratio
        ratio = figures.get("mean_ratio")
        if ratio is not None and not low <= ratio <= high:
            reasons.append(f"mean probability {ratio:.3f}x stable's (outside {low:g}..{high:g})")
    else:
        waiting.append("scored rows")
    if canary.requests < rules.min_requests:
        waiting.append("the stage's requests")
    return Verdict("; ".join(reasons), not waiting, figures, tuple(skipped))


# --- stages and the persisted decision ---------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One stage: the canary's live share (percent) and the mirrored share."""

    name: str
    percent: float
    shadow_fraction: float

    def weights(self) -> dict[str, int]:
        """Envoy weights of the two variants (out of :data:`WEIGHT_TOTAL`)."""
        canary = round(self.percent * WEIGHT_TOTAL / 100)
        return {"stable": WEIGHT_TOTAL - canary, "canary": canary}


def stages(rules: CanarySection) -> list[Stage]:
    """The shadow stage (when ``shadow_fraction`` > 0), then one stage per step."""
    shadow = [Stage("shadow", 0.0, rules.shadow_fraction)] if rules.shadow_fraction > 0 else []
    return shadow + [Stage(f"{step:g}%", step, 0.0) for step in rules.steps]


@dataclass(frozen=True)
class CanaryState:
    """The decision so far, as kept in :data:`STATE_FILE`.

    Attributes:
        status: ``running``, ``promoted`` or ``rolled_back``.
        stage: index into :func:`stages`.
        stage_started: when the stage began (Unix seconds).
        reason: why it was rolled back.
        events: every stage change and the final decision, oldest first.
    """

    status: str = RUNNING
    stage: int = 0
    stage_started: float = 0.0
    reason: str = ""
    events: tuple[dict[str, Any], ...] = ()

    def routing(self, rules: CanarySection) -> tuple[dict[str, int], float]:
        """The weights and the mirrored share this decision puts on the proxy."""
        if self.status == PROMOTED:
            return {"stable": 0, "canary": WEIGHT_TOTAL}, 0.0
        if self.status == ROLLED_BACK:
            return {"stable": WEIGHT_TOTAL, "canary": 0}, 0.0
        stage = stages(rules)[self.stage]
        return stage.weights(), stage.shadow_fraction

    def count(self, event: str) -> int:
        """How many events of this kind (``step``, ``rollback``, ``promote``) happened."""
        return sum(1 for e in self.events if e["event"] == event)

    def save(self, path: Path) -> None:
        """Write atomically (a reader never sees half a file)."""
        write_text_atomically(path, json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> CanaryState:
        """Read a saved decision.

        Raises:
            AccessError: the file is not a canary state.
        """
        try:
            raw = json.loads(path.read_text())
            return cls(
                str(raw["status"]),
                int(raw["stage"]),
                float(raw["stage_started"]),
                str(raw.get("reason", "")),
                tuple(raw.get("events", ())),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise AccessError(f"{path} is not a canary state: {exc}") from exc


def decide(rules: CanarySection, state: CanaryState, verdict: Verdict, now: float) -> CanaryState:
    """The next decision: roll back, advance (or promote after the last stage), or stay."""
    if state.status != RUNNING:
        return state
    plan = stages(rules)
    stage = plan[state.stage]
    record = {"time": now, "stage": stage.name, "after_s": round(now - state.stage_started, 3)}
    record["figures"] = {k: round(v, 4) for k, v in verdict.figures.items()}
    if verdict.rollback:
        event = {"event": "rollback", "reason": verdict.rollback, **record}
        return dataclasses.replace(
            state, status=ROLLED_BACK, reason=verdict.rollback, events=(*state.events, event)
        )
    if verdict.judged and now - state.stage_started >= rules.dwell_s:
        if state.stage + 1 == len(plan):
            return dataclasses.replace(
                state, status=PROMOTED, events=(*state.events, {"event": "promote", **record})
            )
        event = {"event": "step", "to": plan[state.stage + 1].name, **record}
        return dataclasses.replace(
            state, stage=state.stage + 1, stage_started=now, events=(*state.events, event)
        )
    return state


def routed(access: AccessSection, workdir: Path) -> AccessSection:
    """``access`` with the weights and mirrored share of a canary decision saved in ``workdir``.

    This is how a restarted proxy keeps the decision. Without a saved decision: ``access`` as is.
    """
    path = workdir / STATE_FILE
    if not path.is_file():
        return access
    weights, shadow = CanaryState.load(path).routing(access.canary)
    return dataclasses.replace(
        access, weights={**access.weights, **weights}, shadow_fraction=shadow, shadow_variant="canary"
    )
