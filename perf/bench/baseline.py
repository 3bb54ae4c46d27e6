"""The regression guard: a bench run's ratios against a committed baseline of three runs.

``perf/baseline.json`` holds, per headline ratio of ``recserve bench --quick``, the median of three
runs and their spread (half the range), made by ``recserve bench --make-baseline RUN RUN RUN``. A
later run is compared with ``recserve bench --compare perf/baseline.json``: a ratio is a regression
when it is worse than the baseline's median by more than the baseline's spread plus the run's own
tolerance (the larger of :data:`MIN_TOLERANCE` and the spread), in the ratio's own direction (its
target in :data:`~recserve.perf.bench.report.TARGETS`: higher is better for ``>=``, lower for ``<=``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recserve.perf.bench.report import TARGETS

#: Every comparison allows at least this relative slack (run-to-run noise of a 2-core machine).
MIN_TOLERANCE = 0.03
#: The baseline file's format version.
FORMAT = 1


@dataclass(frozen=True)
class Regression:
    """One ratio worse than its baseline by more than the noise."""

    ratio: str
    baseline: float
    value: float
    allowed: float  # the worst value still within the noise

    def describe(self) -> str:
        """One line for the report."""
        return (
            f"{self.ratio}: {self.value:.3f}, baseline {self.baseline:.3f} "
            f"(worse than {self.allowed:.3f} is a regression)"
        )


def ratios(summary: Mapping[str, Any]) -> dict[str, float]:
    """The headline ratios a run's ``summary.json`` holds (those with a target), by name."""
    return {
        name: float(summary[name])
        for name in TARGETS
        if isinstance(summary.get(name), int | float) and summary[name] == summary[name]
    }


def make_baseline(summaries: Sequence[Mapping[str, Any]], runs: Sequence[str]) -> dict[str, Any]:
    """The baseline of several runs' summaries: per ratio, its median, spread and values.

    Raises:
        ValueError: fewer than three runs (a median of one or two runs says nothing of the noise).
    """
    if len(summaries) < 3:
        raise ValueError(f"a baseline takes the median of at least three runs, got {len(summaries)}")
    values: dict[str, list[float]] = {}
    for summary in summaries:
        for name, value in ratios(summary).items():
            values.setdefault(name, []).append(value)
    return {
        "format": FORMAT,
        "runs": list(runs),
        "ratios": {
            name: {
                "median": statistics.median(found),
                "spread": (max(found) - min(found)) / 2,
                "values": found,
                "better": "higher" if TARGETS[name][0] == ">=" else "lower",
            }
            for name, found in sorted(values.items())
            if len(found) == len(summaries)
        },
    }


def compare(summary: Mapping[str, Any], baseline: Mapping[str, Any]) -> list[Regression]:
    """The ratios of ``summary`` worse than ``baseline`` by more than their spread and tolerance.

    A ratio the run does not have (e.g. TorchServe skipped) is not compared.
    """
    found = ratios(summary)
    regressions = []
    for name, entry in baseline["ratios"].items():
        if name not in found:
            continue
        median, spread = float(entry["median"]), float(entry["spread"])
        slack = spread + max(MIN_TOLERANCE * abs(median), spread)
        higher = entry["better"] == "higher"
        allowed = median - slack if higher else median + slack
        value = found[name]
        if (value < allowed) if higher else (value > allowed):
            regressions.append(Regression(name, median, value, allowed))
    return regressions


def read_baseline(path: Path) -> dict[str, Any]:
    """A baseline file, checked for its format.

    Raises:
        ValueError: not a baseline of this format.
    """
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("ratios"), dict):
        raise ValueError(f"{path} is not a bench baseline (format {FORMAT}); make one with --make-baseline")
    return data


def report(summary: Mapping[str, Any], baseline: Mapping[str, Any]) -> tuple[str, bool]:
    """The comparison as text, and whether it passed (no regression)."""
    found = ratios(summary)
    lines = ["| ratio | baseline (median ± spread) | this run |", "| --- | ---: | ---: |"]
    for name, entry in baseline["ratios"].items():
        value = f"{found[name]:.3f}" if name in found else "not measured"
        lines.append(f"| {name} | {entry['median']:.3f} ± {entry['spread']:.3f} | {value} |")
    regressions = compare(summary, baseline)
    lines += (
        ["", *(f"REGRESSION {r.describe()}" for r in regressions)] if regressions else ["", "no regression"]
    )
    return "\n".join(lines), not regressions
