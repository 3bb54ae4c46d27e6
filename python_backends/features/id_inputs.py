"""The id form of a request read into the raw values the keys are made of, with whole-array numpy only.

The id form (:mod:`recserve.core.wire_forms`) carries each categorical, time and multi-hot value as
the 64-bit id the value codec makes of its text, so reading it is a few array operations per batch,
whatever its size: no decoding, parsing or hashing per element. The result has the layout of the
bytes form's parsed values (:func:`recserve.core.values.categorical_values`,
:func:`~recserve.core.values.multi_hot_values`), so both forms go on to the same key making.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from recserve.backends.base.inputs import require
from recserve.backends.features.request_checks import check_rows
from recserve.core.spec.model import ModelSpec
from recserve.core.times import LAST_SECOND
from recserve.core.wire_forms import IdList
from recserve.errors import InvalidInput

_NO_LIMIT = np.uint64(np.iinfo(np.uint64).max)


@dataclass(frozen=True)
class RawValues:
    """A request's categorical values as the key making reads them, whichever the wire form.

    Attributes:
        values: uint64 ``[B, C]``, one per raw column (multi-hot columns: 0).
        empty: bool ``[B, C]``, True where a value is empty.
        lists: per multi-hot raw column (by index): its values uint64 ``[B, max_length]`` and the
            mask of a row's real positions (its first ones).
    """

    values: np.ndarray
    empty: np.ndarray
    lists: dict[int, tuple[np.ndarray, np.ndarray]]

    @property
    def rows(self) -> int:
        """The batch's rows."""
        return int(self.values.shape[0])


class IdReader:
    """Checks a request of the id form and lays its ids out as :class:`RawValues`.

    An id is refused where the bytes form would refuse its text: a hex value wider than its column's
    ``max_hex_digits``, a time before 1970 (a negative number of seconds); and a time after 9999.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.form = spec.wire_form("ids")
        group = spec.categorical
        self.columns = len(group.raw_columns)
        self.single = np.array(self.form.single, dtype=np.intp)
        self.limits = np.array([self._limit(i) for i in self.form.single], dtype=np.uint64)
        self.limited = bool((self.limits != _NO_LIMIT).any())
        self.list_limits = {item.column: self._limit(item.column) for item in self.form.lists}

    def _limit(self, column: int) -> np.uint64:
        """The largest id (as uint64) the bytes form could give a raw column."""
        raw = self.spec.categorical.raw_columns[column]
        if raw.value_type == "hex" and raw.max_hex_digits < 16:
            return np.uint64((1 << (4 * raw.max_hex_digits)) - 1)
        if raw.value_type == "time":
            return np.uint64(LAST_SECOND)
        return _NO_LIMIT

    def read(self, inputs: Mapping[str, np.ndarray]) -> RawValues:
        """The raw values of one (merged) request of the id form.

        Raises:
            InvalidInput: a tensor has the wrong dtype or shape, the batch is outside
                ``1..max_batch_size`` rows, an id is outside its column's range, or a length is
                outside ``0..width`` (naming the input, and the column and row where it applies).
        """
        ids, missing = self.single_ids(inputs)
        rows, unsigned = ids.shape[0], ids.view(np.uint64)
        values = np.zeros((rows, self.columns), dtype=np.uint64)
        empty = np.zeros((rows, self.columns), dtype=bool)
        values[:, self.single] = np.where(missing, np.uint64(0), unsigned)  # as the bytes form's empty
        empty[:, self.single] = missing
        lists = {item.column: self._list(inputs, item, rows) for item in self.form.lists}
        return RawValues(values, empty, lists)

    def single_ids(self, inputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The checked ids ``[B, S]`` of the single-valued raw columns, and their missing mask.

        Raises:
            InvalidInput: as :meth:`read`, for these two tensors.
        """
        form = self.form
        ids = require(inputs, form.marker, "INT64", None, len(form.single))
        check_rows(form.marker, ids.shape[0], self.spec.model.max_batch_size)
        missing = require(inputs, form.missing, "BOOL", ids.shape[0], len(form.single))
        if self.limited:
            self._check(ids.view(np.uint64), self.limits[None, :], ~missing, form.marker, self.single)
        return ids, missing

    def _list(
        self, inputs: Mapping[str, np.ndarray], item: IdList, rows: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """One multi-hot column's values ``[B, max_length]`` and mask (the first ``max_length`` kept)."""
        column = self.spec.categorical.raw_columns[item.column]
        ids = require(inputs, item.values, "INT64", rows, None)
        lengths = require(inputs, item.length, "INT32", rows, 1)[:, 0]
        bad = (lengths < 0) | (lengths > ids.shape[1])
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise InvalidInput(
                item.length,
                f"row {r} is {int(lengths[r])}; allowed 0..{ids.shape[1]}, the width of {item.values}",
            )
        kept = min(ids.shape[1], column.max_length)
        values = np.zeros((rows, column.max_length), dtype=np.uint64)
        values[:, :kept] = ids[:, :kept].view(np.uint64)
        mask = np.arange(column.max_length)[None, :] < lengths[:, None]
        limit = self.list_limits[item.column]
        if limit != _NO_LIMIT:
            self._check(values, limit, mask, item.values, item.column)
        return np.where(mask, values, np.uint64(0)), mask

    def _check(
        self,
        values: np.ndarray,
        limit: np.ndarray | np.uint64,
        real: np.ndarray,
        name: str,
        columns: np.ndarray | int,
    ) -> None:
        """Refuse the first id above its limit among the ``real`` positions, naming its row (and column).

        ``columns``: the raw column of each of ``values``' columns, or the one multi-hot column.
        """
        bad = (values > limit) & real
        if not bad.any():
            return
        r, c = (int(i) for i in np.argwhere(bad)[0])
        single = isinstance(columns, np.ndarray)
        raw = self.spec.categorical.raw_columns[
            int(columns[c]) if isinstance(columns, np.ndarray) else columns
        ]
        where = f"{raw.name} (row {r})" if single else f"row {r} position {c}"
        kind = (
            f"a hex value of at most {raw.max_hex_digits} digits"
            if raw.value_type == "hex"
            else f"unix seconds in 0..{LAST_SECOND}"
        )
        raise InvalidInput(name, f"{where} is {int(values[r : r + 1, c].view(np.int64)[0])}: not {kind}")
