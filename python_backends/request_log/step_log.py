"""What each step logs of a request it served: :class:`FeatureLog` (lookup) and :class:`ScoreLog` (dense).

Both are observers of the Triton adapter's request loops: called once per successful request with
its inputs and its own part of the outputs, right before the response is sent. On the request
path they only decide (sampling by request id), copy what they keep and queue it; the records are
built on the writer thread. The keys are made there by the step's own transform from the copied
request tensors: the same code on the same values as served, so the same keys, without holding
the request up (the dense values and versions are taken from what the step returned).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.request_log.records import FEATURES, SCHEMAS, SCORES, Identity, sampled
from recserve.backends.request_log.segments import ParquetSegments
from recserve.backends.request_log.streams import RedisStreams, cluster_client
from recserve.backends.request_log.writer import Entry, RecordWriter
from recserve.core.candidate_lists import candidate_rows
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
from recserve.core.wire_forms import request_form


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
    sink = ParquetSegments(directory, int(settings.segment_mib * (1 << 20)), settings.segment_seconds)
    return RecordWriter(sink, settings.queue_records)


def host(array: Any) -> np.ndarray:
    """A host copy of a numpy array or a torch tensor (on any device)."""
    if isinstance(array, np.ndarray):
        return array.copy()
    return np.asarray(array.detach().cpu().numpy()).copy()


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


def _common(identity: Identity, time_us: int, rows: int) -> list[pa.Array]:
    return [
        pa.array([identity.request_id] * rows, pa.string()),
        pa.array(np.arange(rows, dtype=np.int32)),
        pa.array(np.full(rows, time_us, np.int64)).cast(pa.timestamp("us", tz="UTC")),
        pa.array([identity.variant] * rows, pa.string()),
        pa.array([identity.traffic] * rows, pa.string()),
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
    """The ``features`` records of the ``embedding_lookup`` step (see :mod:`.records`)."""

    def __init__(self, spec: ModelSpec, settings: LoggingSection, writer: RecordWriter) -> None:
        super().__init__(settings, writer)
        self.spec = spec
        self.transform = FeatureTransform(spec)
        self.key_inputs = (SPARSE_KEYS,) + ((MULTI_HOT_KEYS,) if spec.categorical.multi_hot else ())
        self.key_inputs += (TARGET_KEY,) if spec.sequences else ()
        # each sequence's mask, sequence after sequence (the sequences of a group share their mask)
        self.sequence_masks = [
            names.mask
            for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True)
            for _ in group.sequences
        ]

    def rows(self, request: Any, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
        """Observe a row-layout request."""
        self._observe(request, inputs, outputs, False)

    def lists(self, request: Any, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
        """Observe a candidate-list request."""
        self._observe(request, inputs, outputs, True)

    def _observe(
        self, request: Any, inputs: Mapping[str, Any], outputs: Mapping[str, Any], is_list: bool
    ) -> None:
        rows = served_rows(outputs)
        identity = self.identify(request, rows)
        if identity is None:
            return
        # the request's one row of versions, every row's (a record per row keeps them)
        versions = np.broadcast_to(host(outputs[EMBEDDING_VERSION])[:1], (rows, len(self.spec.table_names)))
        dense = outputs.get(DENSE_NORMALIZED, outputs.get(CANDIDATE_PREFIX + DENSE_NORMALIZED))
        copied = {name: host(value) for name, value in inputs.items()}
        build = functools.partial(
            self.build,
            identity,
            time.time_ns() // 1000,
            copied,
            None if dense is None else host(dense).reshape(rows, -1),
            versions,
            is_list,
        )
        self.writer.offer(Entry(FEATURES, rows, build))

    def build(
        self,
        identity: Identity,
        time_us: int,
        inputs: Mapping[str, np.ndarray],
        dense: np.ndarray | None,
        versions: np.ndarray,
        is_list: bool,
    ) -> pa.RecordBatch:
        """The request's ``features`` records (on the writer thread)."""
        if is_list:
            rows_in, owners = candidate_rows(self.spec, inputs, request_form(self.spec, inputs))
            features = self.transform.transform(rows_in, users=int(owners[-1]) + 1)
        else:
            features = self.transform.transform(inputs)
            owners = np.arange(versions.shape[0])
        rows = versions.shape[0]
        keys = np.concatenate([np.asarray(features[n]).reshape(rows, -1) for n in self.key_inputs], axis=1)
        if dense is None:
            dense = np.asarray(features.get(DENSE_NORMALIZED, np.zeros((rows, 0), np.float32)))
        history_row = np.full(rows, -1, np.int32)
        history: list[list[int] | None] = [None] * rows
        if self.spec.sequences and self.settings.history:
            per_owner = self.histories(features)
            first: dict[bytes, int] = {}  # a history's bytes -> the first row that has it
            for row, owner in enumerate(owners.tolist()):
                seen = first.setdefault(per_owner[owner].tobytes(), row)
                history_row[row] = seen
                if seen == row:
                    history[row] = per_owner[owner].tolist()
        columns = [
            *_common(identity, time_us, rows),
            _lists(keys.astype(np.int64), pa.int64()),
            _lists(dense.astype(np.float32), pa.float32()),
            _lists(versions.astype(np.int64), pa.int64()),
            pa.array(history_row),
            pa.array(history, pa.list_(pa.int64())),
        ]
        return pa.RecordBatch.from_arrays(columns, schema=SCHEMAS[FEATURES])

    def histories(self, features: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Each history owner's valid keys: each sequence's unpadded positions, sequence after sequence."""
        keys = np.asarray(features[HISTORY_KEYS])
        count = len(self.sequence_masks)
        owners, width = keys.shape[0], keys.shape[1] // count
        blocks = keys.reshape(owners, count, width)
        valid = np.stack([np.asarray(features[m]) > 0 for m in self.sequence_masks], axis=1)
        return [blocks[o][valid[o]] for o in range(owners)]


class ScoreLog(_Observer):
    """The ``scores`` records of the ``dense`` step (see :mod:`.records`)."""

    def __call__(self, request: Any, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
        """Observe one request, of either form (a list's rows are its candidates, user by user)."""
        scores = host(outputs[PROBABILITY]).reshape(-1)
        identity = self.identify(request, scores.shape[0])
        if identity is None:
            return
        versions = np.broadcast_to(host(outputs[DENSE_VERSION]).reshape(-1)[:1], scores.shape)
        build = functools.partial(self.build, identity, time.time_ns() // 1000, scores, versions)
        self.writer.offer(Entry(SCORES, scores.shape[0], build))

    @staticmethod
    def build(identity: Identity, time_us: int, scores: np.ndarray, versions: np.ndarray) -> pa.RecordBatch:
        """The request's ``scores`` records (on the writer thread)."""
        columns = [
            *_common(identity, time_us, scores.shape[0]),
            pa.array(scores.astype(np.float32)),
            pa.array(versions.astype(np.int64)),
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
