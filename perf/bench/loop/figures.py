"""What ``recserve bench-loop`` reports: the summary's figures from a recorded run, and its plots.

* ``loop_auc``, ``frozen_auc``, ``loop_auc_gain``: the AUC of the scores each server returned,
  against the clicks the hidden model made, pooled over the later rounds (the second half: the
  first is the loop's warm-up). The scores were served before their clicks were known, so the AUC
  is progressive. ``auc_by_round`` has both per round.
* ``loop_freshness_p50_s`` / ``p99_s``: for each click, from its time to the first response of the
  loop server carrying a table version trained on it (the first publish whose examples include the
  click's, as the learner reports; its item table's version). A click whose training was refused,
  or whose version came after the last round, is counted in ``loop_freshness_unserved``.
  ``loop_publish_freshness_*``: the same to the publish alone.
* ``logging_p99_ratio``: the loop server's p99 latency over the frozen one's in the latency phase
  (:mod:`.phases`: each server alone by turns, paced, the joiner and the learner stopped);
  ``logging_aa_p99_ratio``: the control server's (a second frozen copy, logging off) over the
  frozen one's in the same turns, the A/A: what two servers of one repository differ by at p99.
  ``rounds_p99_ratio``: the loop server's p99 over the frozen one's on the rounds' requests (each
  sent to both), with the joiner, the learner and the publishes running beside them.
  ``logging_throughput_ratio``: rows per second answered by the loop server alone against the frozen
  one alone, closed loop, in alternating turns.
* ``log_records_lost``: rows sent to the loop server without their features record, plus those
  without their score record, in the log once the server stopped.
* ``loop_examples_lost``: across the bench's ``kill -9`` of the joiner and of the learner (each
  started again), the examples the joiner owed and never emitted: every row served early enough
  for its window to have closed before the joiner was stopped (its click makes a positive; unclicked,
  a negative where the join's hash keeps it at ``negative_rate``), without that example in the
  output; plus the committed example segments up to the last one trained that no learner trained.
  ``loop_examples_duplicated``: examples emitted more than once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recserve.backends.request_log.read import read_kind
from recserve.core.ranking import roc_auc
from recserve.loop.join import kept_negative
from recserve.loop.joiner import read_examples
from recserve.perf.bench.loop.bench import Recorded

#: The summary's keys, in order (the integration test checks them).
KEYS = (
    "loop_auc",
    "frozen_auc",
    "loop_auc_gain",
    "loop_freshness_p50_s",
    "loop_freshness_p99_s",
    "logging_p99_ratio",
    "logging_aa_p99_ratio",
    "logging_throughput_ratio",
    "log_records_lost",
    "loop_examples_lost",
    "skew_max_abs",
    "loop_published_versions",
)
#: the two servers the rounds and the throughput phase compare
SIDES = ("loop", "frozen")
#: (seq, path) of the committed example segments in a folder (``recserve.loop.joiner.committed_segments``).
Segments = Callable[[Path], list[tuple[int, Path]]]


def _auc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    value = roc_auc(labels.astype(np.float64), scores)
    return None if value is None else round(float(value), 4)


def auc_figures(recorded: Recorded) -> dict:
    """AUC per round and pooled over the later rounds, of both servers' scores."""
    rounds = recorded.grid.rounds
    later_from = rounds // 2
    by_round: list[dict] = []
    for round_ in range(rounds):
        served = [s for s in recorded.served if s.round == round_]
        labels = np.concatenate([s.clicks for s in served])
        by_round.append(
            {
                "round": round_,
                "rows": int(labels.size),
                "click_rate": round(float(labels.mean()), 4),
                "loop_auc": _auc(labels, np.concatenate([s.loop_scores for s in served])),
                "frozen_auc": _auc(labels, np.concatenate([s.frozen_scores for s in served])),
            }
        )
    later = [s for s in recorded.served if s.round >= later_from]
    labels = np.concatenate([s.clicks for s in later])
    loop = _auc(labels, np.concatenate([s.loop_scores for s in later]))
    frozen = _auc(labels, np.concatenate([s.frozen_scores for s in later]))
    gain = None if loop is None or frozen is None else round(loop - frozen, 4)
    return {"loop_auc": loop, "frozen_auc": frozen, "loop_auc_gain": gain, "later_rounds_from": later_from,
            "auc_by_round": by_round}  # fmt: skip


