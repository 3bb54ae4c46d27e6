"""The bucket policy of the ``dense`` step, shared by every runner.

A *bucket* is a fixed input shape (rows × sequence positions) for which a runner holds a compiled
graph: an ONNX Runtime session specialised to that shape, a captured CUDA graph, or a TensorRT
optimisation profile. A request is padded up to the nearest compiled bucket (zero rows, zero
positions with mask 0, which never change the real rows' results) and its outputs are cut back.

A shape that no compiled bucket holds without wasting more than ``max_padding_waste`` of its rows
is a *miss*: it is served at once by the generic dynamic-shape graph, and a tighter bucket
(rows rounded up to ``row_granularity``, exact below it) is compiled in the background and
swapped in atomically, so later requests of that shape take the fast path::

    request [rows, length] ──plan──▶ hit:  pad to bucket ─▶ compiled[bucket] ─▶ cut rows
                                   └▶ miss: generic(request)   + compile(tight bucket) in background
                                                                  └▶ compiled = {**compiled, bucket: fn}

The policy itself (:class:`BucketPolicy`) is pure arithmetic; :class:`BucketedRunner` owns the
compiled table, the background worker and the counters; the runners only say how to compile one
bucket and how to run the generic graph.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recserve.backends.base.metrics import MetricSample
from recserve.core.contract import (
    attention_inputs,
    dense_net_inputs,
    is_dense_net_input,
    is_sequence_input,
    sparse_inputs,
)
from recserve.core.names import DENSE_NORMALIZED, HISTORY_LOG_WEIGHTS, HISTORY_MASK, SPARSE_EMBEDDINGS
from recserve.core.spec.model import ModelSpec

LOGGER = logging.getLogger(__name__)

Arrays = Mapping[str, np.ndarray]
#: Runs the dense net on inputs of exactly one bucket's shape; returns probabilities ``[rows, 1]``.
CompiledFn = Callable[[Arrays], np.ndarray]


@dataclass(frozen=True, order=True)
class Bucket:
    """One compiled input shape: ``rows`` batch rows × ``length`` sequence positions."""

    rows: int
    length: int

    def holds(self, rows: int, length: int) -> bool:
        """True when a ``[rows, length]`` request fits after padding."""
        return rows <= self.rows and length <= self.length

    def input_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """Full shapes of the dense net's inputs at this bucket."""
        shapes: dict[str, tuple[int, ...]] = {DENSE_NORMALIZED: (self.rows, len(spec.normalized_columns))}
        for name, width, slots in sparse_inputs(spec):
            shapes[name] = (self.rows, len(slots), width)
        for group in attention_inputs(spec):
            shapes[group.target] = (self.rows, group.width)
            shapes[group.history] = (self.rows, self.length, group.width)
            shapes[group.mask] = (self.rows, self.length)
        shapes[HISTORY_LOG_WEIGHTS] = (self.rows, self.length)  # with [user_state] on
        return {name: shapes[name] for name in dense_net_inputs(spec)}


def spec_buckets(spec: ModelSpec) -> tuple[Bucket, ...]:
    """The spec's grid: every batch bucket × every sequence bucket, smallest first."""
    return tuple(
        Bucket(rows, length)
        for length in spec.serving.sequence_buckets
        for rows in spec.serving.batch_buckets
    )


def grid_floors(spec: ModelSpec) -> dict[Bucket, Bucket]:
    """Per grid bucket, the smallest shape the grid pads up to it (one past the previous buckets)."""
    rows_below = dict(zip(spec.serving.batch_buckets, (0, *spec.serving.batch_buckets[:-1]), strict=True))
    length_below = dict(
        zip(spec.serving.sequence_buckets, (0, *spec.serving.sequence_buckets[:-1]), strict=True)
    )
    return {b: Bucket(rows_below[b.rows] + 1, length_below[b.length] + 1) for b in spec_buckets(spec)}


def input_shape(inputs: Mapping[str, Any]) -> tuple[int, int]:
    """``(rows, sequence positions)`` of a dense-step request (1 position without a sequence).

    The inputs may be numpy arrays or torch tensors (a device step's).
    """
    mask = inputs.get(HISTORY_MASK)
    if mask is None:
        return int(inputs[SPARSE_EMBEDDINGS].shape[0]), 1
    return int(mask.shape[0]), int(mask.shape[1])


def present_inputs(inputs: Mapping[str, Any]) -> tuple[str, ...]:
    """The dense net's inputs held by ``inputs``."""
    return tuple(name for name in inputs if is_dense_net_input(name))


@dataclass(frozen=True)
class Plan:
    """What the policy decided for one shape."""

    bucket: Bucket | None  # compiled bucket to pad to; None: serve with the generic graph
    compile: Bucket | None  # bucket to compile in the background, if any


