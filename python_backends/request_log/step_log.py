"""What each step logs of a request it served: :class:`FeatureLog` (lookup) and :class:`ScoreLog` (dense).

Both are observers of the Triton adapter's request loops: called once per successful request with
its inputs and its own part of the outputs, right before the response is sent. On the request
path they only decide (sampling by request id), copy what they keep and queue it; the records are
built on the writer thread. The keys are the ones served: the lookup step taps them from its
transform into its outputs (:meth:`FeatureLog.tap`), split per request with the rest of a dynamic
batch, and the observer takes them out before the response is sent. The dense values and the
versions are what the step returned.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from recserve.backends.base.arrays import side_by_side
from recserve.backends.request_log.histories import history_columns
from recserve.backends.request_log.records import FEATURES, SCHEMAS, SCORES, Identity, sampled
from recserve.backends.request_log.segments import ParquetSegments
from recserve.backends.request_log.streams import RedisStreams, cluster_client
from recserve.backends.request_log.writer import Entry, RecordWriter
from recserve.core.contract import attention_inputs
from recserve.core.names import (
    CANDIDATE_PREFIX,
    DENSE_NORMALIZED,
    DENSE_VERSION,
    EMBEDDING_VERSION,
    HISTORY_KEYS,
    MULTI_HOT_KEYS,
    PROBABILITY,
    SPARSE_EMBEDDINGS,
    SPARSE_KEYS,
    TARGET_KEY,
)
from recserve.core.sections.logging import LoggingSection
from recserve.core.spec.model import ModelSpec

#: the names under which the lookup step hands the log what it served; never sent (:meth:`FeatureLog.tap`)
TAPPED_KEYS = "__logged_keys"
TAPPED_HISTORY = "__logged_history"
TAPPED_HISTORY_MASK = "__logged_history_mask"
TAPPED = (TAPPED_KEYS, TAPPED_HISTORY, TAPPED_HISTORY_MASK)
#: ... those with one row per history owner (a list's: per user) rather than per row
TAPPED_PER_OWNER = (TAPPED_HISTORY, TAPPED_HISTORY_MASK)
TIME = pa.timestamp("us", tz="UTC")


def open_writer(settings: LoggingSection, base: Path | None = None, store: Any = None) -> RecordWriter:
    """The writer of ``settings``' sink: Parquet segments or Redis Streams.

    Args:
        settings: ``[logging]``.
        base: a relative segment directory lies under it (None: the working folder).
        store: ``[store]``, whose Redis Cluster holds the streams (``sink = "redis"``).
    """
    if settings.sink == "redis":
        streams = RedisStreams(
            functools.partial(cluster_client, store),
            settings.stream_prefix,
            settings.streams,
            settings.stream_max_len,
            settings.stream_flush_ms / 1000.0,
        )
        return RecordWriter(streams, settings.queue_records)
    directory = Path(settings.directory)
    if base is not None and not directory.is_absolute():
        directory = base / directory
    sink = ParquetSegments(
        directory, int(settings.segment_mib * (1 << 20)), settings.segment_seconds, settings.compression
    )
    return RecordWriter(sink, settings.queue_records)


def on_host(array: Any) -> np.ndarray:
    """A numpy array or a torch tensor (on any device) as a numpy array, sharing its memory where it can."""
    if isinstance(array, np.ndarray):
        return array
    return np.asarray(array.detach().cpu().numpy())


def host(array: Any) -> np.ndarray:
    """A host copy of a numpy array or a torch tensor (on any device)."""
    return on_host(array).copy()


def served_rows(outputs: Mapping[str, Any]) -> int:
    """The rows of one lookup response: its sparse vectors' rows (a list's: users × candidates)."""
    listed = outputs.get(CANDIDATE_PREFIX + SPARSE_EMBEDDINGS)
    if listed is not None:
        return int(listed.shape[0] * listed.shape[1])
    return int(outputs[SPARSE_EMBEDDINGS].shape[0])


def _lists(values: np.ndarray, dtype: pa.DataType) -> pa.Array:
    """A ``[rows, width]`` array as a list column (each row one list of ``width`` values)."""
    rows, width = values.shape[0], int(np.prod(values.shape[1:], dtype=np.int64))
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * width, pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), dtype))


@dataclass(frozen=True)
class _Part:
    """What the observer of one logged request copied for its records."""

    identity: Identity
    time_us: int
    columns: tuple[np.ndarray, ...]  # the kind's per-request arrays, rows first (see each ``build``)


def _common(parts: Sequence[_Part], counts: np.ndarray) -> list[pa.Array]:
    """The columns every record has, for the requests of ``parts`` with ``counts`` rows each."""
    starts = np.cumsum(counts) - counts
    request = np.repeat(np.arange(len(parts), dtype=np.int32), counts)  # each row's request
    which = pa.array(request)

    def each(values: list[str]) -> pa.Array:
        return pa.array(values, pa.string()).take(which)

    return [
        each([p.identity.request_id for p in parts]),
        pa.array((np.arange(request.shape[0]) - starts[request]).astype(np.int32)),
        pa.array(np.array([p.time_us for p in parts], np.int64)[request], TIME),
        each([p.identity.variant for p in parts]),
        each([p.identity.traffic for p in parts]),
    ]


class _Observer:
    """The request-path part both steps share: identify, sample, queue."""

    def __init__(self, settings: LoggingSection, writer: RecordWriter) -> None:
        self.settings = settings
        self.writer = writer

    def identify(self, request: Any, rows: int) -> Identity | None:
        """The request's identity when it is logged; None when it is not (no id: counted)."""
        request_id = request.request_id()
        if not request_id:
            self.writer.count("unidentified", rows)
            return None
        if not sampled(request_id, self.settings.sample_rate):
            return None
        return Identity.of(request_id, request.parameters())


