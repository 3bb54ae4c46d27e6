"""The ``dense`` step: the exported ONNX network run with ONNX Runtime on the CPU.

:class:`OnnxDenseRunner` is the generic graph (dynamic batch and sequence axes). :class:`OnnxBucket`
is the CPU fast path: a session whose batch and sequence axes are fixed to one bucket's shape, so
ONNX Runtime plans memory and picks kernels for that shape (measured by ``recserve lab dense-bench``;
figures in docs/performance.md).
:func:`bucketed_onnx_runner` puts both behind the shared bucket policy.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.backends.base.artifacts import MANIFEST, read_manifest, verified_path
from recserve.backends.base.device_copies import DeviceCopies
from recserve.backends.base.inputs import dtype_name, require
from recserve.backends.base.metrics import ScoreHistogram
from recserve.backends.dense.buckets import (
    Arrays,
    Bucket,
    BucketedRunner,
    BucketPolicy,
    pad_to_bucket,
    spec_buckets,
)
from recserve.backends.dense.candidate_lists import CandidateLists
from recserve.core.contract import (
    attention_inputs,
    dense_net_inputs,
    is_dense_net_input,
    left_padded_inputs,
    sparse_inputs,
)
from recserve.core.names import (
    BATCH_AXIS,
    DENSE,
    DENSE_NET_INPUTS,
    DENSE_NORMALIZED,
    GROUP_INPUTS,
    HISTORY_LOG_WEIGHTS,
    HISTORY_MASK,
    HISTORY_USER,
    PROBABILITY,
    SEQUENCE_AXIS,
    SMALL_DENSE_DIR,
    SPARSE_EMBEDDINGS,
)
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import small_dense_spec
from recserve.errors import ArtifactError, InvalidInput, NonFiniteOutput

if TYPE_CHECKING:
    import onnxruntime as ort

LOGGER = logging.getLogger(__name__)


#: Buckets of fewer rows run on one intra-op thread whatever the cores: waking a second thread costs
#: more than it saves there (docs/performance.md, "The CPU budget, 2026-12-05").
PARALLEL_FROM_ROWS = 32


def session_threads(instances: int) -> int:
    """Intra-op threads per session so that all instances together fit the machine's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(instances, 1))


def bucket_threads(bucket: Bucket, threads: int) -> int:
    """Intra-op threads of one bucket's session: ``threads``, or one below :data:`PARALLEL_FROM_ROWS` rows."""
    return threads if bucket.rows >= PARALLEL_FROM_ROWS else 1


