"""The log's record schema, the sampling decision and a request's identity (id, variant, traffic).

Two record kinds, one row per served row (a candidate of a list, or a row of a row-layout request),
joined by ``request_id`` and ``row`` (:func:`~recserve.backends.request_log.read.read_log`):

* ``features`` (the ``embedding_lookup`` step): the keys of the row's slots as the transform made
  them (single-valued features, multi-hot values, targets: the lookup's row block), the numeric
  values as the dense network receives them, the embedding table versions, and the history keys
  (each sequence's valid positions, sequence after sequence, in the spec's order) with each
  sequence's length (``history_lengths``: the sequences of an attention group share theirs, groups
  differ), **once per request or list**: on the first row that has that history (``history_row``
  names it on every row; ``history`` and ``history_lengths`` are null on the others);
* ``scores`` (the ``dense`` step): the probability returned and the dense version that scored it.

Every record also has the time it was served, the variant the access layer routed it to and
whether it was a shadow copy (``traffic``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recserve.core.names import TRAFFIC_HEADER, VARIANT_HEADER

FEATURES = "features"
SCORES = "scores"
KINDS = (FEATURES, SCORES)
#: the traffic of a request that names none (served straight by tritonserver, not through the access layer)
LIVE = "live"
SHADOW = "shadow"

_COMMON = [
    pa.field("request_id", pa.string(), nullable=False),
    pa.field("row", pa.int32(), nullable=False),
    pa.field("time", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("variant", pa.string(), nullable=False),
    pa.field("traffic", pa.string(), nullable=False),
]
SCHEMAS = {
    FEATURES: pa.schema(
        [
            *_COMMON,
            pa.field("keys", pa.list_(pa.int64()), nullable=False),
            pa.field("dense", pa.list_(pa.float32()), nullable=False),
            pa.field("embedding_version", pa.list_(pa.int64()), nullable=False),
            pa.field("history_row", pa.int32(), nullable=False),  # -1: the spec has no sequence
            pa.field("history", pa.list_(pa.int64()), nullable=True),
            pa.field("history_lengths", pa.list_(pa.int32()), nullable=True),  # per sequence
        ]
    ),
    SCORES: pa.schema(
        [
            *_COMMON,
            pa.field("score", pa.float32(), nullable=False),
            pa.field("dense_version", pa.int64(), nullable=False),
        ]
    ),
}


def conformed(table: pa.Table, kind: str) -> pa.Table:
    """``table`` as records of ``kind``: a nullable column it lacks (written before it was added) is null."""
    schema = SCHEMAS[kind]
    for field in schema:
        if field.nullable and field.name not in table.column_names:
            table = table.append_column(field.name, pa.nulls(table.num_rows, field.type))
    return table.select(schema.names).cast(schema)


def sampled(request_id: str, rate: float) -> bool:
    """Whether ``request_id`` is logged at ``rate``: the same answer in every step and process.

    Decided from a hash of the id alone, so the lookup and dense steps log the same requests.
    """
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < rate * 2.0**64


@dataclass(frozen=True)
class Identity:
    """Who a request is: its id (the client's), the variant that served it and its traffic kind."""

    request_id: str
    variant: str = ""
    traffic: str = LIVE

    @classmethod
    def of(cls, request_id: str, parameters: str | dict[str, Any] | None) -> Identity:
        """From Triton's ``request.request_id()`` and ``request.parameters()`` (a JSON object).

        The variant and traffic are the access layer's headers, forwarded by tritonserver as request
        parameters; anything unreadable leaves them at their defaults (``""``, ``live``).
        """
        values: Any = parameters
        if isinstance(parameters, str):
            try:
                values = json.loads(parameters) if parameters else {}
            except ValueError:
                values = {}
        if not isinstance(values, dict):
            values = {}
        variant = values.get(VARIANT_HEADER, "")
        traffic = values.get(TRAFFIC_HEADER, LIVE)
        return cls(
            request_id,
            variant if isinstance(variant, str) else "",
            SHADOW if traffic == SHADOW else LIVE,
        )


def carried_histories(table: pa.Table) -> tuple[pa.ChunkedArray, pa.ChunkedArray]:
    """Each features record's ``history`` and ``history_lengths``, from its request's row that carries them.

    A history is written once per request or list (``history_row`` names its row; -1: the spec has
    none): this gives every record its own, null where it has none.
    """
    ids = table["request_id"].to_pylist()
    at = {(r, w): i for i, (r, w) in enumerate(zip(ids, table["row"].to_pylist(), strict=True))}
    carrier = pa.array(
        [
            at.get((r, h)) if h >= 0 else None
            for r, h in zip(ids, table["history_row"].to_pylist(), strict=True)
        ],
        pa.int64(),
    )
    return table["history"].take(carrier), table["history_lengths"].take(carrier)


def sequence_lengths(history: pa.Array | pa.ChunkedArray, lengths: Any, sequences: int) -> np.ndarray:
    """Each record's sequences' lengths ``[records, sequences]``: as logged, or its history split.

    A record without ``history_lengths`` (none logged, or a log written before the column) has its
    history split evenly: it was written for one attention group, whose sequences share their length.

    Raises:
        ValueError: a record's lengths do not add up to its history's.
    """
    total = pc.fill_null(pc.list_value_length(history), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    split = np.repeat((total // max(sequences, 1))[:, None], sequences, axis=1)
    if lengths is not None:
        given = ~pc.is_null(lengths).to_numpy(zero_copy_only=False)
        if given.any():
            split[given] = pc.list_flatten(lengths.filter(pa.array(given))).to_numpy().reshape(-1, sequences)
    if (split.sum(axis=1) != total).any():
        raise ValueError("a logged history's history_lengths do not add up to its keys")
    return split
