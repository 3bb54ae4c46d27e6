"""The joiner's and the learner's figures in the Prometheus text format, served on ``--metrics-port``.

``recserve join --metrics-port N`` and ``recserve learn --metrics-port N`` serve
``http://127.0.0.1:N/metrics`` from a daemon thread. Every series is declared from the start (at 0).
"""

from __future__ import annotations

from collections.abc import Iterable

from recserve.backends.base.metrics import MetricSample
from recserve.loop.dense import DenseTrainer
from recserve.loop.join import COUNTS
from recserve.loop.joiner import Joiner
from recserve.loop.learner import Learner


def text(samples: Iterable[MetricSample]) -> str:
    """Samples in the Prometheus text format (HELP and TYPE once per name)."""
    lines: list[str] = []
    seen: set[str] = set()
    for s in samples:
        if s.name not in seen:
            seen.add(s.name)
            lines += [f"# HELP {s.name} {s.description}", f"# TYPE {s.name} {s.kind}"]
        labels = ",".join(f'{k}="{v}"' for k, v in s.labels)
        lines.append(f"{s.name}{{{labels}}} {s.value:g}" if labels else f"{s.name} {s.value:g}")
    return "\n".join(lines) + "\n"


def join_samples(joiner: Joiner) -> list[MetricSample]:
    """``recserve_join_*``: the join's counts, refusals, examples committed, rows held, the last commit."""
    join = joiner.join
    counts = dict(join.counts)
    return [
        *(
            MetricSample(
                "recserve_join_total",
                "counter",
                "What the join counted (docs/design/loop.md)",
                (("count", name),),
                float(counts.get(name, 0)),
            )
            for name in COUNTS
        ),
        *(
            MetricSample(
                "recserve_join_refused_total",
                "counter",
                "Lines, entries or segments that were not records or feedback, by source",
                (("source", name),),
                float(source.refused),
            )
            for name, source in (("log", joiner.log), ("feedback", joiner.feedback))
        ),
        MetricSample(
            "recserve_join_examples_total",
            "counter",
            "Examples committed",
            (),
            float(joiner.examples_written),
        ),
        *(
            MetricSample(
                "recserve_join_held_rows",
                "gauge",
                "Logged rows the join holds, by window state",
                (("state", state),),
                float(len(held)),
            )
            for state, held in (("open", join.open), ("closed", join.closed))
        ),
        MetricSample(
            "recserve_join_waiting_feedback",
            "gauge",
            "Feedback waiting for its row's record",
            (),
            float(sum(len(v) for v in list(join.waiting_feedback.values()))),
        ),
        MetricSample(
            "recserve_join_checkpoint",
            "gauge",
            "The last committed checkpoint's number",
            (),
            float(joiner.seq),
        ),
    ]


def learn_samples(learner: Learner) -> list[MetricSample]:
    """``recserve_learn_*``: examples trained, the progressive log loss, what was published, its freshness."""
    loss = learner.progressive_loss[-1] if learner.progressive_loss else 0.0
    return [
        MetricSample(
            "recserve_learn_examples_total",
            "counter",
            "Examples trained on",
            (),
            float(learner.examples_trained),
        ),
        MetricSample(
            "recserve_learn_progressive_log_loss",
            "gauge",
            "The last batch's weighted log loss, scored before it was trained on",
            (),
            loss,
        ),
        MetricSample(
            "recserve_learn_published_versions_total",
            "counter",
            "Embedding deltas published",
            (),
            float(learner.versions_published),
        ),
        MetricSample(
            "recserve_learn_published_rows_total",
            "counter",
            "Rows published in them",
            (),
            float(learner.rows_published),
        ),
        MetricSample(
            "recserve_learn_rollbacks_total",
            "counter",
            "Published versions rolled back: worse than the rows they replaced by more than the margin",
            (),
            float(learner.rollbacks),
        ),
        MetricSample(
            "recserve_learn_refused_publishes_total",
            "counter",
            "Publishes refused: the learner's log loss above the served one by more than the margin",
            (),
            float(learner.refused_publishes),
        ),
        *_pair("check_log_loss", "The last publish decision's log loss", "scores", learner.last_check),
        *_pair("check_auc", "The last publish decision's AUC", "scores", learner.last_auc),
        # the watch: a publish judged on the examples it served
        *_pair("watch_log_loss", "The last judged publish's log loss", "rows", learner.last_watch),
        *_pair("watch_auc", "The last judged publish's AUC", "rows", learner.last_watch_auc),
        *(
            MetricSample(
                "recserve_learn_freshness_seconds",
                "gauge",
                "Seconds from an example's label to the publish of its rows (the last publish)",
                (("quantile", q),),
                value,
            )
            for q, value in zip(("0.5", "0.99"), learner.freshness, strict=True)
        ),
        *(dense_samples(learner.dense) if learner.dense is not None else ()),
    ]


#: the two sides of a compared figure, by label: the learner's against the served scores (a publish
#: decision), a publish's rows against those it replaced, on the examples it served (a watch)
SIDES = {"scores": ("learner", "served"), "rows": ("published", "replaced")}


def _pair(name: str, description: str, label: str, values: tuple[float, float]) -> list[MetricSample]:
    """``recserve_learn_<name>{<label>=...}``: a figure of both sides of a comparison."""
    first, second = SIDES[label]
    return [
        MetricSample(f"recserve_learn_{name}", "gauge", f"{description}: the {first} and the {second}",
                     ((label, side),), value)
        for side, value in zip(SIDES[label], values, strict=True)
    ]  # fmt: skip


def dense_samples(dense: DenseTrainer) -> list[MetricSample]:
    """``recserve_learn_dense_*``: the dense versions the learner served, refused and rolled back."""
    counts = (
        ("published", "Dense versions published", dense.versions_published),
        ("refused_publishes", "Dense publishes refused by the decision", dense.refused_publishes),
        ("rollbacks", "Dense versions rolled back by their watch", dense.rollbacks),
    )
    return [
        MetricSample("recserve_learn_dense_version", "gauge", "The dense version served", (), dense.version),
        *(
            MetricSample(f"recserve_learn_dense_{name}_total", "counter", help_, (), float(value))
            for name, help_, value in counts
        ),
    ]