def open_session(model_path: Path, threads: int, bucket: Bucket | None = None) -> ort.InferenceSession:
    """An ONNX Runtime CPU session; with ``bucket``, its batch and sequence axes are fixed to it."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    # Idle intra-op threads sleep instead of spinning: spinning threads take the cores from
    # tritonserver's schedulers and the other step's stub (docs/performance.md, two hops).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if bucket is not None:
        options.add_free_dimension_override_by_name(BATCH_AXIS, bucket.rows)
        options.add_free_dimension_override_by_name(SEQUENCE_AXIS, bucket.length)
    try:
        session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ArtifactError(f"dense model {model_path.name!r} does not load: {exc}") from None
    names = tuple(i.name for i in session.get_inputs())
    # HISTORY_USER: the candidate-list graph only
    unknown = [n for n in names if not is_dense_net_input(n) and n != HISTORY_USER]
    if unknown or SPARSE_EMBEDDINGS not in names:
        raise ArtifactError(
            f"dense model inputs {names} are not among {(*DENSE_NET_INPUTS, HISTORY_USER)} "
            f"and the further attention groups' {GROUP_INPUTS} + '__<sequence>'"
        )
    return session


#: In a shape expected of a dense input: the history length (the mask's width, one per request).
LENGTH = -1


class InputChecks:
    """The dense step's input checks: shapes must agree with each other and the spec.

    What the spec decides (the inputs, their widths) is worked out once, here; a request costs a
    dtype and shape comparison per input.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.names = dense_net_inputs(spec)
        trailing: dict[str, tuple[int, ...]] = {DENSE_NORMALIZED: (len(spec.normalized_columns),)}
        for name, width, slots in sparse_inputs(spec):
            trailing[name] = (len(slots), width)
        for group in attention_inputs(spec):  # every group's positions: as many as the first's
            trailing.update(
                {group.target: (group.width,), group.history: (LENGTH, group.width), group.mask: (LENGTH,)}
            )
        trailing[HISTORY_LOG_WEIGHTS] = (LENGTH,)  # with [user_state] on: the first group's
        trailing.pop(HISTORY_MASK, None)  # checked first: it gives the length
        self.has_mask = HISTORY_MASK in self.names
        self.expected = tuple((name, shape) for name, shape in trailing.items() if name in self.names)

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The inputs the network takes, checked (raises ``InvalidInput`` naming the first bad one)."""
        sparse = inputs.get(SPARSE_EMBEDDINGS)
        if sparse is None:
            raise InvalidInput(SPARSE_EMBEDDINGS, "is required but missing")
        rows = sparse.shape[0]
        checked: dict[str, np.ndarray] = {}
        length = 0
        if self.has_mask:
            checked[HISTORY_MASK] = require(inputs, HISTORY_MASK, "FP32", rows, None)
            length = checked[HISTORY_MASK].shape[1]
        for name, trailing in self.expected:
            array = inputs.get(name)
            if array is None:
                raise InvalidInput(name, "is required but missing")
            shape = (rows, *(length if d == LENGTH else d for d in trailing))
            if (array.dtype != np.float32 and dtype_name(array) != "float32") or array.shape != shape:
                raise InvalidInput(
                    name, f"is {dtype_name(array)}{list(array.shape)}, expected float32{list(shape)}"
                )
            checked[name] = array
        return checked


class OnnxDenseRunner:
    """Run the dense network with ONNX Runtime at any shape (the generic graph)."""

    def __init__(self, spec: ModelSpec, model_path: Path, threads: int = 1) -> None:
        self.spec = spec
        self.session = open_session(model_path, threads)

    def predict(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Click probabilities ``[B, 1]`` for checked inputs."""
        feeds = {name: np.ascontiguousarray(inputs[name]) for name in dense_net_inputs(self.spec)}
        return self.session.run([PROBABILITY], feeds)[0]


class OnnxBucket:
    """A session fixed to one bucket's shape, with reusable padded input buffers, warmed once.

    Not reentrant: the buffers are shared by every call (one Triton instance calls it serially).
    """

    def __init__(self, spec: ModelSpec, model_path: Path, bucket: Bucket, threads: int = 1) -> None:
        self.bucket = bucket
        self.left = left_padded_inputs(spec)
        self.session = open_session(model_path, threads, bucket)
        shapes = bucket.input_shapes(spec)
        self.buffers = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        self.session.run([PROBABILITY], self.buffers)  # warm-up: first-run allocations happen here

    def __call__(self, inputs: Arrays) -> np.ndarray:
        """Probabilities ``[bucket.rows, 1]`` for inputs of at most the bucket's shape (padded here)."""
        return self.session.run([PROBABILITY], pad_to_bucket(inputs, self.bucket, self.buffers, self.left))[0]


def bucketed_onnx_runner(
    spec: ModelSpec,
    model_path: Path,
    threads: int = 1,
    policy: BucketPolicy | None = None,
    prepare: tuple[Bucket, ...] | None = None,
    background: bool = True,
) -> BucketedRunner:
    """The CPU dense path: per-bucket sessions (the spec's grid by default) plus the dynamic one.

    Args:
        spec: the model spec (buckets, shapes).
        model_path: the verified ONNX file.
        threads: intra-op threads of the sessions (see :func:`session_threads`; small buckets take
            one, :func:`bucket_threads`).
        policy: the bucket policy; the spec's by default.
        prepare: buckets compiled at load; the spec's grid by default.
        background: compile missing buckets on a worker thread.
    """
    generic = OnnxDenseRunner(spec, model_path, threads)
    return BucketedRunner(
        policy or BucketPolicy.from_spec(spec),
        lambda bucket: OnnxBucket(spec, model_path, bucket, bucket_threads(bucket, threads)),
        generic.predict,
        spec_buckets(spec) if prepare is None else prepare,
        background,
    )