class FeatureLog(_Observer):
    """The ``features`` records of the ``embedding_lookup`` step (see :mod:`.records`).

    The step taps what its transform made (:meth:`tap`: the record's keys, and the history keys
    with their mask, one row per history owner) into its outputs under names that are never sent;
    the observer takes them back out of every response, so the log reuses the served keys instead
    of transforming the request a second time.
    """

    def __init__(self, spec: ModelSpec, settings: LoggingSection, writer: RecordWriter) -> None:
        super().__init__(settings, writer)
        self.spec = spec
        self.key_inputs = (SPARSE_KEYS,) + ((MULTI_HOT_KEYS,) if spec.categorical.multi_hot else ())
        self.key_inputs += (TARGET_KEY,) if spec.sequences else ()
        # each sequence's mask, sequence after sequence (the sequences of a group share their mask)
        self.sequence_masks = tuple(
            names.mask
            for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True)
            for _ in group.sequences
        )
        self.logs_history = bool(spec.sequences) and settings.history

    def tap(self, features: Mapping[str, Any]) -> dict[str, Any]:
        """What the step adds to its outputs for the log (numpy arrays or torch tensors, on their device).

        ``features``: the transform's (:meth:`FeatureTransform.transform`), users' states merged.
        """
        tapped = {TAPPED_KEYS: side_by_side([features[n] for n in self.key_inputs])}
        if self.logs_history:
            tapped[TAPPED_HISTORY] = features[HISTORY_KEYS]
            tapped[TAPPED_HISTORY_MASK] = side_by_side([features[m] for m in self.sequence_masks])
        return tapped

    def __call__(self, request: Any, inputs: Mapping[str, Any], outputs: dict[str, Any]) -> None:
        """Observe one request, of either layout (a list's rows are its candidates, user by user)."""
        tapped = [outputs.pop(name, None) for name in TAPPED]  # never sent, logged or not
        rows = served_rows(outputs)
        identity = self.identify(request, rows)
        if identity is None or tapped[0] is None:
            return
        dense = outputs.get(DENSE_NORMALIZED, outputs.get(CANDIDATE_PREFIX + DENSE_NORMALIZED))
        part = _Part(
            identity,
            time.time_ns() // 1000,
            _copied(rows, tapped, dense, outputs[EMBEDDING_VERSION], len(self.sequence_masks)),
        )
        self.writer.offer(Entry(FEATURES, rows, self.build, part))

    def records(
        self, identity: Identity, time_us: int, features: Mapping[str, Any], versions: np.ndarray
    ) -> pa.RecordBatch:
        """One row-layout request's records from its transform's ``features``, as the step logs them.

        For a replay in process (the loop's bench); ``versions``: the embedding versions served.
        """
        tapped = self.tap(features)
        rows = tapped[TAPPED_KEYS].shape[0]
        columns = _copied(
            rows,
            [tapped.get(n) for n in TAPPED],
            features.get(DENSE_NORMALIZED),
            versions,
            len(self.sequence_masks),
        )
        return self.build([_Part(identity, time_us, columns)])

    @staticmethod
    def build(parts: Sequence[_Part]) -> pa.RecordBatch:
        """The ``features`` records of the requests of ``parts``, in order (on the writer thread).

        Each part's columns: the keys ``[rows, K]``, the dense values ``[rows, D]``, the versions
        ``[1, tables]`` and, when the history is logged, its valid keys (owner after owner, each
        owner's sequence after sequence) and each owner's sequences' lengths ``[owners, sequences]``:
        one owner per history (a row; a list's user, whose candidates are consecutive rows).
        """
        counts = np.array([p.columns[0].shape[0] for p in parts])
        rows = int(counts.sum())
        if len(parts[0].columns) == 3:
            history_row = np.full(rows, -1, np.int32)
            carried = [pa.nulls(rows, pa.list_(pa.int64())), pa.nulls(rows, pa.list_(pa.int32()))]
        else:
            history_row, *carried = history_columns(
                [p.columns[3] for p in parts], [p.columns[4] for p in parts], counts
            )
        versions = np.repeat(np.concatenate([p.columns[2] for p in parts]), counts, axis=0)
        columns = [
            *_common(parts, counts),
            _lists(np.concatenate([p.columns[0] for p in parts]).astype(np.int64, copy=False), pa.int64()),
            _lists(
                np.concatenate([p.columns[1] for p in parts]).astype(np.float32, copy=False), pa.float32()
            ),
            _lists(versions.astype(np.int64, copy=False), pa.int64()),
            pa.array(history_row),
            *carried,
        ]
        return pa.RecordBatch.from_arrays(columns, schema=SCHEMAS[FEATURES])


