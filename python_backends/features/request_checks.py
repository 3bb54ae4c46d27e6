"""The request checks of the feature step: value ranges, shapes and empty masks, as whole-array numpy.

Both ways of making keys run them first, on the host tensors a request arrived in: the host
transform (:class:`~recserve.backends.features.transform.FeatureTransform`) and the device one
(:class:`~recserve.backends.features.device_keys.DeviceKeys`). So a request is refused by the same
check, with the same message naming the input and the offending value, whichever makes its keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recserve.core.spec.types import CategoricalFeature, SequenceFeature
from recserve.core.values import ABSENT_ITEM
from recserve.errors import InvalidInput


def check_rows(name: str, rows: int, max_batch_size: int) -> None:
    """Refuse a batch outside ``1..max_batch_size`` rows, naming the input ``name`` that holds it."""
    if rows < 1 or rows > max_batch_size:
        raise InvalidInput(name, f"batch of {rows} rows outside 1..{max_batch_size}")


def check_finite(name: str, columns: Sequence[str], values: np.ndarray, missing: np.ndarray) -> None:
    """Refuse the first numeric value that is NaN or infinite and not marked missing.

    Args:
        name: the numeric wire input (``dense``).
        columns: its columns' names.
        values: float32 ``[B, C]``.
        missing: bool ``[B, C]``, True where the value is absent.
    """
    bad = ~np.isfinite(values) & ~missing
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        raise InvalidInput(
            name, f"{columns[c]} (row {r}) is {values[r, c]}; send missing values via {name}__missing"
        )


def check_target(target: np.ndarray, feature: CategoricalFeature) -> None:
    """Refuse a target item id below -1 (``[B, 1]``; -1 means absent), naming its row."""
    bad = target < ABSENT_ITEM
    if bad.any():
        r = int(np.argwhere(bad)[0][0])
        raise InvalidInput(feature.name, f"row {r} is {int(target[r, 0])}; ids are >= 0, -1 means absent")


def check_history(
    items: np.ndarray, lengths: np.ndarray, sequence: SequenceFeature, length_name: str
) -> None:
    """Refuse a sequence whose lengths, width or item ids a row cannot have.

    Args:
        items: int64 ``[H, W]``, each row's ids first.
        lengths: ``[H]``, each row's real positions.
        sequence: the sequence feature (its ``max_length``).
        length_name: the length input of its attention group.
    """
    name = sequence.name
    bad = (lengths < 0) | (lengths > sequence.max_length) | (lengths > items.shape[1])
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise InvalidInput(
            length_name,
            f"row {r} is {int(lengths[r])}; allowed 0..{sequence.max_length} and at most the width "
            f"{items.shape[1]} of {name}",
        )
    if items.shape[1] > sequence.max_length and items[:, sequence.max_length :].any():
        raise InvalidInput(name, f"has width {items.shape[1]}, longer than the maximum {sequence.max_length}")
    negative = (items < 0) & (np.arange(items.shape[1])[None, :] < lengths[:, None])
    if negative.any():
        r, p = (int(i) for i in np.argwhere(negative)[0])
        raise InvalidInput(name, f"row {r} position {p} is {int(items[r, p])}; item ids are >= 0")
