"""``recserve verify --log DIR``: the logged features, scored again offline, give the logged scores.

A request log (``[logging]``, ``recserve serve --log-dir``) holds, per served row, the keys of its
slots, the numeric values as the network received them, its history's keys and the versions that
served it, and its score. Scoring those records again through the repository's store and dense
network, outside the server, must give the logged scores: what a trainer reads from the log is then
what the model saw (no training/serving skew). Records served by other table or dense versions than
the repository's are counted and left out.

A multi-hot feature's logged keys give back its pooling weights (a padding position holds the
feature's missing key: :func:`~recserve.backends.features.pooling.logged_pooling_weights`), and a
history its sequences' lengths (``history_lengths``; several attention groups have their own). What
the log cannot say is not guessed: a spec with ``[user_state]`` (the logged history is the
request's tail, not the merged state) is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from recserve.backends.features.hashing import missing_key
from recserve.backends.features.pooling import logged_pooling_weights
from recserve.backends.request_log.read import read_log
from recserve.backends.request_log.records import carried_histories, sequence_lengths
from recserve.backends.steps.lookup import FeaturesToEmbeddings
from recserve.core.contract import attention_inputs
from recserve.core.names import (
    DENSE_NORMALIZED,
    EMBEDDING_VERSION,
    HISTORY_KEYS,
    MULTI_HOT_KEYS,
    MULTI_HOT_WEIGHTS,
    SPARSE_KEYS,
    TARGET_KEY,
)
from recserve.core.spec.model import ModelSpec

#: Records scored together.
BATCH = 256
#: The worst records reported.
WORST = 5


@dataclass(frozen=True)
class LogCheck:
    """The logged scores against the same records scored again."""

    records: int  # joined records (features with their score) in the log
    rescored: int
    other_versions: int  # served by table versions other than the store's, or a dense version not on disk
    max_abs: float  # over the rescored records (0 without any)
    worst: tuple[tuple[str, int, float, float], ...]  # (request id, row, logged, rescored), worst first


def unrescorable(spec: ModelSpec) -> str | None:
    """Why the records of ``spec`` cannot be scored again from the log (None: they can)."""
    if spec.user_state.enabled:
        return "with [user_state] the log holds each request's tail, not the history merged with its state"
    return None


def rescore_log(
    spec: ModelSpec,
    embeddings: FeaturesToEmbeddings,
    dense: Mapping[int, Callable[[Mapping[str, np.ndarray]], np.ndarray]],
    directory: Path,
) -> LogCheck:
    """The records of the log in ``directory`` scored again and compared with their logged scores.

    ``embeddings`` looks the keys up in the repository's store; ``dense`` holds its networks by
    dense version: each record is scored by the version that served it.

    Raises:
        ValueError: the spec's records cannot be scored again (:func:`unrescorable`).
    """
    reason = unrescorable(spec)
    if reason is not None:
        raise ValueError(f"the log of spec {spec.name!r} cannot be scored again: {reason}")
    table = read_log(directory)
    records = table.num_rows
    history, lengths = carried_histories(table)
    histories = [h or [] for h in history.to_pylist()]
    split = sequence_lengths(history, lengths, len(spec.sequences))
    keys = table["keys"].to_pylist()
    values = table["dense"].to_pylist()
    logged = np.asarray(table["score"].to_numpy(), np.float32)
    versions = np.array(table["embedding_version"].to_pylist(), np.int64).reshape(records, -1)
    served_by = np.asarray(table["dense_version"].fill_null(-1).to_numpy(), np.int64)
    rescored = np.full(records, np.nan, np.float32)
    for start in range(0, records, BATCH):
        part = slice(start, min(start + BATCH, records))
        features = _features(
            spec,
            np.array(keys[part], np.int64).reshape(part.stop - part.start, -1),
            np.array(values[part], np.float32).reshape(part.stop - part.start, -1),
            histories[part],
            split[part],
        )
        looked = embeddings.lookup.lookup(features)
        inputs = {n: features[n] for n in embeddings.passed if n in features}
        inputs.update({n: np.asarray(v) for n, v in looked.items() if n != EMBEDDING_VERSION})
        same = (versions[part] == np.asarray(looked[EMBEDDING_VERSION])[:1]).all(axis=1)
        for version, network in dense.items():
            mine = same & (served_by[part] == version)
            if mine.any():
                scores = np.asarray(network(inputs), np.float32).reshape(-1)
                rescored[part] = np.where(mine, scores, rescored[part])
    done = ~np.isnan(rescored)
    deltas = np.abs(rescored - logged)
    order = np.argsort(-np.where(done, deltas, -1.0), kind="stable")[: min(WORST, int(done.sum()))]
    return LogCheck(
        records=records,
        rescored=int(done.sum()),
        other_versions=int((~done).sum()),
        max_abs=float(deltas[done].max(initial=0.0)),
        worst=tuple(
            (table["request_id"][i].as_py(), table["row"][i].as_py(), float(logged[i]), float(rescored[i]))
            for i in order.tolist()
        ),
    )


def _features(
    spec: ModelSpec,
    keys: np.ndarray,
    dense: np.ndarray,
    histories: list[list[int]],
    split: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The transform's output for logged records: the row block's keys split, histories padded.

    ``histories``: each record's history as logged (each sequence's valid keys in turn);
    ``split``: their sequences' lengths ``[records, sequences]`` (None: each history split evenly).
    """
    count, single = keys.shape[0], len(spec.categorical.features)
    multi = sum(f.max_length for f in spec.categorical.multi_hot)
    features = {SPARSE_KEYS: keys[:, :single]}
    if multi:
        features[MULTI_HOT_KEYS] = keys[:, single : single + multi]
        features[MULTI_HOT_WEIGHTS] = logged_pooling_weights(spec, features[MULTI_HOT_KEYS])
    if spec.normalized_columns:
        features[DENSE_NORMALIZED] = dense
    if not spec.sequences:
        return features
    features[TARGET_KEY] = keys[:, single + multi :]
    if split is None:
        split = sequence_lengths(pa.array(histories, pa.list_(pa.int64())), None, len(spec.sequences))
    # every group's positions padded to one bucket, that of the longest history (as the transform does)
    width = spec.sequence_bucket(max(int(split.max(initial=0)), 1))
    columns, ends = np.arange(width), np.cumsum(split, axis=1)
    blocks, s = [], 0
    for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True):
        for sequence in group.sequences:
            lengths = split[:, s]
            left = sequence.padding == "left"
            real = columns >= width - lengths[:, None] if left else columns < lengths[:, None]
            block = np.full((count, width), missing_key(spec.hashing.namespace, sequence.name), np.int64)
            block[real] = np.concatenate(
                [
                    np.asarray(h[e - n : e], np.int64)
                    for h, e, n in zip(histories, ends[:, s], lengths, strict=True)
                ]
            )
            blocks.append(block)
            features[names.mask] = real.astype(np.float32)
            s += 1
    features[HISTORY_KEYS] = np.concatenate(blocks, axis=1)
    return features
