"""Candidate lists at static shapes on the device: a captured CUDA graph per (list bucket, history bucket).

The device path's candidate-list forward (:meth:`CTRNet.score
<recserve.backends.dense.network.CTRNet.score>` with each row's user) runs as the row path does
(:mod:`~recserve.backends.dense.torch_runners`): a batch of lists is copied and zero-padded on the
device into static tensors of one bucket's shape, and the forward captured at that shape is
replayed::

    per-candidate [rows, ...] ──pad──▶ [list bucket, ...]                   ┐
    per-user [users, L, ...]  ──pad──▶ [users bucket, history bucket, ...]  ├─▶ forward
    each row's user [rows]    ──pad──▶ [list bucket] (padding: user 0)      ┘      │
                                       [probabilities of the bucket, non-finite count] ◀─┘

The list bucket is the smallest batch bucket of the spec holding the rows, the history bucket the
smallest sequence bucket holding the positions, the users bucket the next power of two (one user's
list: 1). The forward ends on the device with the count of probabilities that are not finite,
written behind them in the same output, so the one read of the scores also says whether any is
not finite: nothing waits for the device before the final scores. Padded rows and users are zeros
(mask 0), so the real rows' probabilities are those of the eager forward.

On a CPU (``device="cpu"``, as CI runs it) the same padding and the same forward run eagerly at
the bucket's shape; only the capture needs CUDA. A shape no bucket holds (more rows than the
largest batch bucket) is scored eagerly, as is a bucket whose capture failed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from recserve.backends.dense.buckets import Bucket
from recserve.backends.dense.torch_runners import WARMUP_ITERATIONS, Feeds, TorchEager, on_device
from recserve.core.candidate_lists import per_candidate_dense_inputs
from recserve.core.contract import left_padded_inputs, sequence_inputs
from recserve.core.spec.model import ModelSpec
from recserve.errors import NonFiniteOutput

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class ListBucket:
    """One static shape of the candidate-list forward: candidate rows, users and history positions."""

    rows: int
    users: int
    length: int


def list_buckets(spec: ModelSpec) -> tuple[ListBucket, ...]:
    """One user's lists at every batch bucket × every sequence bucket (what a served step prepares)."""
    return tuple(
        ListBucket(rows, 1, length)
        for length in spec.serving.sequence_buckets
        for rows in spec.serving.batch_buckets
    )


def fitting_bucket(spec: ModelSpec, rows: int, users: int, length: int) -> ListBucket | None:
    """The smallest bucket holding ``rows`` candidates of ``users`` users with ``length`` positions.

    None when the rows exceed the largest batch bucket or the positions the largest sequence bucket.
    """
    row_bucket = next((b for b in spec.serving.batch_buckets if b >= rows), None)
    length_bucket = next((b for b in spec.serving.sequence_buckets if b >= length), None)
    if row_bucket is None or length_bucket is None:
        return None
    users_bucket = 1 << max(users - 1, 0).bit_length()
    return ListBucket(row_bucket, min(users_bucket, row_bucket), length_bucket)


def report_non_finite(scores: np.ndarray) -> NonFiniteOutput:
    """The error refusing probabilities of which some are NaN or infinite (naming the first such row)."""
    values = scores.ravel()
    bad = np.flatnonzero(~np.isfinite(values))
    return NonFiniteOutput(
        f"the dense network returned {values[bad[0]]} as the probability of row {bad[0]} "
        f"({bad.size} of {values.size} rows not finite); the request is refused"
    )


class StaticList:
    """One list bucket's static device tensors and the forward over them (eagerly: the CPU stand-in).

    Not reentrant: the static tensors are shared by every call (one Triton instance calls it serially).
    """

    #: the stream the bucket runs on (CUDA graphs only)
    stream: torch.cuda.Stream | None = None

    @torch.inference_mode()
    def __init__(self, eager: TorchEager, spec: ModelSpec, bucket: ListBucket) -> None:
        self.eager, self.bucket = eager, bucket
        device = eager.device
        shapes = Bucket(bucket.rows, bucket.length).input_shapes(spec)
        self.per_user = tuple(n for n in sequence_inputs(spec) if n in shapes)
        self.left: Collection[str] = left_padded_inputs(spec)
        for name in self.per_user:  # a row per user, not per candidate
            shapes[name] = (bucket.users, *shapes[name][1:])
        self.per_candidate = tuple(n for n in per_candidate_dense_inputs(spec) if n in shapes)
        self.inputs = {name: torch.zeros(shapes[name], device=device) for name in shapes}
        self.owners = torch.zeros(bucket.rows, dtype=torch.int64, device=device)
        # each row's user, padded here and copied up in one copy (pinned for an asynchronous one)
        self.host_owners = torch.zeros(bucket.rows, dtype=torch.int64)
        if device.type == "cuda":
            self.host_owners = self.host_owners.pin_memory()
        self.host_owners_view = self.host_owners.numpy()

    def forward(self) -> torch.Tensor:
        """``[rows + 1]``: the bucket's probabilities, then how many of them are not finite."""
        scores = self.eager.score_lists(self.inputs, self.owners).reshape(-1)
        return torch.cat([scores, torch.isfinite(scores).logical_not().sum().float().reshape(1)])

    def run(self) -> torch.Tensor:
        """The forward on the static tensors as they are now."""
        return self.forward()

    def load(self, inputs: Feeds, owners: np.ndarray) -> None:
        """Copy and zero-pad one batch of lists into the static tensors (on the device)."""
        rows = owners.size
        copies = self.eager.copies
        for name in self.per_candidate:
            target = self.inputs[name]
            target.zero_()
            target[:rows].copy_(on_device(inputs[name], self.eager.device, copies))
        for name in self.per_user:
            target, array = self.inputs[name], on_device(inputs[name], self.eager.device, copies)
            users, length = array.shape[:2]
            start = self.bucket.length - length if name in self.left else 0
            target.zero_()
            target[:users, start : start + length].copy_(array)
        self.host_owners_view[:rows] = owners
        self.host_owners_view[rows:] = 0
        self.owners.copy_(self.host_owners, non_blocking=True)
        if self.eager.device.type != "cpu":  # a copy up only where the device is not the host
            copies.to_device(self.host_owners_view.nbytes)

    @torch.inference_mode()
    def __call__(self, inputs: Feeds, owners: np.ndarray) -> tuple[np.ndarray, int]:
        """Probabilities ``[rows, 1]`` of the lists and how many of the bucket's are not finite.

        One read of the device: the probabilities and the count come back together.
        """
        rows = owners.size
        stream = self.stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:  # the inputs were made on the default stream
                stream.wait_stream(torch.cuda.default_stream(self.eager.device))
            self.load(inputs, owners)
            output = self.run()
            self.eager.copies.to_host(output.numel() * output.element_size())
            host = output.cpu().numpy()
        return host[:rows, None].copy(), int(host[-1])


