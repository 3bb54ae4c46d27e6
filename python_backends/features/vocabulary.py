"""The keys serving computes for a vocabulary's raw values: how an imported table's rows are keyed."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import replace

import numpy as np

from recserve.backends.features.hashing import keys_for, missing_key, table_salt
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import CategoricalFeature, CategoricalGroup, RawColumn
from recserve.core.values import ABSENT_ITEM, categorical_values
from recserve.errors import InvalidInput, shorten

#: An item id as a vocabulary writes it: decimal digits (at most 20, enough for any int64), maybe negative.
_ITEM_ID = re.compile(r"-?[0-9]{1,20}")


def vocabulary_keys(
    spec: ModelSpec, table: str, tokens: Sequence[object], skip: Collection[int] = ()
) -> np.ndarray:
    """The keys serving computes for raw values of ``table``'s feature, written as clients send them.

    A categorical table takes its column's values (hex strings: case and leading zeros do not
    matter; int64 / uint64: ints or decimal strings; strings as they are; ``""`` is the feature's
    empty value); a time part's table takes the part's numbers; the item table takes ids >= 0 (-1
    is an absent target item). The same parsing and hashing as :class:`FeatureTransform`, so an
    imported vocabulary row is served exactly for the values that name it.

    Args:
        spec: the model spec.
        table: the table the tokens belong to.
        tokens: the vocabulary, one token per row.
        skip: rows that are no value (the ``oov`` and ``pad`` rows): not parsed, and left out of the
            result. Errors name a token by its row in ``tokens``, skipped rows counted.

    Returns:
        int64 keys, one per row of ``tokens`` not in ``skip``, in order.

    Raises:
        InvalidInput: a token is not a value of that feature (named with its row and value shortened).
    """
    ns = spec.hashing.namespace
    where = f"{table if len(table) <= 64 else table[:64] + '…'}.vocab"
    feature = next((f for f in spec.categorical.features if f.table == table), None)
    multi = next((f for f in spec.categorical.multi_hot if f.table == table), None)
    target = next((f for f in spec.targets if f.table == table), None)
    if feature is not None:
        column = spec.categorical.raw_columns[feature.column]
    elif multi is not None:  # one value of the list
        element = replace(spec.categorical.raw_columns[multi.column], separator="", max_length=1)
        feature, column = CategoricalFeature(multi.name, table), element
    elif target is not None:
        feature, column = target, RawColumn(target.name, "int64")
    else:
        raise InvalidInput(where, f"{shorten(table)} is not a table of spec {spec.name!r}")
    if feature.part or feature.numeric >= 0:  # the part's or the bucket's number
        column = RawColumn(feature.name, "uint64")
    numbers = column.value_type in ("int64", "uint64")
    kind = "strings" if column.value_type == "string" else f"{column.value_type} strings"
    skipped = frozenset(skip)
    kept = np.array([i for i in range(len(tokens)) if i not in skipped], dtype=np.intp)
    texts = []
    for i, token in enumerate(tokens):
        if i in skipped:
            token = ""  # parsed as the empty value, whose key is dropped below
        elif numbers and isinstance(token, int) and not isinstance(token, bool):
            token = str(token)
        if not isinstance(token, str):
            raise InvalidInput(where, f"token {i} is {shorten(token)}; this table's values are {kind}")
        texts.append(token)
    raw = np.array(texts, dtype=object).reshape(-1, 1)
    if feature is target:
        ids = [int(t) if _ITEM_ID.fullmatch(t) else -2 for t in texts]  # -2: not an id
        bad = [int(i) for i in kept if not ABSENT_ITEM <= ids[i] < 1 << 63]
        if bad:
            raise InvalidInput(
                where,
                f"token {bad[0]} is {shorten(tokens[bad[0]])}; this table's values are ids >= 0 (-1: absent)",
            )
        ids64 = np.array([ids[i] for i in kept], dtype=np.int64)
        keys = keys_for(ids64.astype(np.uint64), table_salt(ns, table))
        return np.where(ids64 == ABSENT_ITEM, missing_key(ns, feature.name), keys)
    group = CategoricalGroup(where, (column,), (replace(feature, column=0, part=""),))
    values, empty = categorical_values(raw, group)
    values, empty = values[kept], empty[kept]
    keys = keys_for(values[:, 0], table_salt(ns, table))
    if feature.encoder == "identity":
        keys = values[:, 0].view(np.int64)
    return np.where(empty[:, 0], missing_key(ns, feature.name), keys)
