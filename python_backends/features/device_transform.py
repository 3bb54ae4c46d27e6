"""The feature transform's arithmetic as torch ops on the step's device, bit for bit the host's.

Keys: ``splitmix64(salt XOR value)`` (:mod:`.hashing`) in int64 torch arithmetic. torch has no
uint64 arithmetic, but int64 addition and multiplication wrap modulo 2**64 with the same bits as
uint64's, XOR is bitwise, and a logical right shift is the arithmetic one with the sign bits
masked off; constants above 2**63 are written as the int64 with the same bits.

Dense values: fill, clip, log1p, shift and scale as in
:meth:`~recserve.backends.features.transform.FeatureTransform.dense_values`, in float32, with log1p
computed in float64 and rounded to float32 there and here (float32 log1p differs between numpy and
torch, and between CPU and GPU, in the last bit; the float64 ones round to the same float32).
Validation (NaN, Inf, ranges) stays on the host, where errors name the input and the value.
"""

from __future__ import annotations

import numpy as np
import torch

from recserve.core.spec.model import ModelSpec

_MASK64 = (1 << 64) - 1


def int64_bits(value: int) -> int:
    """The int64 whose bits are those of the unsigned 64-bit ``value`` (``value`` modulo 2**64)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = int64_bits(0x9E3779B97F4A7C15)
_MIX1 = int64_bits(0xBF58476D1CE4E5B9)
_MIX2 = int64_bits(0x94D049BB133111EB)


#: the multiplicative inverses of the mixing constants modulo 2**64 (for :func:`unmix64`)
_UNMIX1, _UNMIX2 = (np.uint64(pow(c, -1, 1 << 64)) for c in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def unmix64(keys: np.ndarray | np.integer) -> np.ndarray:
    """The int64 values whose :func:`splitmix64` are ``keys`` (int64): the finaliser is a bijection.

    Each xor-shift is undone by xoring the further shifts, each multiplication by the constant's
    inverse modulo 2**64, the addition by a subtraction; numpy's uint64 arithmetic wraps as the
    finaliser's does.
    """
    z = np.asarray(keys, np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z ^ (z >> np.uint64(31)) ^ (z >> np.uint64(62))
        z = z * _UNMIX2
        z = z ^ (z >> np.uint64(27)) ^ (z >> np.uint64(54))
        z = z * _UNMIX1
        z = z ^ (z >> np.uint64(30)) ^ (z >> np.uint64(60))
        z = z - np.uint64(0x9E3779B97F4A7C15)
    return np.asarray(z).view(np.int64)


def shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``bits`` (1..63): the uint64 shift's bits."""
    return torch.bitwise_and(torch.bitwise_right_shift(z, bits), (1 << (64 - bits)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """:func:`recserve.backends.features.hashing.splitmix64` on int64 tensors (same bits)."""
    z = z + _GOLDEN
    z = torch.bitwise_xor(z, shift_right(z, 30)) * _MIX1
    z = torch.bitwise_xor(z, shift_right(z, 27)) * _MIX2
    return torch.bitwise_xor(z, shift_right(z, 31))


def keys_for(values: torch.Tensor, salt: int | np.integer | torch.Tensor) -> torch.Tensor:
    """:func:`recserve.backends.features.hashing.keys_for` on int64 tensors (a value's bits as uint64's).

    Args:
        values: int64 raw values (an id, or the bits of a uint64 value).
        salt: one table's salt (any int, read modulo 2**64), or an int64 tensor of salts that
            broadcasts against ``values``.
    """
    if not isinstance(salt, torch.Tensor):
        salt = int64_bits(int(salt))
    return splitmix64(torch.bitwise_xor(values, salt))


def masked_keys(
    values: torch.Tensor, mask: torch.Tensor, salt: int | np.integer, missing: int | np.integer
) -> torch.Tensor:
    """Keys of ``values`` where ``mask``, the feature's missing key elsewhere (as the host's ``np.where``)."""
    absent = torch.tensor(int(missing), dtype=torch.int64, device=values.device)
    return torch.where(mask, keys_for(values, salt), absent)


class DeviceNormalizer:
    """The host's ``FeatureTransform.dense_values`` without its checks, as torch ops on ``device``.

    Args:
        spec: the model spec (its numeric columns' fill, clip, log1p, shift and scale).
        device: the torch device of the step.
    """

    def __init__(self, spec: ModelSpec, device: str | torch.device) -> None:
        self.device = torch.device(device)
        numeric = spec.dense.numeric if spec.dense else ()

        def put(values: list, dtype: type = np.float32) -> torch.Tensor:
            return torch.from_numpy(np.array(values, dtype=dtype)).to(self.device)

        self.fill = put([c.fill_na for c in numeric])
        self.low = put([c.clip_min for c in numeric])
        self.high = put([c.clip_max for c in numeric])
        self.log1p = put([c.log1p for c in numeric], bool)
        self.shift = put([c.shift for c in numeric])
        self.scale = put([c.scale for c in numeric])
        normalized = list(spec.dense.normalized) if spec.dense else []
        self.columns = None if len(normalized) == len(numeric) else put(normalized, np.int64)
        # features reading another numeric column (missing flags among them) gather it from the wire's
        derived = spec.dense is not None and spec.dense.derived
        self.wire = put(list(spec.dense.wire_index), np.int64) if derived and spec.dense else None
        self.indicator = (
            put([c.indicator for c in numeric], bool) if any(c.indicator for c in numeric) else None
        )

    def __call__(self, values: torch.Tensor, missing: torch.Tensor) -> torch.Tensor:
        """Normalised float32 ``[B, normalised columns]`` of checked ``values`` and ``missing`` ``[B, C]``.

        ``values`` and ``missing`` are the wire's columns; a feature reading another numeric column
        takes it from them (features reading a categorical column are made on the host).
        """
        if self.wire is not None:
            values, missing = values.index_select(1, self.wire), missing.index_select(1, self.wire)
        filled = torch.where(missing, self.fill, values)
        # np.clip's comparisons (not torch.clamp's), so a -0.0 clipped at 0.0 comes out as numpy's
        raised = torch.where(filled > self.low, filled, self.low)
        clipped = torch.where(raised < self.high, raised, self.high)
        logged = torch.where(
            self.log1p,
            torch.log1p(torch.where(self.log1p, clipped, 0.0).double()).float(),
            clipped,
        )
        normalized = (logged - self.shift) / self.scale
        if self.indicator is not None:  # missing flags: 1.0 where the column they read is missing
            normalized = torch.where(self.indicator, missing.float(), normalized)
        return normalized if self.columns is None else normalized.index_select(1, self.columns)


def right_align(tensor: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """:func:`recserve.backends.features.transform.right_align` on a ``[rows, positions]`` tensor."""
    positions = tensor.shape[1]
    source = torch.arange(positions, device=tensor.device)[None, :] - (positions - lengths.long())[:, None]
    real = source >= 0
    picked = torch.gather(tensor, 1, torch.where(real, source, 0))
    return torch.where(real, picked, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
