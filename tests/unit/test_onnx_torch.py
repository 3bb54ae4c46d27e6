"""An ONNX network run under PyTorch for the learner: ONNX Runtime's scores, PyTorch's gradients."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from recserve.backends.dense.network import CTRNet
from recserve.backends.dense.runner import open_session
from recserve.build.export import example_inputs, export_onnx
from recserve.core.names import PROBABILITY, SPARSE_EMBEDDINGS
from recserve.loop.learner import Learner
from recserve.backends.dense.onnx_torch import OnnxGraph, OnnxNet
from tests.loop_examples import examples
from tests.store_tables import spec_store


@pytest.fixture
def exported(spec, tmp_path):
    torch.manual_seed(3)
    net = CTRNet(spec).eval()
    path = tmp_path / "model.onnx"
    export_onnx(spec, net, path)
    return net, path


def test_the_graph_scores_as_onnx_runtime_and_differentiates_as_pytorch(spec, exported):
    net, path = exported
    graph, session = OnnxGraph(path), open_session(path, threads=1)
    for length in spec.serving.sequence_buckets[:2]:
        inputs = example_inputs(spec, rows=5, length=length, seed=length)
        expected = session.run([PROBABILITY], inputs)[0]
        named = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in inputs.items()}
        named[SPARSE_EMBEDDINGS].requires_grad_(True)
        scored = graph(named)[PROBABILITY]
        np.testing.assert_allclose(scored.detach().numpy(), expected, atol=1e-6)
        scored.sum().backward()
        again = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in inputs.items()}
        again[SPARSE_EMBEDDINGS].requires_grad_(True)
        net.score(again).sum().backward()
        np.testing.assert_allclose(named[SPARSE_EMBEDDINGS].grad, again[SPARSE_EMBEDDINGS].grad, atol=1e-6)


def test_rows_trained_through_the_onnx_network_are_those_trained_through_the_pytorch_one(spec, exported):
    net, path = exported
    tables, store = spec_store(spec)
    through_torch = Learner(spec, store, net, learning_rate=0.05)
    through_onnx = Learner(spec, store, OnnxNet(path), learning_rate=0.05)
    batch = examples(spec, tables, [1, 0, 1, 0])
    for learner in (through_torch, through_onnx):
        learner.train(batch)
    assert through_onnx.rows.keys() == through_torch.rows.keys() and through_onnx.rows
    for key, row in through_onnx.rows.items():
        np.testing.assert_allclose(row, through_torch.rows[key], atol=1e-5)


def test_a_graph_with_an_operator_it_cannot_run_is_refused_by_name():
    node = helper.make_node("Hardmax", ["x"], ["probability"])
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("probability", TensorProto.FLOAT, [1, 2])],
    )  # fmt: skip
    with pytest.raises(ValueError, match="uses Hardmax"):
        OnnxGraph(helper.make_model(graph).SerializeToString())
    assert onnx.checker.check_model(helper.make_model(graph)) is None
