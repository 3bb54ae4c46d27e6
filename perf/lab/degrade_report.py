"""The figures of ``recserve lab degrade``: per policy and phase, latency, value served and value retained.

Quality is measured as expected clicks: a caller shows the ``TOP_K`` candidates of a list with the
best scores, and the clicks it gets are the labels of those candidates. A request's quality
retained is the clicks of the scores it was served (none when refused) over the clicks of the
same list's full-compute scores; the value retained of a phase weighs each request by its value:
``sum(v x clicks served) / sum(v x clicks at full compute)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from recserve.perf.lab.degrade_traffic import FAILED, REFUSED, SERVED, Sent

#: The candidates a caller shows per list (whose labels are the clicks).
TOP_K = 8


def clicks(scores: np.ndarray, labels: np.ndarray, k: int = TOP_K) -> float:
    """The labels of the ``k`` best-scored candidates (ties: the caller's order)."""
    return float(labels[np.argsort(-scores, kind="stable")[:k]].sum())


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


@dataclass(frozen=True)
class PhaseFigures:
    """One policy's phase: counts, served p99 (and over the normal phase's), value shares and retained."""

    name: str
    rate: float
    sent: int
    served: int
    refused: int
    failed: int
    served_p99_ms: float
    p99_ratio: float
    value_full: float  # share of the phase's value served in full
    value_degraded: float  # ... at a cheaper level
    value_refused: float  # ... refused (or failed)
    value_retained: float
    top_decile_degraded: float  # share of the top value decile's requests served at a cheaper level
    top_decile_refused: float  # ... refused (or failed)

    def summary(self) -> dict[str, object]:
        """The figures as JSON-ready values (NaN as None), rounded."""

        def number(v: object) -> object:
            if isinstance(v, float):
                return None if np.isnan(v) else round(v, 4)
            return v

        return {k: number(v) for k, v in asdict(self).items()}


def phase_figures(
    name: str,
    rate: float,
    outcomes: list[Sent],
    full: list[np.ndarray],
    labels: list[np.ndarray],
    normal_p99_ms: float,
    top_value: float,
) -> PhaseFigures:
    """The figures of one phase's requests (``full``: each list's scores at full compute)."""
    served = [o for o in outcomes if o.result == SERVED]
    p99 = _p99([o.latency_ms for o in served])
    values = np.array([o.value for o in outcomes]) if outcomes else np.zeros(0)
    total = float(values.sum()) or 1.0
    full_level = sum(o.value for o in served if o.level == 0) / total
    degraded = sum(o.value for o in served if o.level > 0) / total
    kept = reference = 0.0
    for o in outcomes:
        reference += o.value * clicks(full[o.list_index], labels[o.list_index])
        if o.result == SERVED and o.scores is not None:
            kept += o.value * clicks(o.scores, labels[o.list_index])
    top = [o for o in outcomes if o.value >= top_value]
    return PhaseFigures(
        name,
        rate,
        len(outcomes),
        len(served),
        sum(o.result == REFUSED for o in outcomes),
        sum(o.result == FAILED for o in outcomes),
        p99,
        p99 / normal_p99_ms if normal_p99_ms > 0 else float("nan"),
        full_level,
        degraded,
        max(0.0, 1.0 - full_level - degraded),
        kept / reference if reference > 0 else float("nan"),
        sum(o.result == SERVED and o.level > 0 for o in top) / max(len(top), 1),
        sum(o.result != SERVED for o in top) / max(len(top), 1),
    )


def level_quality(outcomes: list[Sent], full: list[np.ndarray], labels: list[np.ndarray]) -> dict[int, dict]:
    """Per level served: requests, and the clicks of the scores served over those at full compute.

    What a level really keeps, to set its ``quality`` in the spec from (the spec's is a guess until
    measured): value-weighted as the phases' figures are.
    """
    out = {}
    for level in sorted({o.level for o in outcomes if o.result == SERVED}):
        at = [o for o in outcomes if o.result == SERVED and o.level == level and o.scores is not None]
        kept = sum(o.value * clicks(o.scores, labels[o.list_index]) for o in at if o.scores is not None)
        reference = sum(o.value * clicks(full[o.list_index], labels[o.list_index]) for o in at)
        out[level] = {"requests": len(at), "quality": round(kept / reference, 4) if reference > 0 else None}
    return out


def table(policies: dict[str, list[PhaseFigures]]) -> str:
    """A text table: one line per policy and phase."""
    head = (
        f"{'policy':8} {'phase':10} {'rate':>7} {'sent':>5} {'served':>6} {'refused':>7} {'failed':>6} "
        f"{'p99 ms':>7} {'x normal':>8} {'full':>5} {'degr.':>5} {'refu.':>5} {'kept':>5} {'top10 d/r':>9}"
    )
    lines = [head]
    for policy, phases in policies.items():
        for f in phases:
            lines.append(
                f"{policy:8} {f.name:10} {f.rate:7.1f} {f.sent:5d} {f.served:6d} {f.refused:7d} "
                f"{f.failed:6d} "
                f"{f.served_p99_ms:7.1f} {f.p99_ratio:8.2f} {f.value_full:5.2f} {f.value_degraded:5.2f} "
                f"{f.value_refused:5.2f} {f.value_retained:5.2f} "
                f"{f.top_decile_degraded:4.2f}/{f.top_decile_refused:4.2f}"
            )
    return "\n".join(lines)


def windows(outcomes: list[Sent], width_s: float = 0.25) -> list[list[float | None]]:
    """Per window of ``width_s`` (when requests left): start, served p99 ms, share full, degraded, refused.

    The p99 is None in a window that served nothing.
    """
    if not outcomes:
        return []
    out = []
    end = max(o.sent_s for o in outcomes)
    start = 0.0
    while start <= end:
        inside = [o for o in outcomes if start <= o.sent_s < start + width_s]
        if inside:
            served = [o for o in inside if o.result == SERVED]
            full = sum(o.level == 0 for o in served) / len(inside)
            degraded = sum(o.level > 0 for o in served) / len(inside)
            p99 = _p99([o.latency_ms for o in served])
            refused = 1.0 - full - degraded
            p99_ms = round(p99, 2) if served else None
            out.append([round(start, 3), p99_ms, round(full, 4), round(degraded, 4), round(refused, 4)])
        start += width_s
    return out