class DenseStep:
    """What the Triton ``dense`` model holds: the input checks and a bucketed runner.

    Args:
        spec: the model spec.
        runner: ONNX Runtime buckets on the CPU, CUDA graphs (or TensorRT) on a GPU.
        version: the dense version served (a label of the served-probability histogram).
        candidates: the candidate-list ONNX graph (the CPU profile).
        scorer: the network's candidate-list forward on the device (see :class:`CandidateLists`).
        copies: where the runner counts its host-device bytes; given for a device runner (PyTorch
            or TensorRT), whose inputs are then read as torch tensors (:attr:`tensors`).
    """

    def __init__(
        self,
        spec: ModelSpec,
        runner: BucketedRunner,
        version: str = "",
        candidates: ort.InferenceSession | None = None,
        copies: DeviceCopies | None = None,
        scorer: Callable[[Mapping[str, Any], np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.spec = spec
        self.runner = runner
        #: inputs are taken as torch tensors where Triton holds them (DLPack), not as numpy arrays
        self.tensors = copies is not None
        self.copies = copies or DeviceCopies(DENSE)
        self.scores = ScoreHistogram((("dense_version", version),))
        #: validates one request's inputs (raises ``InvalidInput``)
        self.check = InputChecks(spec)
        #: candidate lists (the candidates ensemble), with the candidate-list graph when given
        self.lists = CandidateLists(
            spec, lambda rows: self.runner.predict(self.check(rows)), candidates, scorer
        )
        #: the smaller network of [degrade.small_dense], served beside this one (None: none)
        self.small: DenseStep | None = None

    @classmethod
    def load(
        cls, spec: ModelSpec, version_dir: Path, instances: int, device: str = "cpu", torch_device: str = ""
    ) -> DenseStep:
        """The step of a version folder (:meth:`load_one`), with its smaller network where the spec has one.

        A version without it (an imported network; one written before the spec asked for it) scores
        the levels of the smaller network with the full one, and says so in the log.
        """
        step = cls.load_one(spec, version_dir, instances, device, torch_device)
        small = small_dense_spec(spec)
        if small is not None and (version_dir / SMALL_DENSE_DIR / MANIFEST).is_file():
            step.small = cls.load_one(small, version_dir / SMALL_DENSE_DIR, instances, device, torch_device)
        elif small is not None:
            LOGGER.warning(
                "dense version %s has no smaller network (%s/): its [degrade] levels %s are scored by the "
                "full one; run 'recserve build' to distil it",
                version_dir.name,
                SMALL_DENSE_DIR,
                sorted(spec.degrade.small_levels),
            )
        return step

    @classmethod
    def load_one(
        cls, spec: ModelSpec, version_dir: Path, instances: int, device: str = "cpu", torch_device: str = ""
    ) -> DenseStep:
        """Verify the artifacts of a version folder and prepare every bucket of the spec's grid.

        Args:
            spec: the model spec.
            version_dir: the ``dense`` version folder (manifest, ONNX, weights).
            instances: instances of the step on this machine (threads are shared among them).
            device: ``cpu`` (ONNX Runtime buckets) or ``cuda:N``: the TensorRT engine's profiles where
                the build made one and TensorRT is installed, else a CUDA graph per bucket (an imported
                model has no PyTorch weights for those: it runs on ONNX Runtime; on GPUs the ``gpu``
                profile serves its TensorRT engine with Triton's TensorRT backend).
            torch_device: ``cpu`` runs the device path (PyTorch, inputs as tensors) on torch's CPU
                device, as CI tests it; empty: by ``device``.
        """
        manifest = read_manifest(version_dir)
        files = manifest["files"]
        version = version_dir.name
        device = torch_device or device
        if (device == "cpu" and not torch_device) or "weights" not in files:
            if device != "cpu":
                LOGGER.warning(
                    "an imported dense model has no PyTorch weights: ONNX Runtime serves it on the CPU"
                )
            model_path = verified_path(version_dir, files["model"])
            threads = session_threads(instances)
            candidates = (
                open_session(verified_path(version_dir, files["candidates"]), threads)
                if "candidates" in files
                else None
            )
            return cls(spec, bucketed_onnx_runner(spec, model_path, threads), version, candidates)
        from recserve.backends.dense.torch_runners import TorchEager, bucketed_torch_runner, load_net

        net = load_net(spec, verified_path(version_dir, files["weights"]))
        copies = DeviceCopies(DENSE)
        if "plan" in files and device != "cpu" and importlib.util.find_spec("tensorrt") is not None:
            from recserve.backends.dense.tensorrt_runner import bucketed_tensorrt_runner

            plan = verified_path(version_dir, files["plan"]).read_bytes()
            buckets = tuple(Bucket(rows, length) for rows, length in manifest["tensorrt"]["profiles"])
            model_path = verified_path(version_dir, files["model"])
            runner = bucketed_tensorrt_runner(spec, plan, buckets, model_path, net, device, copies=copies)
            return cls(spec, runner, version, copies=copies)
        from recserve.backends.dense.list_graphs import list_scorer

        runner = bucketed_torch_runner(spec, net, device, prepare=spec_buckets(spec), copies=copies)
        scorer = list_scorer(spec, TorchEager(net, device, copies=copies)) if net.has_attention else None
        return cls(spec, runner, version, copies=copies, scorer=scorer)

    def compute(self, merged: Arrays) -> dict[str, np.ndarray]:
        """Probabilities of a merged dynamic batch."""
        return {PROBABILITY: self.runner.predict(merged)}

    def score_lists(self, lists: list[Arrays]) -> list[np.ndarray]:
        """A batch's candidate lists scored in one call, each list's probabilities accepted.

        The device path's scorer checks finiteness on the device, in the forward (its one read of the
        scores says whether any is not finite); the others' scores are checked here, on the host.

        Raises:
            NonFiniteOutput: a list's probabilities are not all finite (then each list is answered alone).
        """
        scores = self.lists.together(lists)
        if self.lists.checks_finite:
            for probability in scores:
                self.scores.observe(probability.ravel())
            return scores
        finite = np.isfinite(np.concatenate([s.ravel() for s in scores]))
        if not finite.all():
            raise NonFiniteOutput("a candidate list's probabilities are not finite")
        for probability in scores:
            self.accept({PROBABILITY: probability})
        return scores

    def accept_all(self, outputs: Mapping[str, object], count: bool = True) -> bool:
        """Count a merged batch's probabilities when all are finite (True); False: none is counted.

        One check for a dynamic batch; where it fails, :meth:`accept` finds the requests to refuse.
        """
        probability = outputs[PROBABILITY]
        if not isinstance(probability, np.ndarray) or not np.isfinite(probability).all():
            return False  # a torch tensor, or a batch to look into request by request
        if count:
            self.scores.observe(probability)
        return True

    def accept(self, outputs: Mapping[str, object], count: bool = True) -> None:
        """Let one request's probabilities out only when all are finite; count the ones served.

        Args:
            outputs: one request's outputs.
            count: add them to :attr:`scores` (not for warm-up requests: no client asked for them).

        Raises:
            NonFiniteOutput: a row's probability is NaN or infinite (that request alone fails).
        """
        probability = outputs[PROBABILITY]
        if hasattr(probability, "detach"):  # a torch tensor, maybe on a GPU
            probability = probability.detach().cpu().numpy()
        values = np.asarray(probability).ravel()
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise NonFiniteOutput(
                f"the dense network returned {values[bad[0]]} as the probability of row {bad[0]} "
                f"({bad.size} of {values.size} rows not finite); the request is refused"
            )
        if count:
            self.scores.observe(values)

    def close(self) -> None:
        """Stop background compiles."""
        self.runner.close()
        if self.small is not None:
            self.small.close()