def _copied(
    rows: int, tapped: Sequence[Any], dense: Any, versions: Any, sequences: int
) -> tuple[np.ndarray, ...]:
    """A request's columns for :meth:`FeatureLog.build`, copied to the host.

    ``tapped``: the arrays under :data:`TAPPED` (None where absent); ``dense``: the dense values
    served (None: the spec has none); ``versions``: the embedding versions, the request's first row;
    ``sequences``: how many sequences the history holds side by side (its keys' and masks' blocks).
    The history is kept as its valid keys alone (a few of its padded positions), with each
    sequence's count of them: what the records hold, taken while the step's arrays are at hand.
    """
    columns = (
        host(tapped[0]).reshape(rows, -1),
        np.zeros((rows, 0), np.float32) if dense is None else host(dense).reshape(rows, -1),
        host(versions)[:1],
    )
    if tapped[1] is None:
        return columns
    keys = on_host(tapped[1])
    valid = on_host(tapped[2]).reshape(keys.shape[0], sequences, -1) > 0  # [owners, sequences, positions]
    return (*columns, keys.reshape(valid.shape)[valid], valid.sum(axis=2, dtype=np.int32))


class ScoreLog(_Observer):
    """The ``scores`` records of the ``dense`` step (see :mod:`.records`)."""

    def __call__(self, request: Any, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
        """Observe one request, of either form (a list's rows are its candidates, user by user)."""
        scores = host(outputs[PROBABILITY]).reshape(-1)
        identity = self.identify(request, scores.shape[0])
        if identity is None:
            return
        version = host(outputs[DENSE_VERSION]).reshape(-1)[:1]
        part = _Part(identity, time.time_ns() // 1000, (scores, version))
        self.writer.offer(Entry(SCORES, scores.shape[0], self.build, part))

    @classmethod
    def records(
        cls, identity: Identity, time_us: int, scores: np.ndarray, versions: np.ndarray
    ) -> pa.RecordBatch:
        """One request's ``scores`` records (``versions``: the request's, one per row or one)."""
        return cls.build([_Part(identity, time_us, (scores, np.asarray(versions).reshape(-1)[:1]))])

    @staticmethod
    def build(parts: Sequence[_Part]) -> pa.RecordBatch:
        """The ``scores`` records of the requests of ``parts`` (each: its scores and its ``[1]`` version)."""
        counts = np.array([p.columns[0].shape[0] for p in parts])
        columns = [
            *_common(parts, counts),
            pa.array(np.concatenate([p.columns[0] for p in parts]).astype(np.float32, copy=False)),
            pa.array(np.repeat(np.concatenate([p.columns[1] for p in parts]), counts).astype(np.int64)),
        ]
        return pa.RecordBatch.from_arrays(columns, schema=SCHEMAS[SCORES])


def feature_log(spec: ModelSpec) -> FeatureLog | None:
    """The lookup step's log when ``[logging]`` (or ``recserve serve --log-dir``) turns it on; else None."""
    settings = spec.logging.from_environment()
    return FeatureLog(spec, settings, open_writer(settings, store=spec.store)) if settings.enabled else None


def score_log(spec: ModelSpec) -> ScoreLog | None:
    """The dense step's log when ``[logging]`` (or ``recserve serve --log-dir``) turns it on; else None."""
    settings = spec.logging.from_environment()
    return ScoreLog(settings, open_writer(settings, store=spec.store)) if settings.enabled else None
