"""Raw features to keys: the first half of the ``embedding_lookup`` step, as plain numpy.

Input layout per request (``B`` rows, names from the spec)::

    dense              FP32  [B, 13]   raw integer counts (any value where missing)
    dense__missing     BOOL  [B, 13]   True where the value is absent
    categorical        BYTES [B, 26]   hex strings, b"" when absent
    target_item        INT64 [B, 1]    item id >= 0, or -1 when absent
    history_items      INT64 [B, W]    item ids, newest last, row r valid in [0, length[r])
    history_items__length INT32 [B, 1] 0..max_length

Output: normalised dense values, one key per categorical column and for the target, history keys
padded to the sequence bucket of the longest row, and a mask (1.0 on real positions).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from recserve import wire
from recserve.backends.features.hashing import keys_for, missing_key, table_salt
from recserve.errors import InvalidInput
from recserve.spec import NUMPY_DTYPES, ModelSpec
from recserve.wire import ABSENT_ITEM, parse_hex


def require(
    inputs: Mapping[str, np.ndarray], name: str, dtype: str, rows: int | None, width: int | None
) -> np.ndarray:
    """Fetch one input and check its dtype and 2-D shape ``[rows, width]`` (None: any)."""
    if name not in inputs or inputs[name] is None:
        raise InvalidInput(name, "is required but missing")
    array = inputs[name]
    expected = np.dtype(NUMPY_DTYPES[dtype])
    if array.dtype != expected and not (expected == np.dtype(object) and array.dtype.kind in "SO"):
        raise InvalidInput(name, f"has dtype {array.dtype}, expected {dtype}")
    if array.ndim != 2:
        raise InvalidInput(name, f"has shape {list(array.shape)}, expected [batch, ...] with 2 dims")
    if rows is not None and array.shape[0] != rows:
        raise InvalidInput(name, f"has {array.shape[0]} rows, other inputs have {rows}")
    if width is not None and array.shape[1] != width:
        raise InvalidInput(name, f"has shape {list(array.shape)}, expected [{array.shape[0]}, {width}]")
    return array


class FeatureTransform:
    """Validate raw inputs and turn them into keys, normalised dense values and a sequence mask."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        ns = spec.hash_namespace
        cat = spec.categorical.features
        self._cat_salts = np.array([table_salt(ns, f.table) for f in cat], dtype=np.uint64)
        self._cat_missing = np.array([missing_key(ns, f.name) for f in cat], dtype=np.int64)
        self._item_salt = table_salt(ns, spec.sequence.table)
        self._target_salt = table_salt(ns, spec.target.table)
        self._target_missing = missing_key(ns, spec.target.name)
        self._pad_key = missing_key(ns, spec.sequence.name)

    def transform(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Validate one request's raw tensors and compute the keys the lookup step needs.

        Raises:
            InvalidInput: naming the first offending input and value.
        """
        spec = self.spec
        dense = require(inputs, spec.dense.name, "FP32", None, len(spec.dense.columns))
        rows = dense.shape[0]
        if rows < 1 or rows > spec.max_batch_size:
            raise InvalidInput(spec.dense.name, f"batch of {rows} rows outside 1..{spec.max_batch_size}")
        missing = require(inputs, spec.dense_missing_input, "BOOL", rows, len(spec.dense.columns))
        categorical = require(inputs, spec.categorical.name, "BYTES", rows, len(spec.categorical.features))
        target = require(inputs, spec.target.name, "INT64", rows, 1)
        history = require(inputs, spec.sequence.name, "INT64", rows, None)
        lengths = require(inputs, spec.sequence_length_input, "INT32", rows, 1)
        values, empty = parse_hex(categorical, spec.categorical.max_hex_digits, spec.categorical.name)
        return {
            wire.DENSE_NORMALIZED: self.dense_values(dense, missing),
            wire.SPARSE_KEYS: self.categorical_keys(values, empty),
            wire.TARGET_KEY: self.target_keys(target),
            **self.history(history, lengths[:, 0]),
        }

    def dense_values(self, values: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """Normalised dense values ``log1p(clip(x))``, missing as 0; rejects NaN and Inf."""
        bad = ~np.isfinite(values) & ~missing
        if bad.any():
            r, c = (int(i) for i in np.argwhere(bad)[0])
            name = self.spec.dense.name
            raise InvalidInput(
                name,
                f"{self.spec.dense.columns[c]} (row {r}) is {values[r, c]}; "
                f"send missing values via {name}__missing",
            )
        clipped = np.clip(np.where(missing, 0.0, values), self.spec.dense.clip_min, self.spec.dense.clip_max)
        return np.log1p(clipped).astype(np.float32)

    def categorical_keys(self, values: np.ndarray, empty: np.ndarray) -> np.ndarray:
        """Keys ``[B, F]`` of parsed categorical values; empty values get their feature's missing key."""
        keys = keys_for(values, self._cat_salts[None, :])
        return np.where(empty, self._cat_missing[None, :], keys)

    def target_keys(self, target: np.ndarray) -> np.ndarray:
        """Keys ``[B, 1]`` of target item ids (-1: absent, its missing key)."""
        bad = target < ABSENT_ITEM
        if bad.any():
            r = int(np.argwhere(bad)[0][0])
            raise InvalidInput(
                self.spec.target.name, f"row {r} is {int(target[r, 0])}; ids are >= 0, -1 means absent"
            )
        keys = keys_for(target.astype(np.uint64), self._target_salt)
        return np.where(target == ABSENT_ITEM, self._target_missing, keys)

    def history(self, items: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """History keys and mask, padded (or truncated) to the sequence bucket of the longest row."""
        seq = self.spec.sequence
        name, length_name = seq.name, self.spec.sequence_length_input
        bad = (lengths < 0) | (lengths > seq.max_length) | (lengths > items.shape[1])
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise InvalidInput(
                length_name,
                f"row {r} is {int(lengths[r])}; allowed 0..{seq.max_length} and at most the width "
                f"{items.shape[1]} of {name}",
            )
        if items.shape[1] > seq.max_length and items[:, seq.max_length :].any():
            raise InvalidInput(name, f"has width {items.shape[1]}, longer than the maximum {seq.max_length}")
        bucket = self.spec.sequence_bucket(max(int(lengths.max()), 1))
        width = min(bucket, items.shape[1])
        positions = np.arange(bucket)[None, :]
        mask = positions < lengths[:, None]
        window = np.zeros((items.shape[0], bucket), dtype=np.int64)
        window[:, :width] = items[:, :width]
        negative = (window < 0) & mask
        if negative.any():
            r, p = (int(i) for i in np.argwhere(negative)[0])
            raise InvalidInput(name, f"row {r} position {p} is {int(window[r, p])}; item ids are >= 0")
        keys = np.where(mask, keys_for(window.astype(np.uint64), self._item_salt), self._pad_key)
        return {wire.HISTORY_KEYS: keys, wire.HISTORY_MASK: mask.astype(np.float32)}


def vocabulary_keys(spec: ModelSpec, table: str, tokens: list[object]) -> np.ndarray:
    """The keys serving computes for raw values of ``table``'s feature, written as clients send them.

    Hex tables take strings (``"05db9164"``; case and leading zeros do not matter; ``""`` is the
    feature's empty value); the item table takes ids >= 0 (ints, or strings of decimal digits; -1 is
    an absent target item). The
    same parsing and hashing as :class:`FeatureTransform`, so an imported vocabulary row is served
    exactly for the values that name it.

    Raises:
        InvalidInput: a token is not a value of that feature (named with its position).
    """
    ns = spec.hash_namespace
    hex_features = {f.table: f for f in spec.categorical.features}
    where = f"{table}.vocab"
    if table in hex_features:
        if not all(isinstance(t, str) for t in tokens):
            i, bad = next((i, t) for i, t in enumerate(tokens) if not isinstance(t, str))
            raise InvalidInput(where, f"token {i} is {bad!r}; this table's values are hex strings")
        values, empty = parse_hex(np.array(tokens, dtype=object), spec.categorical.max_hex_digits, where)
        keys = keys_for(values, table_salt(ns, table))
        return np.where(empty, missing_key(ns, hex_features[table].name), keys)
    if table not in (spec.target.table, spec.sequence.table):
        raise InvalidInput(where, f"{table!r} is not a table of spec {spec.name!r}")
    ids = np.empty(len(tokens), np.int64)
    for i, token in enumerate(tokens):
        text = str(token) if isinstance(token, int) and not isinstance(token, bool) else token
        if (
            not isinstance(text, str)
            or not (text.isdigit() or text == str(ABSENT_ITEM))
            or int(text) >= 1 << 63
        ):
            raise InvalidInput(
                where, f"token {i} is {token!r}; this table's values are ids >= 0 (-1: absent)"
            )
        ids[i] = int(text)
    keys = keys_for(ids.astype(np.uint64), table_salt(ns, table))
    return np.where(ids == ABSENT_ITEM, missing_key(ns, spec.target.name), keys)
