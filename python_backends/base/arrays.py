"""Arrays of either kind the steps hand on: numpy on the host, torch tensors on a device.

torch is imported only when a tensor is met, so the default profile's steps stay numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def joined(arrays: list, axis: int) -> np.ndarray | torch.Tensor:
    """Arrays joined on ``axis``: numpy arrays, or torch tensors on their device."""
    if isinstance(arrays[0], np.ndarray):
        return np.concatenate(arrays, axis=axis)
    import torch

    return torch.cat(arrays, dim=axis)


def side_by_side(arrays: list[np.ndarray | torch.Tensor]) -> np.ndarray | torch.Tensor:
    """The arrays (numpy, or torch tensors) joined on their last axis; one array: itself."""
    if len(arrays) == 1:
        return arrays[0]
    if isinstance(arrays[0], np.ndarray):
        return np.concatenate(arrays, axis=-1)
    import torch

    return torch.cat([torch.as_tensor(a) for a in arrays], dim=-1)


def take_rows(array: np.ndarray | torch.Tensor, index: np.ndarray) -> np.ndarray | torch.Tensor:
    """``array[index]`` for a numpy array or a torch tensor (indexed on its own device)."""
    if isinstance(array, np.ndarray):
        return array[index]
    import torch

    return array[torch.as_tensor(index, device=array.device)]
