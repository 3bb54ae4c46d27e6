"""A built model (the tiny spec's): ONNX agrees with PyTorch, padding included.

That the trained default model learned the planted signal is tests/integration/test_trained_model.py.
"""

import numpy as np
import pytest

from recserve.backends.base.artifacts import read_manifest, verified_path
from recserve.backends.dense.runner import OnnxDenseRunner
from recserve.build.export import example_inputs, torch_predict
from recserve.build.repository import load_reference_net, version_dir
from recserve.core.names import HISTORY_EMBEDDINGS, HISTORY_MASK


@pytest.fixture(scope="module")
def spec(tiny_spec):
    """What these tests check holds for any built model: the tiny one (tests/unit/conftest.py)."""
    return tiny_spec


@pytest.fixture(scope="module")
def net(spec, tiny_repository):
    return load_reference_net(spec, tiny_repository)


@pytest.fixture(scope="module")
def runner(spec, tiny_repository):
    root = version_dir(tiny_repository, "dense", spec)
    return OnnxDenseRunner(spec, verified_path(root, read_manifest(root)["files"]["model"]))


@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_onnx_matches_pytorch_at_every_sequence_bucket(spec, net, runner, rows):
    for length in spec.serving.sequence_buckets:
        sample = example_inputs(spec, rows, length, seed=rows * 1000 + length)
        np.testing.assert_allclose(runner.predict(sample), torch_predict(net, sample), rtol=1e-5, atol=1e-6)


def test_padding_never_changes_real_rows(spec, net, runner):
    sample = example_inputs(spec, rows=5, length=8, seed=3)
    base = runner.predict(sample)
    wider = {k: v.copy() for k, v in sample.items()}
    wider[HISTORY_EMBEDDINGS] = np.concatenate(
        [
            sample[HISTORY_EMBEDDINGS],
            np.random.default_rng(0).normal(size=(5, 24, spec.model.embedding_dim)).astype(np.float32),
        ],
        axis=1,
    )
    wider[HISTORY_MASK] = np.pad(sample[HISTORY_MASK], ((0, 0), (0, 24)))
    np.testing.assert_allclose(runner.predict(wider), base, atol=1e-6)
    more_rows = {
        k: np.concatenate([v, np.random.default_rng(1).random(v.shape, dtype=np.float32)])
        for k, v in sample.items()
    }
    np.testing.assert_allclose(runner.predict(more_rows)[:5], base, atol=1e-6)
    np.testing.assert_allclose(torch_predict(net, wider), torch_predict(net, sample), atol=1e-6)
