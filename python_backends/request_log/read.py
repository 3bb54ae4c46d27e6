"""Reading a log folder back: one kind's segments, or the features and scores joined per row."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from recserve.backends.request_log.records import FEATURES, KINDS, SCHEMAS, SCORES
from recserve.backends.request_log.segments import SEGMENT_SUFFIX
from recserve.errors import shorten

JOIN_KEYS = ["request_id", "row"]


def segment_paths(directory: Path, kind: str) -> list[Path]:
    """The finished segments of ``kind``, oldest name first (a segment being written is hidden)."""
    if kind not in KINDS:
        raise ValueError(f"a log holds the kinds {KINDS}, not {shorten(kind)}")
    return sorted((Path(directory) / kind).glob(f"[!.]*{SEGMENT_SUFFIX}"))


def read_kind(directory: Path, kind: str) -> pa.Table:
    """Every record of ``kind`` in ``directory`` (an empty table when there is none)."""
    paths = segment_paths(directory, kind)
    if not paths:
        return SCHEMAS[kind].empty_table()
    return pa.concat_tables([pq.read_table(p, schema=SCHEMAS[kind]) for p in paths])


def read_log(directory: Path) -> pa.Table:
    """Each logged row's features with its score: the two kinds joined by ``request_id`` and ``row``.

    A row whose other half is not (yet) in a segment is left out.
    """
    features = read_kind(directory, FEATURES)
    scores = read_kind(directory, SCORES).select([*JOIN_KEYS, "score", "dense_version"])
    # Acero joins no list columns: join the keys and a position, then take the features' rows
    positions = features.select(JOIN_KEYS).append_column("position", pa.array(range(features.num_rows)))
    matched = positions.join(scores, JOIN_KEYS, join_type="inner").sort_by(
        [("request_id", "ascending"), ("row", "ascending")]
    )
    joined = features.take(matched["position"])
    return joined.append_column("score", matched["score"]).append_column(
        "dense_version", matched["dense_version"]
    )
