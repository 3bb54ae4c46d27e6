"""Deterministic synthetic data in the spec's schema, with a planted signal so labels are learnable.

Categorical values follow a Zipf law over each table's cardinality (time columns are uniform over
ten days); a few columns, two dense features and the match between the target item and the user's
history drive the click logit. Categorical values are rendered as clients send them (by value type).
"""

from __future__ import annotations

import datetime
import zoneinfo
from dataclasses import replace

import numpy as np

from recserve.backends.features.hashing import fnv1a64, splitmix64
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import MultiHotFeature, RawColumn, SequenceFeature
from recserve.core.values import ABSENT_ITEM

ITEM_CLUSTERS = 20
SIGNAL_COLUMNS = 8
#: The values a table without a cardinality draws from (an imported spec's may give none).
DEFAULT_CARDINALITY = 1000


def zipf_ranks(
    rng: np.random.Generator, cardinality: int, exponent: float, size: tuple[int, ...]
) -> np.ndarray:
    """Ranks in ``[0, cardinality)`` with ``P(k) ∝ (k + 1) ** -exponent`` (0: :data:`DEFAULT_CARDINALITY`)."""
    cardinality = cardinality or DEFAULT_CARDINALITY
    weights = np.arange(1, cardinality + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    return np.searchsorted(cdf, rng.random(size) * cdf[-1]).astype(np.int64)


#: Synthetic time columns start here and span this many hours (Avazu's ten days of October 2014).
TIME_ORIGIN_S = 1413849600  # 2014-10-21 00:00 UTC
TIME_SPAN_HOURS = 240


def render(values: np.ndarray, column: RawColumn) -> np.ndarray:
    """Strings ``[N]`` (bytes) of a column's raw values as a client sends them, by its value type."""
    if column.value_type == "time":
        zone = zoneinfo.ZoneInfo(column.timezone)
        if column.time_format:
            texts = [
                datetime.datetime.fromtimestamp(int(v), zone).strftime(column.time_format) for v in values
            ]
        else:
            texts = [str(int(v) * (1000 if column.time_unit == "ms" else 1)) for v in values]
        return np.array([t.encode() for t in texts], dtype=object)
    pattern = "%d" if column.value_type in ("int64", "uint64") else "%08x"
    return np.char.encode(np.char.mod(pattern, values)).astype(object)


def generate(spec: ModelSpec, rows: int, seed: int) -> Rows:
    """Generate ``rows`` rows; the same ``(spec, rows, seed)`` always gives the same data."""
    rng = np.random.default_rng(seed)
    signal = np.random.default_rng(spec.training.seed)  # the planted model, fixed per spec
    n_dense, columns = len(spec.numeric_columns), spec.categorical.raw_columns

    counts = rng.lognormal(mean=1.0, sigma=1.5, size=(rows, n_dense))
    real = np.array([c.real for c in spec.dense.numeric if not c.reads] if spec.dense else [], dtype=bool)
    dense = np.where(real, np.round(counts, 2), np.floor(counts)).astype(np.float32)  # or prices
    dense[rng.random((rows, n_dense)) < 0.02] = -1.0
    dense_missing = rng.random((rows, n_dense)) < 0.1

    values = np.empty((rows, len(columns)), dtype=np.uint64)
    logit = np.full(rows, -1.2)
    multi_hot = {f.column: f for f in spec.categorical.multi_hot}
    for col, column in enumerate(columns):
        if col in multi_hot:
            continue
        feature = next(f for f in spec.categorical.features if f.column == col)
        table = spec.tables[feature.table]
        if column.value_type == "time":
            hours = rng.integers(0, TIME_SPAN_HOURS, size=rows)
            values[:, col] = (TIME_ORIGIN_S + 3600 * hours).astype(np.uint64)
            ranks = hours % 24
        elif column.value_type in ("int64", "uint64"):  # small integer codes, as such columns hold
            ranks = zipf_ranks(rng, table.cardinality, table.zipf_exponent, (rows,))
            values[:, col] = ranks.astype(np.uint64)
        else:
            ranks = zipf_ranks(rng, table.cardinality, table.zipf_exponent, (rows,))
            salt = np.uint64(fnv1a64(column.name))
            values[:, col] = splitmix64(ranks.astype(np.uint64) ^ salt) & np.uint64(0xFFFFFFFF)
        if col < SIGNAL_COLUMNS:
            effects = signal.normal(0.0, 0.8, size=min(table.cardinality or DEFAULT_CARDINALITY, 2000))
            logit += np.where(ranks < len(effects), effects[np.minimum(ranks, len(effects) - 1)], 0.0)
    empty = rng.random(values.shape) < 0.03
    categorical = np.empty(values.shape, dtype=object)
    for col, column in enumerate(columns):
        if col not in multi_hot:
            categorical[:, col] = render(values[:, col], column)
    categorical[empty] = b""
    for col, multi in multi_hot.items():
        categorical[:, col] = _multi_hot(rng, spec, multi, columns[col], rows)

    target = np.full(rows, ABSENT_ITEM, np.int64)
    history = np.zeros((rows, 1), np.int64)
    lengths = np.zeros(rows, np.int32)
    side: dict[str, np.ndarray] = {}
    planted: np.ndarray | float = 0.0
    drawn: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # per target: its ids and its users' clusters
    for g, group in enumerate(spec.attention_groups):
        name = group.targets[0].name
        group_target, group_history, group_lengths, match_frac, clusters = _sequences(
            spec, group.primary, rng, rows, *drawn.get(name, ())
        )
        drawn.setdefault(name, (group_target, clusters))  # a target attending several sequences
        planted = planted + (2.5 if g == 0 else 1.5) * (match_frac - 0.3)
        if g == 0:
            target, history, lengths = group_target, group_history, group_lengths
        else:
            side[group.primary.name], side[group.length_input] = group_history, group_lengths
            if name != spec.targets[0].name:
                side[name] = group_target
        for other, other_target in zip(group.sequences[1:], group.targets[1:], strict=True):
            # an attribute of each item (its category): a fixed function of the item id
            cardinality = spec.tables[other.table].cardinality or DEFAULT_CARDINALITY
            side[other.name] = np.where(group_history > 0, group_history % cardinality, 0)
            side[other_target.name] = np.where(group_target >= 0, group_target % cardinality, ABSENT_ITEM)
    if n_dense >= 2:
        log_dense = np.log1p(np.clip(np.where(dense_missing, 0.0, dense), 0, None))
        planted = planted + 0.5 * (log_dense[:, 0] - 1.0) - 0.4 * (log_dense[:, 1] - 1.0)
    logit += planted
    labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return Rows(dense, dense_missing, categorical, target, history, lengths, labels, side)


def _multi_hot(
    rng: np.random.Generator, spec: ModelSpec, feature: MultiHotFeature, column: RawColumn, rows: int
) -> np.ndarray:
    """Strings ``[N]`` of 0..max_length Zipf-distributed values joined by the column's separator."""
    table = spec.tables[feature.table]
    counts = rng.integers(0, feature.max_length + 1, size=rows)
    ranks = zipf_ranks(rng, table.cardinality, table.zipf_exponent, (rows, feature.max_length))
    salt = np.uint64(fnv1a64(column.name))
    values = splitmix64(ranks.astype(np.uint64) ^ salt) & np.uint64(0xFFFFFFFF)
    element = replace(column, separator="", max_length=1)
    texts = render(values.reshape(-1), element).reshape(rows, feature.max_length)
    separator = column.separator.encode()
    return np.array([separator.join(texts[r, : counts[r]]) for r in range(rows)], dtype=object)


def _sequences(
    spec: ModelSpec,
    sequence: SequenceFeature,
    rng: np.random.Generator,
    rows: int,
    target: np.ndarray | None = None,
    user_cluster: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Target ids, histories, lengths, the share of each history in the target's cluster, the clusters.

    A ``target`` (with its ``user_cluster``) already drawn for another sequence is kept.
    """
    items = spec.tables[sequence.table]
    max_len = sequence.max_length
    lengths = np.minimum(rng.geometric(1.0 / sequence.mean_length, size=rows), max_len).astype(np.int32)
    lengths[rng.random(rows) < 0.08] = 0
    if user_cluster is None:
        user_cluster = rng.integers(0, ITEM_CLUSTERS, size=rows)

    def item_ids(shape: tuple[int, ...], prefer: float) -> np.ndarray:
        ids = zipf_ranks(rng, items.cardinality, items.zipf_exponent, shape)
        clustered = (ids // ITEM_CLUSTERS) * ITEM_CLUSTERS + user_cluster.reshape(
            (-1,) + (1,) * (len(shape) - 1)
        )
        top = (items.cardinality or DEFAULT_CARDINALITY) - 1
        return np.where(rng.random(shape) < prefer, np.minimum(clustered, top), ids)

    history = item_ids((rows, max_len), 0.7)
    history[np.arange(max_len)[None, :] >= lengths[:, None]] = 0
    if target is None:
        target = item_ids((rows,), 0.5)
        target[rng.random(rows) < 0.02] = ABSENT_ITEM

    valid = np.arange(max_len)[None, :] < lengths[:, None]
    match = ((history % ITEM_CLUSTERS) == (target % ITEM_CLUSTERS)[:, None]) & valid
    match_frac = np.where((lengths > 0) & (target >= 0), match.sum(1) / np.maximum(lengths, 1), 0.0)
    return target, history, lengths, match_frac, user_cluster
