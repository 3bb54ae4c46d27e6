"""``recserve bench-loop --replay``: the loop on the bench's stream in one process, to choose its settings.

The requests ``recserve bench-loop`` sends (the same seeded stream, round after round at the grid's
rate) go through the loop's own parts, without servers or processes, on the stream's clock:

* each request is scored twice through the served dense network: with the rows the learner last
  published (the **loop** side) and with the store's rows alone (the **frozen** side);
* its rows are logged as the lookup step logs them (:meth:`FeatureLog.records`, the same keys and
  history) with the loop side's scores, and reach the join ``log_delay_s`` later (a log segment's
  age); its impressions and clicks are reported at once, as the bench does;
* every ``commit_seconds`` the join (:class:`Join`, the bench's ``[loop]``: W, the late horizon, w)
  is advanced and the :class:`Learner` trains on what it emitted, watches its publishes and, every
  ``publish_seconds``, publishes (with its check), as ``recserve learn`` does.

It reports, per learning rate (the tables trained: the bench's ``[loop] train_tables``),
``loop_auc``, ``frozen_auc`` and ``loop_auc_gain`` as the bench defines them (the served scores
against the clicks over the later half of the rounds), and the learner's publishes, refusals and
rollbacks. What it leaves out: the servers' poll of the update
log, the processes' own delays and the machine's load (the bench's figures are lower for them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa

from recserve.backends.dense.network import CTRNet
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.request_log.records import Identity, carried_histories
from recserve.backends.request_log.step_log import FeatureLog
from recserve.backends.request_log.writer import RecordWriter
from recserve.backends.store.tiered import TieredStore
from recserve.core.feedback import CLICK, IMPRESSION, FeedbackEvent
from recserve.core.ranking import roc_auc
from recserve.core.rows import Rows
from recserve.core.sections.logging import LoggingSection
from recserve.core.spec.model import ModelSpec
from recserve.loop.join import Join
from recserve.loop.learner import Learner
from recserve.loop.tables import examples_table, records
from recserve.perf.bench.loop.bench import LoopGrid, bench_specs
from recserve.perf.bench.loop.stream import DriftingStream

#: The stream's clock starts here (seconds since the epoch), as a served row's time would.
START = 1_767_225_600.0


@dataclass(frozen=True)
class Request:
    """One request of the stream: when it was sent, its rows' features records, its clicks."""

    round: int
    sent: float
    features: list[dict[str, Any]]  # the features records as the lookup step logs them (versions unset)
    scoring: pa.Table  # the same rows in the examples' columns, to score them
    clicks: np.ndarray


@dataclass(frozen=True)
class ReplayFigures:
    """One learning rate's replay."""

    learning_rate: float
    train_tables: tuple[str, ...]  # empty: all
    loop_auc: float | None
    frozen_auc: float | None
    loop_auc_gain: float | None
    examples: int
    published_versions: int
    refused_publishes: int
    rollbacks: int


def stream_requests(
    spec: ModelSpec, grid: LoopGrid, row_logits: Callable[[Rows], np.ndarray] | None = None
) -> list[Request]:
    """The bench's requests (the same stream, in the same order), their rows logged as served."""
    stream = DriftingStream(spec, grid.rounds, grid.stream, row_logits=row_logits)
    settings = LoggingSection(enabled=True, history=True)
    log = FeatureLog(spec, settings, cast(RecordWriter, None))  # its records() alone: no writer
    transform = FeatureTransform(spec)
    versions = np.ones((1, len(spec.table_names)), np.int64)
    count = max(1, round(grid.rate * grid.round_seconds))
    out = []
    for round_ in range(grid.rounds):
        for k in range(count):
            rows, _, clicks = stream.request(round_ + k / count, grid.rows)
            sent = START + round_ * grid.round_seconds + k / grid.rate
            features = transform.transform(rows.to_inputs(spec))
            batch = log.records(Identity(f"r{round_}-{k}"), int(sent * 1e6), features, versions)
            table = pa.Table.from_batches([batch])
            logged = records(table)
            history, lengths = carried_histories(table)  # each row's own, as the join resolves it
            scoring = pa.table(
                {
                    "keys": table["keys"],
                    "dense": table["dense"],
                    "history": history,
                    "history_lengths": lengths,
                }
            )
            out.append(Request(round_, sent, logged, scoring, clicks))
    return out


