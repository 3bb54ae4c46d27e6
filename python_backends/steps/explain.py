"""Why a row scored as it did: every feature's raw value, key, table, row, tier and table version.

A categorical feature's record gives its key, the table and the row of it the key hit (a ``vocab``
feature's vocabulary row; -1 where the table holds no such key: the default vector, an update's or
L3's row); a numeric feature's record gives its raw value (None: missing) and, as ``normalized``,
what the dense network receives (tier ``dense``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.steps.lookup import EmbeddingLookup
from recserve.backends.steps.user_history import UserHistories
from recserve.backends.store.tiered import TIERS, TieredStore
from recserve.backends.store.tiers import Lookup
from recserve.backends.store.user_state.states import UserStates
from recserve.core.names import DENSE_NORMALIZED, USER_ID
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import NUMERIC_INPUT, CategoricalFeature
from recserve.core.times import time_part
from recserve.core.values import canonical_value, multi_hot_tokens, parse_times

if TYPE_CHECKING:
    from recserve.backends.store.device.cache import DeviceLookup

FIELDS = ("row", "feature", "value", "normalized", "key", "table", "table_row", "dim", "tier", "version")


def explain(
    spec: ModelSpec,
    store: TieredStore,
    inputs: Mapping[str, np.ndarray],
    device: str = "",
    user_states: UserStates | None = None,
) -> Iterator[dict[str, Any]]:
    """One record per row and feature (and per history position) of a batch of raw inputs.

    The keys go through the same transform and the same store lookup as served requests (without
    counting them), so ``tier`` is the tier this store serves each key from right now. With
    ``device`` (``cpu`` or ``cuda``), the lookup of a device step (profile ``cuda``): the tables
    that fit ``[store] device_memory_mib`` resident there (tier ``device``), the others behind the
    device L1. With ``user_states`` and rows carrying ``user_id``, a ``user_state`` record per row
    first: the state's sequence number, mode, tokens and how the row's tail met it (tier ``state``).
    """
    transform = FeatureTransform(spec)
    features = transform.transform(inputs)
    if user_states is not None and USER_ID in inputs:
        yield from _user_state_records(spec, user_states, inputs, dict(features))
    lookup = EmbeddingLookup(spec, store)
    keys, table_ids = lookup.keys_and_tables(features)
    result: Lookup | DeviceLookup
    if device:
        from recserve.backends.store.device.tier import device_lookup

        result = device_lookup(store, device, spec.store.device_memory_bytes).lookup(
            keys, table_ids, record=False
        )
    else:
        result = store.lookup(keys, table_ids, record=False)
    tiers = result.tiers.reshape(keys.shape)
    table_rows = np.full(keys.shape, -1, np.int64)
    for t, name in enumerate(store.table_names):
        hit = table_ids == t
        table_rows[hit] = _table_rows(store, name, keys[hit])
    raw_categorical = transform.categorical_fields(inputs)  # multi-hot lists joined into their fields
    numeric = _numeric_records(spec, inputs, features, raw_categorical)
    group = spec.categorical
    single, targets = len(group.features), len(spec.targets)
    multi = single + sum(f.max_length for f in group.multi_hot)  # where the targets start
    width = (keys.shape[1] - multi - targets) // max(len(spec.sequences), 1)
    target_columns: dict[str, int] = {}  # each target's first key column (one may attend several times)
    for i, target in enumerate(spec.targets):
        target_columns.setdefault(target.name, multi + i)
    for row in range(keys.shape[0]):
        values: list[tuple[str, Any, int]] = [
            (f.name, _raw_value(inputs, raw_categorical, spec, f, row), index)
            for index, f in enumerate(group.features)
        ]
        start = single
        for multi_hot in group.multi_hot:
            field = raw_categorical[row, multi_hot.column]
            tokens = multi_hot_tokens(field, group.raw_columns[multi_hot.column])
            values += [(f"{multi_hot.name}[{k}]", _text(t), start + k) for k, t in enumerate(tokens)]
            start += multi_hot.max_length
        values += [(name, int(inputs[name][row, 0]), column) for name, column in target_columns.items()]
        j = 0  # the sequence's index among all of them
        for attention in spec.attention_groups:
            length = int(inputs[attention.length_input][row, 0])
            left = attention.primary.padding == "left"
            first = multi + targets + (width - length if left else 0)  # position 0's key
            for sequence in attention.sequences:
                values += [
                    (f"{sequence.name}[{p}]", int(inputs[sequence.name][row, p]), first + j * width + p)
                    for p in range(length)
                ]
                j += 1
        yield from ({"row": row, **record} for record in numeric[row])
        for feature, value, column in values:
            table = store.table_names[int(table_ids[row, column])]
            yield {
                "row": row,
                "feature": feature,
                "value": value,
                "normalized": None,
                "key": int(keys[row, column]),
                "table": table,
                "table_row": int(table_rows[row, column]),
                "dim": store.table_dim(table),
                "tier": TIERS[int(tiers[row, column])],
                "version": store.version_of(table, result.snapshot),
            }


def _table_rows(store: TieredStore, name: str, keys: np.ndarray) -> np.ndarray:
    """Each key's row in table ``name`` as stored locally, ``-1`` where the table holds no such key.

    A ``vocab`` feature's row is its vocabulary row; a key of an update or of L3 has none here.
    """
    info = store.tables[name]
    rows = store.shards[info.shard].index.find(keys).astype(np.int64)
    inside = (rows >= info.row_start) & (rows < info.row_end)
    return np.where(inside, rows - info.row_start, -1)


def _numeric_records(
    spec: ModelSpec,
    inputs: Mapping[str, np.ndarray],
    features: Mapping[str, np.ndarray],
    categorical: np.ndarray,
) -> list[list[dict[str, Any]]]:
    """Per row, a record per numeric feature the dense network receives: raw value and normalised.

    A missing flag's value is whether the value it flags was missing.
    """
    rows = len(categorical)
    if spec.dense is None or DENSE_NORMALIZED not in features:
        return [[] for _ in range(rows)]
    dense = inputs.get(NUMERIC_INPUT, np.zeros((rows, len(spec.dense.columns)), np.float32))
    missing = inputs.get(spec.dense_missing_input, np.ones(dense.shape, bool))  # not sent: missing
    normalized = features[DENSE_NORMALIZED]
    records: list[list[dict[str, Any]]] = [[] for _ in range(rows)]
    for position, index in enumerate(spec.dense.normalized):
        column, wire = spec.dense.numeric[index], spec.dense.wire_index[index]
        for row in range(rows):
            raw: str | float | None
            if wire < 0:  # it reads a categorical column as a number
                text = _text(categorical[row, column.categorical])
                absent, raw = not text, text or None
            else:
                absent = bool(missing[row, wire])
                raw = None if absent else float(dense[row, wire])
            records[row].append(
                {
                    "feature": column.name,
                    "value": absent if column.indicator else raw,
                    "normalized": float(normalized[row, position]),
                    "key": None,
                    "table": None,
                    "table_row": None,
                    "dim": None,
                    "tier": "dense",
                    "version": None,
                }
            )
    return records


def _user_state_records(
    spec: ModelSpec, states: UserStates, inputs: Mapping[str, np.ndarray], features: dict[str, np.ndarray]
) -> Iterator[dict[str, Any]]:
    """Per row, the user state the lookup step would merge (``features`` is a copy it may change)."""
    rows = UserHistories(spec, states).apply(inputs, features)
    table = spec.sequences[0].table
    for row in range(rows.outcomes.size):
        yield {
            "row": row,
            "feature": "user_state",
            "value": {
                "user": int(inputs[USER_ID][row, 0]),
                "seq": int(rows.state_seq[row]),
                "mode": str(rows.modes[row]),
                "outcome": str(rows.outcomes[row]),
                "lag_events": int(rows.lag_events[row]),
                "tokens": int(features[UserHistories.mask_name(spec)][row].sum()),
            },
            "normalized": None,
            "key": None,
            "table": table,
            "table_row": None,
            "dim": spec.tables[table].dim,
            "tier": "state",
            "version": None,
        }


def _raw_value(
    inputs: Mapping[str, np.ndarray],
    categorical: np.ndarray,
    spec: ModelSpec,
    feature: CategoricalFeature,
    row: int,
) -> Any:
    """What the client sent for a single-valued feature: its string, or a bucketized number."""
    if feature.numeric < 0:
        text = _text(categorical[row, feature.column])
        return f"{text} ({feature.part} {_part(spec, feature, text)})" if feature.part and text else text
    assert spec.dense is not None  # a bucketized feature is a numeric one
    number = spec.dense.numeric[feature.numeric]
    if number.categorical >= 0:  # it reads a categorical column as a number
        return _text(categorical[row, number.categorical]) or None
    wire = spec.dense.wire_index[feature.numeric]
    missing = inputs[spec.dense_missing_input][row, wire]
    return None if missing else float(inputs[NUMERIC_INPUT][row, wire])


def _part(spec: ModelSpec, feature: CategoricalFeature, text: str) -> int:
    """The number a time feature looks up: its part of the time ``text`` (which the transform read)."""
    column = spec.categorical.raw_columns[feature.column]
    seconds, _ = parse_times(np.array([text.encode()], dtype=object), column, column.name)
    return int(time_part(seconds, feature.part, column.timezone)[0])


def _text(value: Any) -> str:
    """A value as the transform reads it (:func:`~recserve.core.values.canonical_value`), as text."""
    return canonical_value(value).decode("utf-8", "replace")


__all__ = ["FIELDS", "explain"]
