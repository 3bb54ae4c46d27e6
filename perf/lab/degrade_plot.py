"""The plot of ``recserve lab degrade``: λ, the served p99 and the levels over the schedule (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(summary: dict[str, Any], path: Path) -> Path:
    """Three panels over time: λ (degrade), the served p99 per window (both policies), the levels' shares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lam, p99, levels) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    timeline = summary["lambda_timeline"]
    if timeline:
        times = [point[0] for point in timeline]
        lam.step(times, [point[1] for point in timeline], where="post", label="λ")
        lam.step(times, [point[2] for point in timeline], where="post", label="load")
        if any(point[4] for point in timeline):  # behind the access layer's door
            lam.step(times, [point[4] for point in timeline], where="post", label="λ at the door")
    lam.set(ylabel="λ, load (wait / target)", yscale="symlog", title="recserve lab degrade")
    for policy, rows in summary["windows"].items():
        points = [(t, v) for t, v, *_ in rows if v is not None]
        p99.plot([t for t, _ in points], [v for _, v in points], marker=".", label=policy)
    p99.set(ylabel="served p99 (ms)", yscale="log")
    rows = summary["windows"].get("degrade", [])
    if rows:
        times = [r[0] for r in rows]
        levels.stackplot(times, [r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows],
                         labels=["full", "degraded", "refused"], step="post")  # fmt: skip
    levels.set(ylabel="share of requests (degrade)", xlabel="seconds since the schedule began", ylim=(0, 1))
    start = 0.0
    for phase in summary["phases"]["degrade"]:
        for ax in (lam, p99, levels):
            ax.axvline(start, color="grey", linewidth=0.5)
        start += phase["sent"] / phase["rate"] if phase["rate"] else 0.0
    for ax in (lam, p99, levels):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