def replay(
    spec: ModelSpec,
    store: TieredStore,
    net: CTRNet,
    grid: LoopGrid,
    learning_rate: float,
    requests: list[Request],
    log_delay_s: float = 1.0,
) -> ReplayFigures:
    """The loop on ``requests`` (:func:`stream_requests`) at ``learning_rate``; see the module."""
    loop_spec = bench_specs(spec, Path("replay"), grid)[0]  # the bench's W, late horizon, w, tables
    loop = loop_spec.loop
    join = Join(
        loop.window_seconds, loop.late_seconds, loop.negative_rate,
        target_slot=-len(spec.targets), score_wait_s=loop.score_wait_seconds,
    )  # fmt: skip
    learner = Learner(loop_spec, store, net, learning_rate)
    versions = dict.fromkeys(spec.table_names, 1)

    def publish(table: str, keys: np.ndarray, vectors: np.ndarray) -> int:
        versions[table] += 1
        return versions[table]

    def rollback(table: str, version: int) -> int:
        versions[table] += 1  # the revert: a new version serving the rows before ``version``
        return versions[table]

    pending: list[tuple[float, Request]] = []  # served, not yet in the join
    served: list[tuple[Request, np.ndarray, np.ndarray]] = []  # loop and frozen scores
    last_publish = tick = START

    def advance(now: float) -> None:
        nonlocal last_publish
        while pending and pending[0][0] <= now:
            _, request = pending.pop(0)
            join.add_features(request.features)
        join.advance(now)
        examples = join.take()
        if examples:
            table = examples_table(examples)
            for start in range(0, table.num_rows, grid.batch_size):
                learner.train(table.slice(start, grid.batch_size))
            learner.watch(rollback, loop.watch_examples, loop.max_loss_increase)
        if learner.touched and now - last_publish >= grid.publish_seconds:
            learner.publish(publish, now=now, max_loss_increase=loop.max_loss_increase)
            last_publish = now

    for request in requests:
        while tick + grid.commit_seconds <= request.sent:
            tick += grid.commit_seconds
            advance(tick)
        loop_scores = learner.score(request.scoring, learner.published)
        frozen_scores = learner.score(request.scoring, {})
        served.append((request, loop_scores, frozen_scores))
        now = [versions[t] for t in spec.table_names]
        features = [{**r, "embedding_version": now} for r in request.features]
        join.add_scores(
            [{"request_id": r["request_id"], "row": r["row"], "score": float(s), "dense_version": 1,
              "time": r["time"]} for r, s in zip(features, loop_scores, strict=True)]
        )  # fmt: skip
        pending.append((request.sent + log_delay_s, replace(request, features=features)))
        rid = features[0]["request_id"]
        events = [FeedbackEvent(rid, r, IMPRESSION, request.sent) for r in range(len(features))]
        events += [FeedbackEvent(rid, int(r), CLICK, request.sent) for r in np.flatnonzero(request.clicks)]
        join.add_feedback(events)
    end = tick + loop.window_seconds + log_delay_s + 2 * grid.commit_seconds
    while tick < end:
        tick += grid.commit_seconds
        advance(tick)
    later = [s for s in served if s[0].round >= grid.rounds // 2]
    labels = np.concatenate([r.clicks for r, _, _ in later]).astype(np.float64)
    auc = [roc_auc(labels, np.concatenate([s[side] for s in later])) for side in (1, 2)]
    loop_auc, frozen_auc = (None if a is None else round(float(a), 4) for a in auc)
    gain = None if loop_auc is None or frozen_auc is None else round(loop_auc - frozen_auc, 4)
    return ReplayFigures(
        learning_rate, loop.train_tables, loop_auc, frozen_auc, gain, learner.examples_trained,
        learner.versions_published, learner.refused_publishes, learner.rollbacks,
    )  # fmt: skip


def open_served(spec: ModelSpec, repository: Path) -> tuple[TieredStore, CTRNet]:
    """The store and the dense network ``repository`` serves, as ``recserve learn`` opens them."""
    from safetensors.torch import load_file

    from recserve.backends.store.served import ServedStore
    from recserve.build.repository import version_dir
    from recserve.core.names import DENSE, EMBEDDING_LOOKUP

    served = ServedStore.open(spec, version_dir(repository, EMBEDDING_LOOKUP, spec), start=False)
    net = CTRNet(spec)
    net.load_state_dict(load_file(str(version_dir(repository, DENSE, spec) / "weights.safetensors")))
    return served.store, net


def describe(figures: list[ReplayFigures]) -> str:
    """One line per learning rate."""
    lines = [
        "learning_rate  loop_auc  frozen_auc  gain     examples  published  refused  rolled back  tables"
    ]
    for f in figures:
        lines.append(
            f"{f.learning_rate:<13g}  {f.loop_auc}  {f.frozen_auc}    {f.loop_auc_gain:<+7}  "
            f"{f.examples:<8}  {f.published_versions:<9}  {f.refused_publishes:<7}  {f.rollbacks:<11}  "
            f"{','.join(f.train_tables) or 'all'}"
        )
    return "\n".join(lines)


def as_json(figures: list[ReplayFigures]) -> list[dict]:
    """The figures as JSON objects."""
    return [asdict(f) for f in figures]
