"""An ONNX network run under PyTorch for the learner: ONNX Runtime's scores, PyTorch's gradients."""

import numpy as np
import onnx
import pytest
import tomllib
import torch
from onnx import TensorProto, helper

from recserve.backends.dense.network import CTRNet
from recserve.backends.dense.onnx_torch import OnnxGraph, OnnxNet
from recserve.backends.dense.runner import open_session
from recserve.build.export import example_inputs, export_onnx
from recserve.core.names import DENSE_NORMALIZED, PROBABILITY, SPARSE_EMBEDDINGS
from recserve.core.spec.parse import parse_spec
from recserve.loop.learner import Learner
from tests.loop_examples import examples
from tests.model_exports import DEEPFM_SPEC
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


class FMHead(torch.nn.Module):
    """A user's DeepFM head over the DeepFM spec's inputs (first order, FM, MLP): what a model zoo exports."""

    inputs = (DENSE_NORMALIZED, "sparse_embeddings", "sparse_embeddings__1", "sparse_embeddings__8")
    has_dense = True

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(1 + 32 + 16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def forward(self, number, wide, linear, narrow):  # noqa: D102
        first = linear.sum(dim=(1, 2))[:, None]
        fm = sum(0.5 * (v.sum(1) ** 2 - (v**2).sum(1)).sum(1, keepdim=True) for v in (wide, narrow))
        return torch.sigmoid(
            first + fm + self.mlp(torch.cat([number, wide.flatten(1), narrow.flatten(1)], 1))
        )

    def score(self, named):  # as the learner scores through a network
        return self(*(named[name] for name in self.inputs))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the TorchScript exporter, as build's
def test_a_deepfm_graph_trains_its_narrow_and_wide_rows_as_its_pytorch_module_does(tmp_path):
    deepfm = parse_spec(tomllib.loads(DEEPFM_SPEC))
    torch.manual_seed(1)
    head = FMHead().eval()
    example = (torch.rand(2, 1), torch.randn(2, 2, 16), torch.randn(2, 4, 1), torch.randn(2, 2, 8))
    path = tmp_path / "deepfm.onnx"
    axes = {name: {0: "batch"} for name in [*FMHead.inputs, PROBABILITY]}
    torch.onnx.export(head, example, str(path), input_names=list(FMHead.inputs), output_names=[PROBABILITY],
                      dynamic_axes=axes, dynamo=False)  # fmt: skip
    tables, store = spec_store(deepfm)
    through_torch = Learner(deepfm, store, head, learning_rate=0.05)
    through_onnx = Learner(deepfm, store, OnnxNet(path), learning_rate=0.05)
    batch = examples(deepfm, tables, [1, 0, 1, 0, 1])
    for learner in (through_torch, through_onnx):
        learner.train(batch)
    assert through_onnx.rows.keys() == through_torch.rows.keys()
    assert {store.table_names[t] for t, _ in through_onnx.rows} >= {"site_id_linear", "C15", "app_id"}
    for key, row in through_onnx.rows.items():
        np.testing.assert_allclose(row, through_torch.rows[key], atol=1e-5)
