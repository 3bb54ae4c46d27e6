"""The whole ``ctr`` path in one process: feature transform, embedding lookup, dense network.

Used as the reference in parity tests (with the PyTorch network) and as the no-server bound in
benchmarks (with ONNX Runtime): the same code the Triton steps run, without the server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

import numpy as np

from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.store.tiered import TieredStore
from recserve.core.spec.model import ModelSpec

DenseFn = Callable[[Mapping[str, np.ndarray]], np.ndarray]


class InProcessPipeline:
    """Raw request tensors in, probabilities ``[B]`` out."""

    def __init__(self, spec: ModelSpec, store: TieredStore, dense: DenseFn) -> None:
        self.lookup = EmbeddingLookup(spec, store)
        self.embeddings = FeaturesToEmbeddings(spec, self.lookup)
        self.dense = dense

    def predict(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Probabilities for one batch of raw inputs (raises ``InvalidInput`` like the server)."""
        # no device L1 here: the lookup answers with numpy arrays on the host
        return np.asarray(self.dense(cast(dict[str, np.ndarray], self.embeddings(inputs)))).reshape(-1)
