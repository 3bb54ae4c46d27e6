"""Tensors stay on the device between the steps: the dense step takes the lookup's tensors as they are.

The same objects the ``model.py`` adapters hold, on torch's CPU device: ``dense`` with
``dense_device = "cpu"`` (the ``cuda`` profile's PyTorch path) and ``embedding_lookup`` with its
tables resident on the device. Host arrays handed to a device step are counted as copied to it;
tensors handed over (DLPack) are not.
"""

import numpy as np
import pytest
import torch

from recserve.backends.base import batching
from recserve.backends.base.device_copies import COPY_METRIC, EXECUTES_METRIC, DeviceCopies
from recserve.backends.base.inputs import require
from recserve.backends.dense.runner import DenseStep
from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.store.served import ServedStore
from recserve.build.export import example_inputs, torch_predict
from recserve.build.repository import load_reference_net, version_dir
from recserve.build.synthetic import generate
from recserve.core.candidate_lists import per_candidate_dense_inputs
from recserve.core.contract import left_padded_inputs, sequence_inputs
from recserve.core.names import CANDIDATE_PREFIX, DENSE, EMBEDDING_LOOKUP, PROBABILITY
from recserve.errors import InvalidInput


@pytest.fixture(scope="module")
def dense_step(tiny_spec, tiny_repository):
    step = DenseStep.load(tiny_spec, version_dir(tiny_repository, DENSE, tiny_spec), 1, "cpu", "cpu")
    yield step
    step.close()


def as_tensors(inputs):
    return {name: torch.from_numpy(np.array(array)) for name, array in inputs.items()}


def test_the_dense_device_path_reads_tensors_and_runs_pytorch(dense_step):
    assert dense_step.tensors
    assert type(dense_step.runner._generic).__name__ == "TorchEager"


def test_device_tensors_score_as_host_arrays_with_no_copy_to_the_device(
    tiny_spec, tiny_repository, dense_step
):
    net = load_reference_net(tiny_spec, tiny_repository)
    for rows, length in ((3, 7), (16, 32), (40, 100)):
        sample = example_inputs(tiny_spec, rows, length, seed=rows)
        before = dense_step.copies.totals()
        from_host = dense_step.compute(dense_step.check(sample))[PROBABILITY]
        after_host = dense_step.copies.totals()
        on_device = dense_step.compute(dense_step.check(as_tensors(sample)))[PROBABILITY]
        after_device = dense_step.copies.totals()
        np.testing.assert_array_equal(on_device, from_host)
        np.testing.assert_allclose(on_device, torch_predict(net, sample), rtol=1e-5, atol=1e-7)
        assert after_host["h2d"] - before["h2d"] >= sum(a.nbytes for a in sample.values())
        assert after_device["h2d"] == after_host["h2d"], "device tensors were counted as copied"
        assert after_device["d2h"] > after_host["d2h"]  # the probabilities come back to the host


def test_requests_of_tensors_merge_on_the_device_as_arrays_do(tiny_spec, dense_step):
    requests = [example_inputs(tiny_spec, rows, length, seed=rows) for rows, length in ((2, 5), (3, 9))]
    left = left_padded_inputs(tiny_spec)
    arrays, sizes = batching.merge(requests, left)
    tensors, tensor_sizes = batching.merge([as_tensors(r) for r in requests], left)
    assert sizes == tensor_sizes
    for name, array in arrays.items():
        assert isinstance(tensors[name], torch.Tensor)
        np.testing.assert_array_equal(tensors[name].numpy(), array)
    np.testing.assert_array_equal(
        dense_step.compute(tensors)[PROBABILITY], dense_step.compute(arrays)[PROBABILITY]
    )


