"""Export the dense network to ONNX with dynamic batch and sequence axes, checked against PyTorch."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from recserve.backends.dense.network import CandidateNet, CTRNet
from recserve.core.contract import attention_inputs, dense_net_inputs, sequence_inputs, sparse_inputs
from recserve.core.names import BATCH_AXIS, DENSE_NORMALIZED, HISTORY_USER, PROBABILITY, SEQUENCE_AXIS
from recserve.core.spec.model import ModelSpec
from recserve.core.user_state_wire import log_weight_inputs

OPSET = 17


def example_inputs(spec: ModelSpec, rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs of the dense step with ``rows`` rows and ``length`` sequence positions.

    Every history's real positions come first (right padding), each group with its own lengths.
    """
    rng = np.random.default_rng(seed)
    inputs = {
        DENSE_NORMALIZED: rng.random((rows, len(spec.normalized_columns)), dtype=np.float32) * 5,
    }
    for name, width, slots in sparse_inputs(spec):
        inputs[name] = rng.normal(0, 0.1, (rows, len(slots), width)).astype(np.float32)
    for group in attention_inputs(spec):
        lengths = rng.integers(0, length + 1, size=rows)
        inputs[group.target] = rng.normal(0, 0.1, (rows, group.width)).astype(np.float32)
        inputs[group.history] = rng.normal(0, 0.1, (rows, length, group.width)).astype(np.float32)
        inputs[group.mask] = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
    for name in log_weight_inputs(spec):  # [user_state]: ln count per token of the first group, 0 on padding
        mask = inputs[attention_inputs(spec)[0].mask]
        inputs[name] = (np.log1p(rng.integers(0, 5, mask.shape)) * mask).astype(np.float32)
    return {name: inputs[name] for name in dense_net_inputs(spec)}


def torch_predict(net: CTRNet, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The PyTorch reference on numpy inputs."""
    with torch.no_grad():
        return net(*(torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in net.input_names)).numpy()


def export_onnx(spec: ModelSpec, net: CTRNet, path: Path) -> None:
    """Write ``net`` as ONNX; batch and sequence axes stay dynamic."""
    example = example_inputs(spec, rows=4, length=spec.serving.sequence_buckets[0])
    _export(net, net.input_names, example, _dynamic_axes(spec, history_rows=BATCH_AXIS), path)


def candidate_inputs(
    spec: ModelSpec, users: int, candidates: int, length: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs of :class:`CandidateNet`: ``users`` histories, ``candidates`` rows for each."""
    rows = example_inputs(spec, users * candidates, length, seed)
    first = np.arange(users) * candidates
    for name in sequence_inputs(spec):
        rows[name] = rows[name][first]
    rows[HISTORY_USER] = np.repeat(np.arange(users, dtype=np.int64), candidates)
    return rows


def export_candidates_onnx(spec: ModelSpec, net: CTRNet, path: Path) -> None:
    """Write the candidate-list graph of ``net`` (:class:`CandidateNet`) as ONNX."""
    module = CandidateNet(net)
    example = candidate_inputs(spec, users=2, candidates=3, length=spec.serving.sequence_buckets[0])
    _export(module, module.input_names, example, _dynamic_axes(spec, history_rows="users"), path)


def _dynamic_axes(spec: ModelSpec, history_rows: str) -> dict[str, dict[int, str]]:
    """Every input's dynamic axes; the histories' rows are ``history_rows`` (the batch, or the users).

    Every group's history and mask share one sequence axis.
    """
    batch, sequence = BATCH_AXIS, SEQUENCE_AXIS
    axes = {name: {0: batch} for name in (*dense_net_inputs(spec), HISTORY_USER)}
    axes.update({name: {0: history_rows, 1: sequence} for name in sequence_inputs(spec)})
    return axes


def _export(
    module: torch.nn.Module,
    input_names: tuple[str, ...],
    example: Mapping[str, np.ndarray],
    dynamic: dict[str, dict[int, str]],
    path: Path,
) -> None:
    module.eval()
    axes = {name: dynamic[name] for name in input_names} | {PROBABILITY: {0: BATCH_AXIS}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            tuple(torch.from_numpy(example[n]) for n in input_names),
            str(path),
            input_names=list(input_names),
            output_names=[PROBABILITY],
            dynamic_axes=axes,
            opset_version=OPSET,
            dynamo=False,
        )
