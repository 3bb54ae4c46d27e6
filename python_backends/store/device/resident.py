"""Rows held on a torch device by key: a sorted int64 key tensor and its vectors, searched there.

The device tier (:mod:`.device.tier`) holds each resident shard, and the served version's delta
rows, as one :class:`SortedRows`; ``torch.searchsorted`` and a gather answer a batch's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recserve.backends.store.table_data import RowBlock

#: Device bytes of one resident row besides its vector: its int64 key.
KEY_BYTES = 8


@dataclass(frozen=True)
class SortedRows:
    """Rows on a device by key: ``keys`` ascending int64 ``[n]``, ``vectors`` float32 ``[n, dim]``."""

    keys: torch.Tensor
    vectors: torch.Tensor

    @classmethod
    def of(cls, keys: np.ndarray, vectors: np.ndarray, dim: int, device: torch.device) -> SortedRows:
        """Sort ``keys`` (unique) with their rows, widen the rows to ``dim`` (zeros), copy to ``device``."""
        order = np.argsort(keys, kind="stable")
        wide = np.zeros((len(keys), dim), np.float32)
        wide[:, : vectors.shape[1]] = vectors[order] if len(keys) else wide[:, : vectors.shape[1]]
        return cls(
            torch.from_numpy(np.ascontiguousarray(keys[order], np.int64)).to(device),
            torch.from_numpy(wide).to(device),
        )

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each key's row (clamped into range) and whether it is here."""
        if self.keys.numel() == 0:
            return torch.zeros_like(keys), torch.zeros(keys.shape, dtype=torch.bool, device=keys.device)
        rows = torch.searchsorted(self.keys, keys).clamp_(max=self.keys.numel() - 1)
        return rows, self.keys.index_select(0, rows) == keys

    @property
    def nbytes(self) -> int:
        """Device bytes of the keys and vectors."""
        return self.keys.numel() * KEY_BYTES + self.vectors.numel() * self.vectors.element_size()


@dataclass(frozen=True)
class DeviceDelta:
    """The delta rows of one served version on the device (``rows`` None: no delta)."""

    source: RowBlock | None
    rows: SortedRows | None
