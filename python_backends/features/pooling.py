"""How a multi-hot feature's values pool into one slot: each position's weight and the pooling matrix.

The transform weighs each parsed value of a row (:func:`pooling_weights`), and the lookup step sums
a feature's weighted vectors into its slot (:func:`pooling_matrix`). The log holds the keys alone:
a padding position holds its feature's missing key, which a value's key equals only by a 64-bit
collision, so :func:`logged_pooling_weights` gives the served weights back from the logged keys
(``recserve verify --log``, ``recserve learn``).
"""

from __future__ import annotations

import numpy as np

from recserve.backends.features.hashing import missing_key
from recserve.core.spec.model import ModelSpec


def pooling_weights(valid: np.ndarray, pooling: str) -> np.ndarray:
    """Weights ``[B, max_length]`` of one feature's positions, ``valid`` where a value is.

    1 (sum), ``1 / n`` (mean) or ``1 / sqrt(n)`` (sqrtn) on a row's ``n`` valid positions, 0 on the
    others: a row without values pools to zeros.
    """
    count = np.maximum(valid.sum(axis=1, keepdims=True), 1).astype(np.float32)
    scale = {"sum": 1.0, "mean": count, "sqrtn": np.sqrt(count)}[pooling]
    return (valid / scale).astype(np.float32)


def pooling_matrix(spec: ModelSpec) -> np.ndarray:
    """``[sum of max_length, multi-hot features]``: 1 where a position belongs to the feature."""
    features = spec.categorical.multi_hot
    matrix = np.zeros((sum(f.max_length for f in features), len(features)), np.float32)
    starts = np.cumsum([0, *(f.max_length for f in features)])
    for k, (start, end) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        matrix[start:end, k] = 1.0
    return matrix


def logged_pooling_weights(spec: ModelSpec, keys: np.ndarray) -> np.ndarray:
    """The weights the transform gave multi-hot ``keys`` ``[B, sum of max_length]``, from the keys alone."""
    weights, start = [], 0
    for feature in spec.categorical.multi_hot:
        block = keys[:, start : start + feature.max_length]
        weights.append(
            pooling_weights(block != missing_key(spec.hashing.namespace, feature.name), feature.pooling)
        )
        start += feature.max_length
    return np.concatenate(weights, axis=1) if weights else np.zeros((keys.shape[0], 0), np.float32)
