"""Why a row scored as it did: every feature's raw value, key, table, tier and table version."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.lookup import EmbeddingLookup
from recserve.backends.store.tiered import TIERS, TieredStore
from recserve.spec import ModelSpec

FIELDS = ("row", "feature", "value", "key", "table", "dim", "tier", "version")


def explain(
    spec: ModelSpec, store: TieredStore, inputs: Mapping[str, np.ndarray]
) -> Iterator[dict[str, Any]]:
    """One record per row and feature (and per history position) of a batch of raw inputs.

    The keys go through the same transform and the same store lookup as served requests (without
    counting them), so ``tier`` is the tier this store serves each key from right now.
    """
    features = FeatureTransform(spec).transform(inputs)
    lookup = EmbeddingLookup(spec, store)
    keys, table_ids = lookup.keys_and_tables(features)
    result = store.lookup(keys, table_ids, record=False)
    tiers = result.tiers.reshape(keys.shape)
    categorical = spec.categorical.features
    raw_categorical = inputs[spec.categorical.name]
    for row in range(keys.shape[0]):
        values: list[tuple[str, Any, int]] = [
            (f.name, _text(raw_categorical[row, f.column]), index) for index, f in enumerate(categorical)
        ]
        if spec.target is not None and spec.sequence is not None:
            target, sequence = spec.target.name, spec.sequence.name
            values.append((target, int(inputs[target][row, 0]), len(categorical)))
            values += [
                (
                    f"{sequence}[{position}]",
                    int(inputs[sequence][row, position]),
                    len(categorical) + 1 + position,
                )
                for position in range(int(inputs[spec.sequence_length_input][row, 0]))
            ]
        for feature, value, column in values:
            table = store.table_names[int(table_ids[row, column])]
            yield {
                "row": row,
                "feature": feature,
                "value": value,
                "key": int(keys[row, column]),
                "table": table,
                "dim": store.dim,
                "tier": TIERS[int(tiers[row, column])],
                "version": store.version_of(table, result.snapshot),
            }


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


__all__ = ["FIELDS", "explain"]
