"""The attention's key space of a built repository: where the user-state builder groups items.

An item's key vector is the first attention's key projection of the item's embedding row (the
row the lookup step would serve for it), so two items close in this space get close attention
logits from every target. An imported network's attention is not known: there the key is the item's
embedding row itself (what any attention over it reads).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from recserve.backends.base.artifacts import model_versions
from recserve.backends.features.hashing import keys_for, table_salt
from recserve.backends.store.tiered import TieredStore
from recserve.core.names import DENSE, EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec

LOGGER = logging.getLogger(__name__)

#: The built-in network's weights in a dense version folder, and its first attention's key projection.
WEIGHTS_FILE = "weights.safetensors"
KEY_WEIGHT, KEY_BIAS = "attention.key.weight", "attention.key.bias"


@dataclass
class RepositoryKeySpace:
    """Item ids to key vectors, from the store as served and one version of the dense network."""

    store: TieredStore
    table: str
    salt: np.uint64
    weight: np.ndarray  # [dim, width]
    bias: np.ndarray  # [dim]
    dense_version: int

    @property
    def versions(self) -> tuple[int, int]:
        """(the item table's version the store serves now, the dense model's version)."""
        return int(self.store.version_of(self.table)), self.dense_version

    @classmethod
    def load(
        cls, spec: ModelSpec, repository: Path, version: int = 1, store: TieredStore | None = None
    ) -> RepositoryKeySpace:
        """The key space of ``repository``'s version ``version`` (its lookup and dense folders).

        ``store``: the lookup store to read rows from (one that follows online updates), instead of
        the version folder's tables as built.

        Without the built-in network's weights in the dense folder (an imported model) the key is
        the item's row: an identity projection, kept whatever dense version comes.

        Raises:
            ValueError: the spec has no sequence.
        """
        if spec.sequence is None:
            raise ValueError(f"spec {spec.name!r} has no sequence: there is no user state to build")
        store = store or TieredStore.load(repository / EMBEDDING_LOOKUP / str(version), spec)
        table = spec.sequence.table
        salt = table_salt(spec.hashing.namespace, table)
        if not (repository / DENSE / str(version) / WEIGHTS_FILE).is_file():
            width = spec.tables[table].dim
            return cls(store, table, salt, np.eye(width, dtype=np.float32), np.zeros(width, np.float32), 0)
        weight, bias = _key_projection(repository / DENSE / str(version))
        return cls(store, table, salt, weight, bias, version)

    def newer_dense(self, repository: Path) -> bool:
        """Take the key projection of ``repository``'s newest dense version above this one; whether one was.

        A version folder without the network's weights, or with weights of another shape (still
        being written, or another model), is passed over, logged.
        """
        folder = repository / DENSE
        if not self.dense_version:  # an imported network: the rows themselves, whatever its version
            return False
        numbers = model_versions(folder) if folder.is_dir() else []
        for number in reversed([n for n in numbers if n > self.dense_version]):
            try:
                weight, bias = _key_projection(folder / str(number))
            except (OSError, ValueError, KeyError) as exc:
                LOGGER.warning("dense version %d: no usable key projection (%s); passed over", number, exc)
                continue
            if weight.shape != self.weight.shape or bias.shape != self.bias.shape:
                LOGGER.warning("dense version %d: key projection of another shape; passed over", number)
                continue
            self.weight, self.bias, self.dense_version = weight, bias, number
            return True
        return False

    def __call__(self, items: np.ndarray) -> np.ndarray:
        """Key vectors ``[n, dim]`` of item ids ``items``."""
        keys = keys_for(np.asarray(items, np.int64).astype(np.uint64), self.salt)
        ids = np.full(keys.size, self.store.table_id(self.table), np.int16)
        rows = self.store.lookup(keys, ids, record=False).vectors[:, : self.weight.shape[1]]
        return rows @ self.weight.T + self.bias


def _key_projection(dense_version_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The first attention's key projection (weight, bias) in a dense version folder."""
    weights = load_file(str(dense_version_dir / WEIGHTS_FILE))
    return weights[KEY_WEIGHT], weights[KEY_BIAS]