@dataclass(frozen=True)
class BucketPolicy:
    """Where a shape goes: the nearest compiled bucket, or the generic graph plus a compile.

    Attributes:
        sequence_buckets: the spec's sequence buckets; a miss compiles at the nearest one.
        max_padding_waste: largest fraction of padded rows a hit may carry.
        row_granularity: rows of a bucket compiled on a miss are rounded up to this multiple (batches
            smaller than it get buckets of their own size).
        max_buckets: compiled buckets at most (the grid included); beyond, misses stay generic.
    """

    sequence_buckets: tuple[int, ...]
    max_padding_waste: float = 0.125
    row_granularity: int = 8
    max_buckets: int = 64

    @classmethod
    def from_spec(cls, spec: ModelSpec, **overrides: float) -> BucketPolicy:
        """The policy for a spec's sequence buckets (knobs may be overridden)."""
        return cls(spec.serving.sequence_buckets, **overrides)  # type: ignore[arg-type]

    def tight_bucket(self, rows: int, length: int) -> Bucket:
        """The bucket a miss compiles: the nearest sequence bucket, rows rounded up to the granularity.

        Batches smaller than the granularity get buckets of their own size: on a CPU a small batch's
        cost grows with every padded row.
        """
        fitting = [b for b in self.sequence_buckets if b >= length]
        granularity = self.row_granularity
        tight_rows = max(rows, 1) if rows < granularity else math.ceil(rows / granularity) * granularity
        return Bucket(tight_rows, fitting[0] if fitting else length)

    def plan(self, rows: int, length: int, compiled: Iterable[Bucket], pending: int = 0) -> Plan:
        """Decide for a ``[rows, length]`` request given the buckets compiled so far.

        Args:
            rows: real rows of the request.
            length: sequence positions of the request.
            compiled: buckets with a compiled graph now.
            pending: compiles scheduled but not finished (they count toward ``max_buckets``).
        """
        compiled = list(compiled)
        fitting = [b for b in compiled if b.holds(rows, length)]
        best = min(fitting, key=lambda b: (b.rows * b.length, b.rows)) if fitting else None
        tight = self.tight_bucket(rows, length)
        if best is not None and (
            best.rows <= tight.rows or padding_waste(rows, best.rows) <= self.max_padding_waste
        ):
            return Plan(best, None)
        room = len(compiled) + pending < self.max_buckets
        return Plan(None, tight if room else None)


def padding_waste(real: int, padded: int) -> float:
    """Fraction of ``padded`` that is padding."""
    return 1.0 - real / padded if padded else 0.0


def pad_to_bucket(
    inputs: Arrays, bucket: Bucket, out: dict[str, np.ndarray] | None = None, left: Collection[str] = ()
) -> Arrays:
    """The dense inputs zero-padded to ``bucket`` (rows and sequence positions).

    Args:
        inputs: the dense net's inputs for ``rows <= bucket.rows`` rows and ``length <= bucket.length``.
        bucket: the target shape.
        out: preallocated arrays of the bucket's shapes, always filled (the pinned buffers that a
            device copy reads); without them, new arrays, or the inputs as they are when they fit.
        left: the sequences padded on the left (:func:`recserve.core.contract.left_padded_inputs`): new
            positions go before their real ones.
    """
    rows, length = input_shape(inputs)
    if out is None and (rows, length) == (bucket.rows, bucket.length):
        exact = {name: inputs[name] for name in present_inputs(inputs)}
        if all(a.flags.c_contiguous and a.dtype == np.float32 for a in exact.values()):
            return exact
    padded = {}
    for name in present_inputs(inputs):
        array = inputs[name]
        shape = (
            (bucket.rows, bucket.length, *array.shape[2:])
            if is_sequence_input(name)
            else (bucket.rows, *array.shape[1:])
        )
        target = out[name] if out is not None else np.empty(shape, dtype=array.dtype)
        if is_sequence_input(name):
            start = bucket.length - length if name in left else 0
            target[:rows, start : start + length] = array
            target[:rows, :start] = 0
            target[:rows, start + length :] = 0
        else:
            target[:rows] = array
        target[rows:] = 0
        padded[name] = target
    return padded


@dataclass
class BucketCounters:
    """What the metrics endpoint shows for the dense step (monotonic counts)."""

    hits: int = 0  # requests served by a compiled bucket
    misses: int = 0  # requests no compiled bucket held acceptably
    fallbacks: int = 0  # requests served by the generic dynamic-shape graph
    compiles: int = 0  # buckets compiled in the background and swapped in
    compile_failures: int = 0
    real_rows: int = 0  # rows of requests served by a bucket
    padding_rows: int = 0  # zero rows added to them
    real_positions: int = 0  # rows × sequence positions of requests served by a bucket
    padding_positions: int = 0  # zero positions added (padding rows included)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> dict[str, int]:
        """The counts by name."""
        with self.lock:
            return {name: getattr(self, name) for name in COUNTER_NAMES}

    def samples(self) -> list[MetricSample]:
        """The counts as metric samples: bucket events and padding, each one counter family."""
        counts = self.snapshot()
        return [
            *(
                MetricSample(EVENTS_METRIC, "counter", EVENTS_HELP, (("event", event),), counts[name])
                for event, name in BUCKET_EVENTS.items()
            ),
            *(
                MetricSample(PADDING_METRIC, "counter", PADDING_HELP, (("kind", kind),), counts[name])
                for kind, name in PADDING_COUNTS.items()
            ),
        ]

    def add(self, **increments: int) -> None:
        """Add to named counts (thread-safe)."""
        with self.lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)


