"""The ``dense`` step: the exported ONNX network run with ONNX Runtime on the CPU."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from recserve.backends import tensors
from recserve.backends.errors import ArtifactError, InvalidInput
from recserve.backends.features import require
from recserve.spec import ModelSpec

LOGGER = logging.getLogger(__name__)


def session_threads(instances: int) -> int:
    """Intra-op threads per session so that all instances together fit the machine's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(instances, 1))


class OnnxDenseRunner:
    """Run the dense network with ONNX Runtime."""

    def __init__(self, spec: ModelSpec, model_path: Path, threads: int = 1) -> None:
        import onnxruntime as ort

        self.spec = spec
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ArtifactError(f"dense model {model_path.name!r} does not load: {exc}") from None
        names = tuple(i.name for i in self.session.get_inputs())
        if set(names) != set(tensors.DENSE_NET_INPUTS):
            raise ArtifactError(f"dense model inputs {names} do not match {tensors.DENSE_NET_INPUTS}")

    def check(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Validate the dense step's inputs (shapes must agree with each other and the spec)."""
        spec = self.spec
        dense = require(inputs, tensors.DENSE_NORMALIZED, "FP32", None, len(spec.dense.columns))
        rows, dim = dense.shape[0], spec.embedding_dim
        mask = require(inputs, tensors.HISTORY_MASK, "FP32", rows, None)
        checked = {tensors.DENSE_NORMALIZED: dense, tensors.HISTORY_MASK: mask}
        expected = {
            tensors.SPARSE_EMBEDDINGS: (rows, spec.num_sparse, dim),
            tensors.TARGET_EMBEDDING: (rows, dim),
            tensors.HISTORY_EMBEDDINGS: (rows, mask.shape[1], dim),
        }
        for name, shape in expected.items():
            array = inputs.get(name)
            if array is None:
                raise InvalidInput(name, "is required but missing")
            if array.dtype != np.float32 or array.shape != shape:
                raise InvalidInput(name, f"is {array.dtype}{list(array.shape)}, expected float32{list(shape)}")
            checked[name] = array
        return checked

    def predict(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Click probabilities ``[B, 1]`` for checked inputs."""
        feeds = {name: np.ascontiguousarray(inputs[name]) for name in tensors.DENSE_NET_INPUTS}
        return self.session.run([tensors.PROBABILITY], feeds)[0]
