"""The ``embedding_lookup`` step: keys of all features to vectors, as plain numpy."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from recserve.backends import tensors
from recserve.backends.features import require
from recserve.backends.store import EmbeddingStore
from recserve.spec import ModelSpec


class EmbeddingLookup:
    """Map the keys produced by :class:`~recserve.backends.features.FeatureTransform` to vectors."""

    def __init__(self, spec: ModelSpec, store: EmbeddingStore) -> None:
        self.spec = spec
        self.store = store
        self._sparse_tables = [store.tables[f.table] for f in spec.categorical.features]
        self._target_table = store.tables[spec.target.table]
        self._sequence_table = store.tables[spec.sequence.table]

    def check(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Validate one request's key tensors."""
        sparse = require(inputs, tensors.SPARSE_KEYS, "INT64", None, len(self._sparse_tables))
        rows = sparse.shape[0]
        return {
            tensors.SPARSE_KEYS: sparse,
            tensors.TARGET_KEY: require(inputs, tensors.TARGET_KEY, "INT64", rows, 1),
            tensors.HISTORY_KEYS: require(inputs, tensors.HISTORY_KEYS, "INT64", rows, None),
        }

    def lookup(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Vectors for one batch: ``[B, F, D]`` sparse, ``[B, D]`` target, ``[B, L, D]`` history."""
        checked = self.check(inputs)
        sparse, target, history = (checked[n] for n in (tensors.SPARSE_KEYS, tensors.TARGET_KEY, tensors.HISTORY_KEYS))
        rows = sparse.shape[0]
        dim = self.spec.embedding_dim
        sparse_out = np.empty((rows, len(self._sparse_tables), dim), dtype=np.float32)
        for column, table in enumerate(self._sparse_tables):  # one vectorised lookup per table
            sparse_out[:, column, :] = table.lookup(sparse[:, column])
        return {
            tensors.SPARSE_EMBEDDINGS: sparse_out,
            tensors.TARGET_EMBEDDING: self._target_table.lookup(target[:, 0]),
            tensors.HISTORY_EMBEDDINGS: self._sequence_table.lookup(history),
        }
