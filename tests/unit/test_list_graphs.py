"""Candidate lists at static shapes (a CUDA graph per bucket on CUDA; the same forward eagerly on the CPU).

The padded, bucketed forward must give the eager forward's probabilities, keep one set of static
tensors per bucket, and say on the device whether a probability is not finite.
"""

import numpy as np
import pytest
import torch

from recserve.backends.dense.list_graphs import ListBucket, ListGraphs, fitting_bucket, list_scorer
from recserve.backends.dense.network import CTRNet
from recserve.backends.dense.torch_runners import TorchEager
from recserve.build.export import example_inputs
from recserve.core.candidate_lists import per_candidate_dense_inputs
from recserve.core.contract import sequence_inputs
from recserve.errors import NonFiniteOutput
from tests.unit.helpers import DEVICES


def flat_lists(spec, counts, length, seed=0):
    """The scorer's inputs for users with ``counts`` candidates each: flat rows, a row per user, owners."""
    rows = example_inputs(spec, sum(counts), length, seed=seed)
    owners = np.repeat(np.arange(len(counts)), counts)
    firsts = np.cumsum([0, *counts[:-1]])
    inputs = {name: torch.from_numpy(rows[name]) for name in per_candidate_dense_inputs(spec)}
    inputs.update({name: torch.from_numpy(rows[name][firsts]) for name in sequence_inputs(spec)})
    return inputs, owners


@pytest.fixture(scope="module", params=DEVICES)
def eager(request, tiny_spec):
    torch.manual_seed(3)
    return TorchEager(CTRNet(tiny_spec), request.param)


def on(device, inputs):
    return {name: tensor.to(device) for name, tensor in inputs.items()}


def test_lists_padded_to_a_bucket_score_as_the_eager_forward(tiny_spec, eager):
    graphs = ListGraphs(tiny_spec, eager)
    for counts, length, seed in (([5], 8, 1), ([7], 6, 2), ([3, 9], 20, 3), ([40], 32, 4)):
        inputs, owners = flat_lists(tiny_spec, counts, length, seed)
        inputs = on(eager.device, inputs)
        got = graphs(inputs, owners)
        assert got.shape == (sum(counts), 1)
        np.testing.assert_allclose(got, eager.lists(inputs, owners), rtol=1e-5, atol=1e-6)
    # 5 and 7 candidates of one user with 8 and 6 positions share one bucket's static tensors
    assert graphs.buckets == (ListBucket(8, 1, 8), ListBucket(32, 2, 32), ListBucket(64, 1, 32))


def test_the_bucket_is_the_smallest_holding_rows_users_and_positions(tiny_spec):
    assert fitting_bucket(tiny_spec, 1, 1, 1) == ListBucket(1, 1, 8)
    assert fitting_bucket(tiny_spec, 200, 3, 100) == ListBucket(256, 4, 128)
    assert fitting_bucket(tiny_spec, 8, 8, 8) == ListBucket(8, 8, 8)
    assert fitting_bucket(tiny_spec, 257, 1, 8) is None  # more rows than any bucket: eager
    assert fitting_bucket(tiny_spec, 8, 1, 129) is None


def test_a_list_larger_than_every_bucket_is_scored_eagerly(tiny_spec):
    torch.manual_seed(3)
    eager = TorchEager(CTRNet(tiny_spec), "cpu")
    graphs = ListGraphs(tiny_spec, eager)
    inputs, owners = flat_lists(tiny_spec, [300], 8, seed=5)
    np.testing.assert_array_equal(graphs(inputs, owners), eager.lists(inputs, owners))
    assert graphs.buckets == ()


def test_a_probability_that_is_not_finite_is_found_on_the_device_and_refused(tiny_spec):
    torch.manual_seed(3)
    graphs = list_scorer(tiny_spec, TorchEager(CTRNet(tiny_spec), "cpu"))
    assert graphs.checks_finite and graphs.buckets == ()  # on the CPU: made when first needed
    inputs, owners = flat_lists(tiny_spec, [6], 8, seed=6)
    bucket = fitting_bucket(tiny_spec, 6, 1, 8)
    graphs(inputs, owners)
    made = graphs._made(bucket)
    scores, bad = made(inputs, owners)
    assert bad == 0 and np.isfinite(scores).all()
    inputs[per_candidate_dense_inputs(tiny_spec)[0]][4] = float("nan")
    scores, bad = made(inputs, owners)
    assert bad == 1  # counted in the forward, read with the scores
    with pytest.raises(NonFiniteOutput, match="probability of row 4"):
        graphs(inputs, owners)