def publishes(recorded: Recorded) -> list[dict]:
    """The learner's publish decisions in order: when read, the last segment trained, the item version."""
    out = []
    for seen, line in recorded.learner_lines:
        if "published" in line:
            version = line["published"].get(recorded.item_table)
            out.append({"seen": seen, "trained": int(line["trained"]), "item_version": version})
    return out


def freshness_figures(recorded: Recorded, segments: Segments) -> tuple[dict, list[float]]:
    """Each click's time to the first served version trained on it (see the module); the seconds too."""
    decisions = publishes(recorded)
    answered = sorted((s.sent, s.item_version) for s in recorded.served)
    served_at = []
    for decision in decisions:
        version = decision["item_version"]
        first = next((t for t, v in answered if version is not None and v >= version), None)
        served_at.append(first)
    to_served: list[float] = []
    to_publish: list[float] = []
    unserved = 0
    for seq, path in segments(recorded.examples_dir):
        table = pq.read_table(path, columns=["label", "labelled_at"])
        clicks = table.filter(pc.equal(table["label"], 1))["labelled_at"].to_pylist()
        index = next((i for i, d in enumerate(decisions) if d["trained"] >= seq), None)
        at = None if index is None or decisions[index]["item_version"] is None else served_at[index]
        for clicked in (c.timestamp() for c in clicks):
            if index is None or at is None:
                unserved += 1
                continue
            to_publish.append(decisions[index]["seen"] - clicked)
            to_served.append(at - clicked)

    def quantiles(values: list[float], name: str) -> dict:
        if not values:
            return {f"{name}_p50_s": None, f"{name}_p99_s": None}
        return {f"{name}_p50_s": round(float(np.percentile(values, 50)), 2),
                f"{name}_p99_s": round(float(np.percentile(values, 99)), 2)}  # fmt: skip

    figures = {
        **quantiles(to_served, "loop_freshness"),
        **quantiles(to_publish, "loop_publish_freshness"),
        "loop_freshness_clicks": len(to_served),
        "loop_freshness_unserved": unserved,
        "loop_published_versions": sum(1 for d in decisions if d["item_version"] is not None),
        "loop_refused_publishes": sum(1 for d in decisions if d["item_version"] is None),
        "loop_rollbacks": sum(1 for _, line in recorded.learner_lines if line.get("rolled_back")),
        "loop_dense_versions": sum(1 for _, line in recorded.learner_lines if line.get("dense_published")),
        "loop_dense_refused": sum(
            1
            for _, line in recorded.learner_lines
            if "dense_published" in line and not line["dense_published"]
        ),
        "loop_dense_rollbacks": sum(1 for _, line in recorded.learner_lines if line.get("dense_rolled_back")),
    }
    return figures, to_served


def cost_figures(recorded: Recorded) -> dict:
    """Logging's cost: latency against the frozen server and the control's A/A, and throughput."""
    phase = {side: np.array(values) for side, values in recorded.latency_s.items()}
    p99 = {side: _p99(values) for side, values in phase.items()}
    rounds = [np.array([getattr(s, f"{side}_latency_s") for s in recorded.served]) for side in SIDES]
    rates = {
        side: recorded.throughput_rows[side] / recorded.throughput_seconds[side]
        for side in SIDES
        if recorded.throughput_seconds[side] > 0
    }
    return {
        "logging_p99_ratio": _ratio(p99["loop"], p99["frozen"]),
        "logging_aa_p99_ratio": _ratio(p99["control"], p99["frozen"]),
        "logging_throughput_ratio": round(rates["loop"] / rates["frozen"], 3) if len(rates) == 2 else None,
        **{f"{side}_p99_ms": None if p is None else round(1e3 * p, 2) for side, p in p99.items()},
        **{
            f"{side}_p50_ms": round(1e3 * float(np.median(values)), 2) if values.size else None
            for side, values in phase.items()
        },
        "rounds_p99_ratio": _ratio(_p99(rounds[0]), _p99(rounds[1])),
        "loop_rows_per_s": round(rates.get("loop", 0.0), 1),
        "frozen_rows_per_s": round(rates.get("frozen", 0.0), 1),
    }


def _p99(values: np.ndarray) -> float | None:
    return float(np.percentile(values, 99)) if values.size else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else round(numerator / denominator, 3)


