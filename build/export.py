"""Export the dense network to ONNX with dynamic batch and sequence axes, checked against PyTorch."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from recserve import wire
from recserve.backends.dense.network import CTRNet
from recserve.spec import ModelSpec

OPSET = 17


def example_inputs(spec: ModelSpec, rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs of the dense step with ``rows`` rows and ``length`` sequence positions."""
    rng = np.random.default_rng(seed)
    dim = spec.embedding_dim
    lengths = rng.integers(0, length + 1, size=rows)
    inputs = {
        wire.DENSE_NORMALIZED: rng.random((rows, len(spec.normalized_columns)), dtype=np.float32) * 5,
        wire.SPARSE_EMBEDDINGS: rng.normal(0, 0.1, (rows, spec.num_sparse, dim)).astype(np.float32),
        wire.TARGET_EMBEDDING: rng.normal(0, 0.1, (rows, dim)).astype(np.float32),
        wire.HISTORY_EMBEDDINGS: rng.normal(0, 0.1, (rows, length, dim)).astype(np.float32),
        wire.HISTORY_MASK: (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32),
    }
    return {name: inputs[name] for name in wire.dense_net_inputs(spec)}


def torch_predict(net: CTRNet, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The PyTorch reference on numpy inputs."""
    with torch.no_grad():
        return net(*(torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in net.input_names)).numpy()


def export_onnx(spec: ModelSpec, net: CTRNet, path: Path) -> None:
    """Write ``net`` as ONNX; batch and sequence axes stay dynamic."""
    net.eval()
    example = example_inputs(spec, rows=4, length=spec.sequence_buckets[0])
    batch, sequence = wire.BATCH_AXIS, wire.SEQUENCE_AXIS
    dynamic = {
        wire.DENSE_NORMALIZED: {0: batch},
        wire.SPARSE_EMBEDDINGS: {0: batch},
        wire.TARGET_EMBEDDING: {0: batch},
        wire.HISTORY_EMBEDDINGS: {0: batch, 1: sequence},
        wire.HISTORY_MASK: {0: batch, 1: sequence},
        wire.PROBABILITY: {0: batch},
    }
    dynamic = {name: axes for name, axes in dynamic.items() if name in (*net.input_names, wire.PROBABILITY)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            tuple(torch.from_numpy(example[n]) for n in net.input_names),
            str(path),
            input_names=list(net.input_names),
            output_names=[wire.PROBABILITY],
            dynamic_axes=dynamic,
            opset_version=OPSET,
            dynamo=False,
        )
