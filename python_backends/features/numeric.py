"""The numeric features: each one's value from the column it reads, then its ops (fill, clip, log1p, scale).

A numeric feature reads its own column of the ``dense`` wire tensor, or another feature's column
(``column = "..."``): a numeric column of ``dense``, or an int64 / uint64 column of ``categorical``
read as a number. The wire carries every column once. A missing flag (``missing_flag = true``) is a
feature of its own reading its feature's column: 1.0 where that value is missing, else 0.0.
"""

from __future__ import annotations

import numpy as np

from recserve.backends.features.request_checks import check_finite
from recserve.core.spec.model import ModelSpec


class NumericOps:
    """Every numeric feature's raw value and missing mask, and the normalised dense values."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        numeric = spec.dense.numeric if spec.dense else ()
        self._normalized = np.array(spec.dense.normalized if spec.dense else (), dtype=np.intp)
        self._fill = np.array([c.fill_na for c in numeric], dtype=np.float32)
        self._low = np.array([c.clip_min for c in numeric], dtype=np.float32)
        self._high = np.array([c.clip_max for c in numeric], dtype=np.float32)
        self._log1p = np.array([c.log1p for c in numeric])
        self._shift = np.array([c.shift for c in numeric], dtype=np.float32)
        self._scale = np.array([c.scale for c in numeric], dtype=np.float32)
        self._wire = np.array(spec.dense.wire_index if spec.dense else (), dtype=np.intp)
        self._indicator = np.array([c.indicator for c in numeric], dtype=bool)
        self._flags = bool(self._indicator.any())  # any missing flag: decided once, not per batch
        self._signed = {
            c.categorical: spec.categorical.raw_columns[c.categorical].value_type == "int64"
            for c in numeric
            if c.categorical >= 0
        }

    def features(
        self, values: np.ndarray, missing: np.ndarray, parsed: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every numeric feature's raw value and missing mask ``[B, N]`` from the wire's columns ``[B, W]``.

        A feature reading another numeric column takes that column; one reading an int64 / uint64
        categorical column takes its number from ``parsed`` (the parsed categorical columns and
        their empty mask; an empty field is missing). Without such features: the wire's columns.
        """
        dense = self.spec.dense
        assert dense is not None
        if not dense.derived:
            return values, missing
        rows, index = len(values), np.maximum(self._wire, 0)
        out = values[:, index] if values.shape[1] else np.zeros((rows, len(index)), np.float32)
        absent = missing[:, index] if values.shape[1] else np.ones((rows, len(index)), bool)
        out, absent = out.astype(np.float32), np.array(absent, bool)
        for i, column in enumerate(dense.numeric):
            if column.categorical >= 0:
                assert parsed is not None, "a numeric feature reads a categorical column: pass it parsed"
                raw = parsed[0][:, column.categorical]
                out[:, i] = (raw.view(np.int64) if self._signed[column.categorical] else raw).astype(
                    np.float32
                )
                absent[:, i] = parsed[1][:, column.categorical]
        return out, absent

    def normalize(
        self, values: np.ndarray, missing: np.ndarray, parsed: tuple[np.ndarray, np.ndarray] | None = None
    ) -> np.ndarray:
        """Normalised dense values ``[B, len(normalized)]`` of the wire's columns (see :meth:`features`).

        Raises:
            InvalidInput: a value that is not missing is NaN or infinite (naming its column and row).
        """
        dense = self.spec.dense
        assert dense is not None
        check_finite(dense.name, dense.columns, values, missing)
        values, missing = self.features(values, missing, parsed)
        clipped = np.clip(np.where(missing, self._fill, values), self._low, self._high)
        # log1p in float64, rounded to float32: the same bits on every device (float32 log1p is not;
        # see recserve.backends.features.device_transform)
        logged = np.where(
            self._log1p, np.log1p(np.where(self._log1p, clipped, 0.0).astype(np.float64)), clipped
        ).astype(np.float32)
        normalized = ((logged - self._shift) / self._scale).astype(np.float32)
        if self._flags:  # missing flags: 1.0 where the column they read is missing
            normalized = np.where(self._indicator, missing.astype(np.float32), normalized)
        return normalized if len(self._normalized) == values.shape[1] else normalized[:, self._normalized]