def lost_figures(recorded: Recorded) -> dict:
    """Rows sent to the loop server against the rows each record kind holds for them."""
    held = {}
    for kind in ("features", "scores"):
        table = read_kind(recorded.log_dir, kind)
        held[kind] = len(set(zip(table["request_id"].to_pylist(), table["row"].to_pylist(), strict=True)))
    sent = recorded.loop_rows_sent
    return {
        "log_rows_sent": sent,
        "log_feature_records": held["features"],
        "log_score_records": held["scores"],
        "log_records_lost": max(sent - held["features"], 0) + max(sent - held["scores"], 0),
    }


def kill_figures(recorded: Recorded, segments: Segments) -> dict:
    """What the ``kill -9`` of the joiner and of the learner lost or doubled (see the module)."""
    emitted = read_examples(recorded.examples_dir)
    keys = list(
        zip(
            emitted["request_id"].to_pylist(),
            emitted["row"].to_pylist(),
            emitted["label"].to_pylist(),
            strict=True,
        )
    )
    # a row's window closes W after it is served, and its record reaches the joiner a segment later
    grid = recorded.grid
    closed_by = (
        recorded.joiner_stopped - grid.window_seconds - grid.segment_seconds - 2 * grid.commit_seconds - 1.0
    )
    owed = set()
    for served in recorded.served:
        if served.sent >= closed_by:
            continue
        for row, clicked in enumerate(served.clicks.tolist()):
            if clicked or kept_negative(served.request_id, row, recorded.negative_rate):
                owed.add((served.request_id, row, int(clicked)))
    # late positives re-emit a row with its click: an example is its (request, row, label)
    examples_lost = len(owed - set(keys))
    trained = {line["segment"] for _, line in recorded.learner_lines if "segment" in line}
    last = max(trained, default=0)
    untrained = [seq for seq, _ in segments(recorded.examples_dir) if seq <= last and seq not in trained]
    return {
        "loop_examples_lost": examples_lost + len(untrained),
        "loop_examples_owed": len(owed),
        "loop_examples_duplicated": len(keys) - len(set(keys)),
        "loop_segments_untrained": len(untrained),
        "loop_kills": recorded.kills,
    }


def summarize(recorded: Recorded, segments: Segments, skew: dict) -> tuple[dict, list[float]]:
    """The summary of a run (:data:`KEYS` first) and each click's freshness in seconds."""
    freshness, seconds = freshness_figures(recorded, segments)
    figures = {
        **auc_figures(recorded),
        **freshness,
        **cost_figures(recorded),
        **lost_figures(recorded),
        **kill_figures(recorded, segments),
        **skew,
    }
    figures["joiner"] = recorded.joiner_summary
    figures["exits"] = recorded.exits  # 0: stopped by the bench; else it died (its log is in the run folder)
    figures["seconds"] = round(recorded.seconds, 1)
    ordered = {key: figures.pop(key) for key in KEYS}
    return {**ordered, **figures}, seconds


def write_plots(summary: dict, freshness: list[float], folder: Path) -> list[Path]:
    """``loop_auc.png`` (AUC per round, loop and frozen) and ``loop_freshness.png`` in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    rounds = summary["auc_by_round"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for side in ("loop", "frozen"):
        ax.plot([r["round"] + 1 for r in rounds], [r[f"{side}_auc"] for r in rounds], marker="o", label=side)
    ax.axvline(summary["later_rounds_from"] + 0.5, color="grey", linestyle=":", label="later rounds")
    ax.set_xlabel("round")
    ax.set_ylabel("AUC of the served scores")
    ax.set_title(f"loop {summary['loop_auc']} vs frozen {summary['frozen_auc']} (later rounds)")
    ax.legend()
    fig.tight_layout()
    paths = [folder / "loop_auc.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    if freshness:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(freshness, bins=30)
        ax.set_xlabel("seconds from a click to the first served version trained on it")
        ax.set_ylabel("clicks")
        fig.tight_layout()
        paths.append(folder / "loop_freshness.png")
        fig.savefig(paths[1], dpi=100)
        plt.close(fig)
    return paths


def describe(summary: dict) -> str:
    """The summary's main figures, one a line."""
    return "\n".join(f"{key:28s} {summary[key]}" for key in KEYS)
