"""The attention's key space of a built repository: where the user-state builder groups items.

An item's key vector is the first attention's key projection of the item's embedding row (the
row the lookup step would serve for it), so two items close in this space get close attention
logits from every target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from recserve.backends.features.hashing import keys_for, table_salt
from recserve.backends.store.tiered import TieredStore
from recserve.core.names import DENSE, EMBEDDING_LOOKUP
from recserve.core.spec import ModelSpec

#: The built-in network's weights in a dense version folder, and its first attention's key projection.
WEIGHTS_FILE = "weights.safetensors"
KEY_WEIGHT, KEY_BIAS = "attention.key.weight", "attention.key.bias"


@dataclass
class RepositoryKeySpace:
    """Item ids to key vectors, from one version of the store and of the dense network."""

    store: TieredStore
    table: str
    salt: np.uint64
    weight: np.ndarray  # [dim, width]
    bias: np.ndarray  # [dim]
    versions: tuple[int, int]  # (the item table's version, the dense model's version)

    @classmethod
    def load(cls, spec: ModelSpec, repository: Path, version: int = 1) -> RepositoryKeySpace:
        """The key space of ``repository``'s version ``version`` (its lookup and dense folders).

        Raises:
            ValueError: the spec has no sequence.
            FileNotFoundError: the dense folder has no weights of the built-in network (an imported model).
        """
        if spec.sequence is None:
            raise ValueError(f"spec {spec.name!r} has no sequence: there is no user state to build")
        store = TieredStore.load(repository / EMBEDDING_LOOKUP / str(version), spec)
        weights = load_file(str(repository / DENSE / str(version) / WEIGHTS_FILE))
        table = spec.sequence.table
        versions = (int(store.version_of(table)), version)
        salt = table_salt(spec.hashing.namespace, table)
        return cls(store, table, salt, weights[KEY_WEIGHT], weights[KEY_BIAS], versions)

    def __call__(self, items: np.ndarray) -> np.ndarray:
        """Key vectors ``[n, dim]`` of item ids ``items``."""
        keys = keys_for(np.asarray(items, np.int64).astype(np.uint64), self.salt)
        ids = np.full(keys.size, self.store.table_id(self.table), np.int16)
        rows = self.store.lookup(keys, ids, record=False).vectors[:, : self.weight.shape[1]]
        return rows @ self.weight.T + self.bias