class CapturedList(StaticList):
    """The same bucket with its forward captured as a CUDA graph (replayed on its own stream)."""

    def __init__(self, eager: TorchEager, spec: ModelSpec, bucket: ListBucket) -> None:
        if eager.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        super().__init__(eager, spec, bucket)
        self.stream = torch.cuda.Stream(eager.device)
        self.stream.wait_stream(torch.cuda.current_stream(eager.device))  # the static tensors' zero fill
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for _ in range(WARMUP_ITERATIONS):  # on the side stream, before capture
                self.forward()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local"):
                self.output = self.forward()
        self.stream.synchronize()

    def run(self) -> torch.Tensor:
        """Replay the captured forward; its output tensor holds the result."""
        self.graph.replay()
        return self.output


class ListGraphs:
    """The device path's candidate-list scorer: lists padded to buckets, a CUDA graph per bucket on CUDA.

    Called as ``scorer(inputs, owners)`` by
    :class:`~recserve.backends.dense.candidate_lists.CandidateLists`: the per-candidate inputs flat
    (``[rows, ...]``), the histories and masks a row per user, and each row's user. Buckets are made
    when first needed (``prepare``: at load) and kept.

    Args:
        spec: the model spec (its batch and sequence buckets).
        eager: the network on its device (the forward, its precision, the copy counter).
        prepare: buckets made before the first call.
    """

    #: the scores come back checked for finiteness on the device (the caller need not check them)
    checks_finite = True

    def __init__(self, spec: ModelSpec, eager: TorchEager, prepare: tuple[ListBucket, ...] = ()) -> None:
        self.spec, self.eager = spec, eager
        self.per_user = sequence_inputs(spec)
        self._lock = threading.Lock()
        self._failed: set[ListBucket] = set()
        self._compiled: dict[ListBucket, StaticList] = {}
        for bucket in prepare:
            self._made(bucket)

    @property
    def buckets(self) -> tuple[ListBucket, ...]:
        """The buckets made so far, smallest first."""
        return tuple(sorted(self._compiled))

    def _made(self, bucket: ListBucket) -> StaticList | None:
        """The bucket's static forward, made on first use (None: its capture failed)."""
        made = self._compiled.get(bucket)
        if made is not None or bucket in self._failed:
            return made
        with self._lock:
            made = self._compiled.get(bucket)
            if made is None and bucket not in self._failed:
                try:
                    cuda = self.eager.device.type == "cuda"
                    made = (CapturedList if cuda else StaticList)(self.eager, self.spec, bucket)
                except Exception:  # the eager forward keeps serving that shape
                    LOGGER.exception("capturing the candidate-list bucket %s failed; served eagerly", bucket)
                    self._failed.add(bucket)
                    return None
                self._compiled = {**self._compiled, bucket: made}  # one reference swap
        return made

    def __call__(self, inputs: Mapping[str, np.ndarray | torch.Tensor], owners: np.ndarray) -> np.ndarray:
        """Probabilities ``[rows, 1]`` of checked lists whose rows' users are ``owners``.

        Raises:
            NonFiniteOutput: a probability of a real row is NaN or infinite.
        """
        names = [n for n in self.per_user if n in inputs]
        users, length = (inputs[names[0]].shape[0], inputs[names[0]].shape[1]) if names else (1, 1)
        bucket = fitting_bucket(self.spec, owners.size, int(users), int(length))
        made = None if bucket is None else self._made(bucket)
        if made is None:
            scores = self.eager.lists(inputs, owners)
            bad = int((~np.isfinite(scores)).sum())
        else:
            scores, bad = made(inputs, owners)
        if bad and not np.isfinite(scores).all():  # padding rows aside: a real row is not finite
            raise report_non_finite(scores)
        return scores


def list_scorer(spec: ModelSpec, eager: TorchEager) -> ListGraphs:
    """The scorer a served ``dense`` instance holds: on CUDA, one user's list buckets captured at load."""
    return ListGraphs(spec, eager, list_buckets(spec) if eager.device.type == "cuda" else ())