EVENTS_METRIC = "recserve_dense_bucket_requests_total"
EVENTS_HELP = "Dense batches by bucket event: hit, miss, fallback (generic graph), compile, compile_failure"
PADDING_METRIC = "recserve_dense_padding_total"
PADDING_HELP = "Rows and row-positions of bucketed dense batches: real ones and padding added"
#: Metric label value -> counter, for the request events and for the padding counts.
BUCKET_EVENTS = {
    "hit": "hits",
    "miss": "misses",
    "fallback": "fallbacks",
    "compile": "compiles",
    "compile_failure": "compile_failures",
}
PADDING_COUNTS = {name: name for name in ("real_rows", "padding_rows", "real_positions", "padding_positions")}
COUNTER_NAMES = (*BUCKET_EVENTS.values(), *PADDING_COUNTS.values())


class BucketedRunner:
    """Pads to compiled buckets, falls back to the generic graph and compiles missing buckets.

    Args:
        policy: the bucket policy.
        compile_bucket: builds (and warms) the compiled graph for one bucket; may take seconds.
        generic: the dynamic-shape graph for any shape.
        prepare: buckets compiled before the first request (the spec's grid at load).
        background: compile misses on a worker thread (False: compile inline, for tests and tools).
    """

    def __init__(
        self,
        policy: BucketPolicy,
        compile_bucket: Callable[[Bucket], CompiledFn],
        generic: CompiledFn,
        prepare: Iterable[Bucket] = (),
        background: bool = True,
    ) -> None:
        self.policy = policy
        self.counters = BucketCounters()
        self._compile_bucket = compile_bucket
        self._generic = generic
        compiled = {bucket: compile_bucket(bucket) for bucket in prepare}
        # the compiled graphs and the plans made against them, swapped together as one tuple
        self._table: tuple[dict[Bucket, CompiledFn], dict[tuple[int, int], Plan]] = (compiled, {})
        self._pending: dict[Bucket, Future] = {}
        self._failed: set[Bucket] = set()  # not retried: the generic graph keeps serving them
        self._lock = threading.Lock()
        self._worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="dense-compile") if background else None
        )

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """Buckets compiled now, smallest first."""
        return tuple(sorted(self._table[0]))

    def predict(self, inputs: Arrays) -> np.ndarray:
        """Probabilities ``[rows, 1]`` through a compiled bucket or the generic graph."""
        rows, length = input_shape(inputs)
        compiled, plans = self._table  # one read: a swap in between is never seen half-done
        plan = plans.get((rows, length))
        if plan is None:
            plan = plans[(rows, length)] = self.policy.plan(rows, length, compiled, len(self._pending))
        counters = self.counters
        if plan.bucket is not None:
            bucket = plan.bucket
            with counters.lock:
                counters.hits += 1
                counters.real_rows += rows
                counters.padding_rows += bucket.rows - rows
                counters.real_positions += rows * length
                counters.padding_positions += bucket.rows * bucket.length - rows * length
            return compiled[bucket](inputs)[:rows]
        if plan.compile is not None:
            self._schedule(plan.compile)  # once per bucket: scheduled, compiled and failed ones are skipped
        counters.add(misses=int(plan.compile is not None), fallbacks=1)
        return self._generic(inputs)

    def _schedule(self, bucket: Bucket) -> None:
        with self._lock:
            if bucket in self._pending or bucket in self._table[0] or bucket in self._failed:
                return
            if self._worker is not None:
                self._pending[bucket] = self._worker.submit(self._install, bucket)
                return
        self._install(bucket)

    def _install(self, bucket: Bucket) -> None:
        try:
            fn = self._compile_bucket(bucket)
        except Exception:  # a failed compile leaves the generic path serving that shape
            LOGGER.exception("compiling dense bucket %s failed; the generic graph keeps serving it", bucket)
            self.counters.add(compile_failures=1)
            with self._lock:
                self._failed.add(bucket)
        else:
            self._table = ({**self._table[0], bucket: fn}, {})  # atomic swap; plans are made anew
            self.counters.add(compiles=1)
            LOGGER.info("dense bucket rows=%d length=%d compiled and swapped in", bucket.rows, bucket.length)
        finally:
            with self._lock:
                self._pending.pop(bucket, None)

    def wait_compiled(self, timeout_s: float = 60.0) -> bool:
        """Wait for the scheduled compiles; True when none is left."""
        with self._lock:
            futures = list(self._pending.values())
        for future in futures:
            future.exception(timeout=timeout_s)
        return not self._pending

    def close(self) -> None:
        """Stop the background worker (pending compiles are dropped)."""
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
