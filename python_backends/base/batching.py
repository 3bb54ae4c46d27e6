"""Merge the requests of one dynamic batch into one array per tensor, and split results back.

Triton hands a Python-backend model a list of requests; ragged tensors (sequence positions) may
differ in width between requests. Merging zero-pads them to the widest request (padding positions
carry mask 0 and never change a row's result), so one vectorised call serves the whole batch.
Sequences padded on the left (``padding = "left"`` in the spec) are padded and cut on the left.
A device step's tensors (torch, handed over through DLPack) are merged on their device with
``torch.cat``: one concatenation per tensor, whatever the number of requests. What a step returns
once per request (the versions that served it: :data:`~recserve.core.names.PER_REQUEST_OUTPUTS`)
is made once for the merged batch, and every request gets that one row.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from recserve.core.names import PER_REQUEST_OUTPUTS


def merge(
    batch: Sequence[Mapping[str, np.ndarray]], left: Collection[str] = ()
) -> tuple[dict[str, np.ndarray], list[int]]:
    """Concatenate per-request tensors along rows; pad axis 1 of ragged ones to the widest.

    Args:
        batch: each request's tensors.
        left: the ragged tensors padded on the left (their positions end at the last column).
    """
    sizes = [len(next(iter(item.values()))) for item in batch]
    if len(batch) == 1:
        return dict(batch[0]), sizes
    merged = {}
    for name in batch[0]:
        parts = [item[name] for item in batch]
        width = max(p.shape[1] for p in parts) if parts[0].ndim >= 2 else 0
        ragged = parts[0].ndim >= 2 and any(p.shape[1] != width for p in parts)
        if isinstance(parts[0], np.ndarray):
            merged[name] = _padded(parts, width, name in left) if ragged else np.concatenate(parts)
        else:
            merged[name] = _cat([_pad_axis1(p, width, name in left) for p in parts] if ragged else parts)
    return merged, sizes


def _padded(parts: Sequence[np.ndarray], width: int, left: bool) -> np.ndarray:
    """The parts, of different widths (axis 1), in one array: one allocation, one copy per part."""
    first = parts[0]
    rows = sum(part.shape[0] for part in parts)  # a tensor's own rows (a list's history: one per user)
    # BYTES (object) tensors: padded with empty elements, the padding of a multi-hot list
    out = np.full((rows, width, *first.shape[2:]), b"" if first.dtype == object else 0, first.dtype)
    row = 0
    for part in parts:
        start = width - part.shape[1] if left else 0
        out[row : row + part.shape[0], start : start + part.shape[1]] = part
        row += part.shape[0]
    return out


def _cat(parts: Sequence[Any]) -> Any:
    """Torch tensors joined along rows on their device.

    Parts on different devices (a GPU step's inputs that Triton placed in host memory when its CUDA
    pool was full) are joined on the first part's device that is not the host.
    """
    import torch

    device = next((p.device for p in parts if p.device.type != "cpu"), parts[0].device)
    return torch.cat([p.to(device) for p in parts], dim=0)


def _pad_axis1(array: Any, width: int, left: bool) -> Any:
    """A torch tensor padded with zeros on its device to ``width`` along axis 1."""
    import torch

    missing = width - array.shape[1]
    zeros = torch.zeros((array.shape[0], missing, *array.shape[2:]), dtype=array.dtype, device=array.device)
    return torch.cat([zeros, array] if left else [array, zeros], dim=1)


def split(
    outputs: Mapping[str, np.ndarray],
    sizes: Sequence[int],
    widths: Mapping[str, Sequence[int]] | None = None,
    left: Collection[str] = (),
    whole: Collection[str] = PER_REQUEST_OUTPUTS,
) -> list[dict[str, np.ndarray]]:
    """Split merged outputs back into per-request outputs.

    Args:
        outputs: merged tensors, rows first.
        sizes: rows of each request, in order.
        widths: for ragged outputs, each request's own width along axis 1 (padding is cut off).
        left: the ragged outputs padded on the left: each request keeps its last columns.
        whole: the outputs made once for the merged batch (one row: the versions that served it);
            every request gets them as they are.
    """
    widths = widths or {}
    if len(sizes) == 1 and not widths:  # one request: its outputs are the merged ones
        return [dict(outputs)]
    bounds = np.cumsum([0, *sizes])
    result = []
    for i in range(len(sizes)):
        part = {}
        for name, array in outputs.items():
            if name in whole:
                part[name] = array
                continue
            piece = array[bounds[i] : bounds[i + 1]]
            if name in widths:
                width = widths[name][i]
                piece = piece[:, piece.shape[1] - width :] if name in left else piece[:, :width]
            part[name] = piece
        result.append(part)
    return result


def groups_within(rows: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive indices grouped so that each group's ``rows`` sum to at most ``limit``.

    For requests joined into one call within a batch limit; one over the limit is a group of its own.
    """
    groups: list[list[int]] = []
    total = 0
    for index, count in enumerate(rows):
        if groups and total + count <= limit:
            groups[-1].append(index)
            total += count
        else:
            groups.append([index])
            total = count
    return groups
