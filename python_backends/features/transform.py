"""Raw features to keys: the first half of the ``embedding_lookup`` step, as plain numpy.

Input layout per request (``B`` rows, names from the spec; ``ctr`` shown)::

    dense              FP32  [B, 13]   numeric columns (any value where missing); only with numeric features
    dense__missing     BOOL  [B, 13]   True where the value is absent
    categorical        BYTES [B, 26]   categorical and time columns as strings, b"" when absent; or
    categorical__ids   INT64 [B, 26]   the same values as 64-bit ids, with categorical__missing BOOL
    target_item        INT64 [B, 1]    item id >= 0, or -1 when absent; only with a sequence
    history_items      INT64 [B, W]    item ids, newest last, row r valid in [0, length[r])
    history_items__length INT32 [B, 1] 0..max_length

A multi-hot feature sent as a list (``wire = "list"``) has a BYTES ``[B, W]`` tensor of its own; a
spec with several attention groups has a sequence tensor per sequence and a length per group.

Output: normalised dense values, one key per categorical feature (a time column gives one per
part) and for each target, history keys of every sequence padded to the sequence bucket of the
longest row (on each group's padding side), and a mask per group (1.0 on real positions).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from recserve.backends.base.inputs import require
from recserve.backends.features import compiled_keys, hex_parser
from recserve.backends.features.hashing import keys_for, missing_key, table_salt
from recserve.backends.features.id_inputs import IdReader, RawValues
from recserve.backends.features.numeric import NumericOps
from recserve.backends.features.pooling import pooling_weights
from recserve.backends.features.request_checks import check_history, check_rows, check_target
from recserve.core.contract import attention_inputs
from recserve.core.names import (
    DENSE_NORMALIZED,
    HISTORY_KEYS,
    HISTORY_MASK,
    IDS_WIRE,
    MULTI_HOT_KEYS,
    MULTI_HOT_WEIGHTS,
    SPARSE_KEYS,
    TARGET_KEY,
)
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import CategoricalFeature, Feature, SequenceFeature
from recserve.core.times import time_part
from recserve.core.values import ABSENT_ITEM, categorical_values, join_list, multi_hot_values
from recserve.core.wire_forms import request_form


class FeatureTransform:
    """Validate raw inputs and turn them into keys, normalised dense values and a sequence mask."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        ns = spec.hashing.namespace
        cat = spec.categorical.features
        self._cat_columns = np.array([f.column for f in cat], dtype=np.intp)
        self._cat_salts = np.array([table_salt(ns, f.table) for f in cat], dtype=np.uint64)
        self._cat_missing = np.array([missing_key(ns, f.name) for f in cat], dtype=np.int64)
        self._identity = np.array([f.encoder == "identity" for f in cat])
        self._parts = [
            (i, f.part, spec.categorical.raw_columns[f.column].timezone) for i, f in enumerate(cat) if f.part
        ]
        numeric = spec.dense.numeric if spec.dense else ()
        self._buckets = [
            (i, f.numeric, np.array(numeric[f.numeric].boundaries))
            for i, f in enumerate(cat)
            if f.numeric >= 0
        ]
        self._hex_parser = hex_parser.load()  # None where the extension was not built: numpy's
        self._loops = compiled_keys.load()  # likewise
        self._categorical_loop = (
            None
            if self._loops is None
            else self._loops.categorical_keys(self._cat_salts, self._identity, self._cat_missing)
        )
        self._ids = IdReader(spec)  # the id form of the wire
        self._numeric = NumericOps(spec)  # the numeric features' values and ops
        named: list[Feature] = [*spec.targets, *spec.sequences, *spec.categorical.multi_hot]
        self._salts = {f.table: table_salt(ns, f.table) for f in named}
        self._missing = {f.name: missing_key(ns, f.name) for f in named}  # absent target, padding
        # per attention group: its length input, its sequences and the name of its mask
        self._groups = tuple(
            (group, names.mask)
            for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True)
        )
        self._length_input = {s.name: g.length_input for g in spec.attention_groups for s in g.sequences}

    def transform(self, inputs: Mapping[str, np.ndarray], users: int | None = None) -> dict[str, np.ndarray]:
        """Validate one request's raw tensors and compute the keys the lookup step needs.

        Args:
            inputs: the row-layout wire inputs.
            users: for a candidate list, how many users' sequences (one row each) the rows share; the
                history keys and mask then have one row per user. None: one per row.

        Raises:
            InvalidInput: naming the first offending input and value.
        """
        spec = self.spec
        group = spec.categorical
        raw = self.raw_values(inputs)
        rows, values, empty = raw.rows, raw.values, raw.empty
        out = {}
        numeric = None
        if spec.dense is not None:
            width = len(spec.dense.columns)
            numeric = (  # no wire tensor when every numeric feature reads a categorical column
                require(inputs, spec.dense.name, "FP32", rows, width)
                if width
                else np.zeros((rows, 0), np.float32),
                require(inputs, spec.dense_missing_input, "BOOL", rows, width)
                if width
                else np.zeros((rows, 0), bool),
            )
            normalized = self.dense_values(*numeric, parsed=(values, empty))  # also refuses NaN and Inf
            if spec.normalized_columns:
                out[DENSE_NORMALIZED] = normalized
        out[SPARSE_KEYS] = self.categorical_keys(values, empty, numeric)
        if group.multi_hot:
            out[MULTI_HOT_KEYS], out[MULTI_HOT_WEIGHTS] = self.pooled_keys(raw.lists)
        if spec.sequences:
            owners = rows if users is None else users
            lengths = [
                require(inputs, attention.length_input, "INT32", owners, 1)[:, 0]
                for attention, _ in self._groups
            ]
            out[TARGET_KEY] = np.concatenate(
                [self.target_keys(require(inputs, t.name, "INT64", rows, 1), t) for t in spec.targets], axis=1
            )
            # every group's positions padded to one bucket: that of the longest history of any group
            # (a length over the largest bucket is refused below, naming its input)
            longest = max(int(np.max(n, initial=0)) for n in lengths)
            bucket = spec.sequence_bucket(min(max(longest, 1), spec.serving.sequence_buckets[-1]))
            keys = []
            for (attention, mask_name), group_lengths in zip(self._groups, lengths, strict=True):
                for sequence in attention.sequences:
                    items = require(inputs, sequence.name, "INT64", owners, None)
                    history = self.history(items, group_lengths, sequence, bucket)
                    keys.append(history[HISTORY_KEYS])
                out[mask_name] = history[HISTORY_MASK]
            out[HISTORY_KEYS] = np.concatenate(keys, axis=1)
        return out

    def raw_values(self, inputs: Mapping[str, np.ndarray]) -> RawValues:
        """The categorical values of one request in either wire form (:mod:`recserve.core.wire_forms`).

        The id form is read with whole-array numpy; the bytes form's text is parsed and hashed.

        Raises:
            InvalidInput: the request carries both forms or neither, or a value is malformed.
        """
        if request_form(self.spec, inputs) == IDS_WIRE:
            return self._ids.read(inputs)
        group = self.spec.categorical
        categorical = self.categorical_fields(inputs)
        values, empty = categorical_values(categorical, group, self._hex_parser)
        lists = {}
        for i, column in enumerate(group.raw_columns):
            if column.separator:
                name = column.name if column.as_list else group.name
                lists[i] = multi_hot_values(categorical[:, i], column, name)
        return RawValues(values, empty, lists)

    def categorical_fields(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Every raw categorical column's fields ``[B, C]``, multi-hot lists joined into theirs.

        Raises:
            InvalidInput: the ``categorical`` tensor or a list tensor is malformed, or the batch is
                outside ``1..max_batch_size`` rows.
        """
        group = self.spec.categorical
        fields = require(inputs, group.name, "BYTES", None, len(group.wire_columns))
        rows = fields.shape[0]
        check_rows(group.name, rows, self.spec.model.max_batch_size)
        if not group.list_columns:
            return fields
        categorical = np.empty((rows, len(group.raw_columns)), dtype=object)
        categorical[:, group.wire_columns] = fields
        for i in group.list_columns:
            column = group.raw_columns[i]
            categorical[:, i] = join_list(
                require(inputs, column.name, "BYTES", rows, None), column, column.name
            )
        return categorical

    def multi_hot_keys(self, categorical: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`pooled_keys` of the raw categorical fields ``[B, C]`` (the bytes form, lists joined)."""
        group = self.spec.categorical
        lists = {}
        for feature in group.multi_hot:
            column = group.raw_columns[feature.column]
            name = column.name if column.as_list else group.name
            lists[feature.column] = multi_hot_values(categorical[:, feature.column], column, name)
        return self.pooled_keys(lists)

    def pooled_keys(
        self, lists: Mapping[int, tuple[np.ndarray, np.ndarray]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Keys and pooling weights ``[B, sum of max_length]`` of the multi-hot features, side by side.

        ``lists``: each multi-hot column's values and mask (:attr:`RawValues.lists`). A weight is 1
        (sum), ``1 / n`` (mean) or ``1 / sqrt(n)`` (sqrtn) on a row's ``n`` values, 0 on padding:
        the lookup step pools each feature's vectors with them. A row without values pools to zeros.
        """
        group = self.spec.categorical
        keys, weights = [], []
        for feature in group.multi_hot:
            values, mask = lists[feature.column]
            keys.append(
                np.where(mask, keys_for(values, self._salts[feature.table]), self._missing[feature.name])
            )
            weights.append(pooling_weights(mask, feature.pooling))
        return np.concatenate(keys, axis=1), np.concatenate(weights, axis=1)

    def dense_values(
        self,
        values: np.ndarray,
        missing: np.ndarray,
        parsed: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Normalised dense values by each feature's ops (missing: its fill value); rejects NaN and Inf.

        ``values`` and ``missing`` are the wire tensor's columns; ``parsed`` (the parsed categorical
        columns) is needed where a numeric feature reads one (see
        :class:`~recserve.backends.features.numeric.NumericOps`).
        """
        return self._numeric.normalize(values, missing, parsed)

    def categorical_keys(
        self, values: np.ndarray, empty: np.ndarray, numeric: tuple[np.ndarray, np.ndarray] | None = None
    ) -> np.ndarray:
        """Keys ``[B, F]`` of the parsed raw columns (:func:`~recserve.core.values.categorical_values`).

        Each feature reads its column (a time feature its part of it; a bucketized numeric feature
        the bucket of its value in ``numeric``, the raw numeric values and their missing mask); an
        empty or missing value gets its feature's missing key.
        """
        picked = values[:, self._cat_columns]
        absent = empty[:, self._cat_columns]
        for index, part, timezone in self._parts:
            picked[:, index] = time_part(picked[:, index], part, timezone)
        if self._buckets:
            assert numeric is not None  # a bucketized feature is a numeric column of the spec
            numbers, unknown = self._numeric.features(*numeric, parsed=(values, empty))
        for index, column, edges in self._buckets:
            picked[:, index] = np.searchsorted(edges, numbers[:, column], side="right")
            absent[:, index] = unknown[:, column]
        if self._categorical_loop is not None:
            return self._categorical_loop(picked, absent)
        keys = keys_for(picked, self._cat_salts[None, :])
        keys = np.where(self._identity[None, :], picked.view(np.int64), keys)
        return np.where(absent, self._cat_missing[None, :], keys)

    def target_keys(self, target: np.ndarray, feature: CategoricalFeature | None = None) -> np.ndarray:
        """Keys ``[B, 1]`` of a target's item ids (-1: absent, its missing key); by default the first's."""
        feature = feature or self.spec.targets[0]
        if self._loops is not None:  # None: an id the check below refuses
            keys = self._loops.item_keys(
                target, int(self._salts[feature.table]), int(self._missing[feature.name])
            )
            if keys is not None:
                return keys
        check_target(target, feature)
        keys = keys_for(target.astype(np.uint64), self._salts[feature.table])
        return np.where(target == ABSENT_ITEM, self._missing[feature.name], keys)

    def history(
        self,
        items: np.ndarray,
        lengths: np.ndarray,
        sequence: SequenceFeature | None = None,
        bucket: int | None = None,
    ) -> dict[str, np.ndarray]:
        """History keys and mask of a sequence (the first by default).

        Padded (or truncated) to ``bucket`` positions (by default the sequence bucket of the longest
        row), on the sequence's padding side: right, a row's ids at positions ``0..length-1``; left,
        at the bucket's last positions.
        """
        seq = sequence or self.spec.sequences[0]
        if self._loops is not None and bucket is not None:  # None: a row the checks below refuse
            made = self._loops.history_keys(
                items,
                lengths,
                bucket,
                seq.max_length,
                seq.padding == "left",
                int(self._salts[seq.table]),
                int(self._missing[seq.name]),
            )
            if made is not None:
                return {HISTORY_KEYS: made[0], HISTORY_MASK: made[1]}
        check_history(items, lengths, seq, self._length_input[seq.name])
        bucket = bucket or self.spec.sequence_bucket(max(int(lengths.max()), 1))
        width = min(bucket, items.shape[1])
        window = np.zeros((items.shape[0], bucket), dtype=np.int64)
        window[:, :width] = items[:, :width]
        mask = np.arange(bucket)[None, :] < lengths[:, None]
        if seq.padding == "left":
            window, mask = right_align(window, lengths), right_align(mask, lengths)
        keys = np.where(
            mask, keys_for(window.astype(np.uint64), self._salts[seq.table]), self._missing[seq.name]
        )
        return {HISTORY_KEYS: keys, HISTORY_MASK: mask.astype(np.float32)}


def right_align(array: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each row's first ``lengths[r]`` positions (axis 1) moved to its end, zeros before them.

    The left padding of a sequence (:attr:`recserve.core.spec.types.SequenceFeature.padding`) from its right
    padding; ``array`` is ``[rows, positions, ...]`` with every row's real positions first.
    """
    positions = array.shape[1]
    source = np.arange(positions)[None, :] - (positions - lengths.astype(np.intp))[:, None]
    real = source >= 0
    picked = array[np.arange(array.shape[0])[:, None], np.where(real, source, 0)]
    return np.where(real.reshape(*real.shape, *(1,) * (array.ndim - 2)), picked, 0).astype(array.dtype)
