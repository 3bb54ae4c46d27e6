"""Deterministic synthetic data in the spec's schema, with a planted signal so labels are learnable.

Categorical values follow a Zipf law over each table's cardinality; a few columns, two dense
features and the match between the target item and the user's history drive the click logit.
Rows are kept numeric; :meth:`RawRows.to_wire` renders them as the ensemble's request tensors.
"""

from __future__ import annotations

import numpy as np

from recserve.backends.features.hashing import fnv1a64, splitmix64
from recserve.spec import ModelSpec
from recserve.wire import ABSENT_ITEM, RawRows

ITEM_CLUSTERS = 20
SIGNAL_COLUMNS = 8


def zipf_ranks(
    rng: np.random.Generator, cardinality: int, exponent: float, size: tuple[int, ...]
) -> np.ndarray:
    """Ranks in ``[0, cardinality)`` with ``P(k) ∝ (k + 1) ** -exponent``."""
    weights = np.arange(1, cardinality + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    return np.searchsorted(cdf, rng.random(size) * cdf[-1]).astype(np.int64)


def generate(spec: ModelSpec, rows: int, seed: int) -> RawRows:
    """Generate ``rows`` rows; the same ``(spec, rows, seed)`` always gives the same data."""
    rng = np.random.default_rng(seed)
    signal = np.random.default_rng(spec.training.seed)  # the planted model, fixed per spec
    n_dense, features = len(spec.dense.columns), spec.categorical.features

    dense = np.floor(rng.lognormal(mean=1.0, sigma=1.5, size=(rows, n_dense))).astype(np.float32)
    dense[rng.random((rows, n_dense)) < 0.02] = -1.0
    dense_missing = rng.random((rows, n_dense)) < 0.1

    ranks = np.empty((rows, len(features)), dtype=np.int64)
    values = np.empty((rows, len(features)), dtype=np.uint64)
    logit = np.full(rows, -1.2)
    for col, feature in enumerate(features):
        table = spec.tables[feature.table]
        ranks[:, col] = zipf_ranks(rng, table.cardinality, table.zipf_exponent, (rows,))
        salt = np.uint64(fnv1a64(feature.name))
        values[:, col] = splitmix64(ranks[:, col].astype(np.uint64) ^ salt) & np.uint64(0xFFFFFFFF)
        if col < SIGNAL_COLUMNS:
            effects = signal.normal(0.0, 0.8, size=min(table.cardinality, 2000))
            logit += np.where(
                ranks[:, col] < len(effects), effects[np.minimum(ranks[:, col], len(effects) - 1)], 0.0
            )
    empty = rng.random(values.shape) < 0.03

    items = spec.tables[spec.sequence.table]
    max_len = spec.sequence.max_length
    lengths = np.minimum(rng.geometric(1.0 / spec.sequence.mean_length, size=rows), max_len).astype(np.int32)
    lengths[rng.random(rows) < 0.08] = 0
    user_cluster = rng.integers(0, ITEM_CLUSTERS, size=rows)

    def item_ids(shape: tuple[int, ...], prefer: float) -> np.ndarray:
        ids = zipf_ranks(rng, items.cardinality, items.zipf_exponent, shape)
        clustered = (ids // ITEM_CLUSTERS) * ITEM_CLUSTERS + user_cluster.reshape(
            (-1,) + (1,) * (len(shape) - 1)
        )
        return np.where(rng.random(shape) < prefer, np.minimum(clustered, items.cardinality - 1), ids)

    history = item_ids((rows, max_len), 0.7)
    history[np.arange(max_len)[None, :] >= lengths[:, None]] = 0
    target = item_ids((rows,), 0.5)
    target[rng.random(rows) < 0.02] = ABSENT_ITEM

    valid = np.arange(max_len)[None, :] < lengths[:, None]
    match = ((history % ITEM_CLUSTERS) == (target % ITEM_CLUSTERS)[:, None]) & valid
    match_frac = np.where((lengths > 0) & (target >= 0), match.sum(1) / np.maximum(lengths, 1), 0.0)
    log_dense = np.log1p(np.clip(np.where(dense_missing, 0.0, dense), 0, None))
    logit += 2.5 * (match_frac - 0.3) + 0.5 * (log_dense[:, 0] - 1.0) - 0.4 * (log_dense[:, 1] - 1.0)
    labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return RawRows(dense, dense_missing, values, empty, target, history, lengths, labels)