def test_a_tensor_of_the_wrong_dtype_is_refused_naming_the_input(tiny_spec, dense_step):
    sample = as_tensors(example_inputs(tiny_spec, 2, 4))
    name = next(iter(sample))
    sample[name] = sample[name].double()
    with pytest.raises(InvalidInput, match=rf"{name}.*float64"):
        dense_step.check(sample)
    with pytest.raises(InvalidInput, match="has dtype int32, expected INT64"):
        require({"ids": torch.zeros((2, 3), dtype=torch.int32)}, "ids", "INT64", 2, 3)
    assert require({"ids": torch.zeros((2, 3), dtype=torch.int64)}, "ids", "INT64", 2, 3).shape == (2, 3)


def test_the_device_lookup_counts_its_copies_per_key(tiny_spec, tiny_repository):
    served = ServedStore.open(
        tiny_spec, version_dir(tiny_repository, EMBEDDING_LOOKUP, tiny_spec), start=False
    )
    try:
        lookup = EmbeddingLookup.for_instance(tiny_spec, served, "cpu", "cpu")
        step = FeaturesToEmbeddings(tiny_spec, lookup)
        assert step.copies is lookup.device_l1.copies
        request = generate(tiny_spec, 12, seed=3).to_wire(tiny_spec)
        keys, _ = lookup.keys_and_tables(step.transform.transform(request))
        step(request)
        totals = step.copies.totals()
        assert totals["h2d"] == 16 * keys.size  # each key and its table id, int64; every table resident
        assert totals["d2h"] == keys.size  # each key's tier, a byte
    finally:
        served.close()


def test_copies_are_declared_at_zero_and_counted_by_step_and_direction():
    copies = DeviceCopies("dense")
    assert {(s.name, s.labels, s.value) for s in copies.samples()} == {
        (COPY_METRIC, (("step", "dense"), ("direction", "h2d")), 0),
        (COPY_METRIC, (("step", "dense"), ("direction", "d2h")), 0),
        (EXECUTES_METRIC, (("step", "dense"),), 0),
    }
    copies.to_device(10)
    copies.to_host(4)
    copies.executed()
    assert copies.totals() == {"h2d": 10, "d2h": 4, "executes": 1}


def candidate_lists(spec, users, count, length, seed=0):
    """Candidate-list inputs of the dense step and the same rows in the row layout (each with its history)."""
    rows = example_inputs(spec, users * count, length, seed=seed)
    owner = np.repeat(np.arange(users), count)
    per_user = {name: rows[name][::count] for name in sequence_inputs(spec)}  # each user's first row
    as_rows = {**rows, **{name: array[owner] for name, array in per_user.items()}}
    lists = {
        CANDIDATE_PREFIX + name: rows[name].reshape(users, count, *rows[name].shape[1:])
        for name in per_candidate_dense_inputs(spec)
    }
    return {**lists, **per_user}, as_rows


def test_a_batch_of_lists_on_the_device_scores_each_list_as_alone_in_one_call(tiny_spec, dense_step):
    shapes = [(3, 20, 30), (1, 7, 8), (2, 1, 64)]  # users, candidates, history length
    lists = [candidate_lists(tiny_spec, u, c, n, seed=i)[0] for i, (u, c, n) in enumerate(shapes)]
    alone = [dense_step.lists(as_tensors(one)) for one in lists]
    calls = []
    scorer = dense_step.lists.scorer
    dense_step.lists.scorer = lambda inputs, owners: calls.append(owners.size) or scorer(inputs, owners)
    together = dense_step.lists.together([as_tensors(one) for one in lists])
    assert calls == [sum(u * c for u, c, _ in shapes)]  # one forward for the whole batch
    for got, expected in zip(together, alone, strict=True):
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_candidate_lists_on_the_device_project_each_history_once_and_score_as_rows(tiny_spec, dense_step):
    lists, as_rows = candidate_lists(tiny_spec, users=3, count=20, length=30, seed=4)
    expected = dense_step.compute(as_rows)[PROBABILITY]
    hits = dense_step.runner.counters.snapshot()
    before = dense_step.copies.totals()
    got = dense_step.lists(as_tensors(lists))
    assert dense_step.runner.counters.snapshot() == hits, "the lists were expanded into rows"
    assert dense_step.copies.totals()["h2d"] == before["h2d"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert got.shape == (60, 1)
