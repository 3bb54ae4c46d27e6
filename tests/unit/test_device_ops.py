"""The device path's operators and host synchronisations per batch, counted on the CPU (no GPU needed).

The lookup step's device path (keys made on the device, every table resident) and the dense step's
candidate-list path run under torch on the CPU inside an operator counter
(:mod:`recserve.perf.lab.device_ops`). Targets (issue: the GPU path, second pass): as many operators
for a list of 256 candidates as for one of 4,096, at most 40 in the lookup, no host synchronisation
in the lookup and at most one (the final scores) in the dense step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recserve.core.spec.parse import load_spec
from recserve.perf.lab.device_ops import count_operators, measure


@pytest.fixture(scope="module")
def counts():
    return measure(load_spec("ctr"))


def test_the_lookup_runs_in_few_operators_whatever_the_list(counts):
    assert counts["lookup_ops_256"] == counts["lookup_ops_4096"] <= 40, counts["lookup_operators"]
    assert counts["lookup_uploads_4096"] <= 1  # the staging buffer (a known shape: no table ids)


def test_the_lookup_never_waits_for_the_device(counts):
    assert counts["lookup_syncs"] == 0, counts["lookup_sync_kinds"]


def test_the_dense_step_reads_only_its_scores(counts):
    assert counts["dense_ops_256"] == counts["dense_ops_4096"], counts["dense_operators"]
    assert counts["dense_syncs"] <= 1, counts["dense_sync_kinds"]


def test_the_counter_sees_every_kind_of_host_synchronisation():
    values = torch.arange(10)

    def reads():
        made = values + 1
        made[made > 3]  # a boolean mask: a shape the host must learn
        made.nonzero()
        made.masked_select(made > 2)
        int(made[0])  # .item()
        made.cpu().numpy()  # one read
        made.tolist()
        np.asarray(made * 2)
        torch.from_numpy(np.zeros(3)).numpy()  # a host buffer: no read

    for inference in (False, True):
        with torch.inference_mode(inference):
            count, _ = count_operators(reads)
        assert count.sync_count == 7, count.syncs
        assert count.ops >= 8


def test_the_value_written_for_a_missing_key_hashes_to_it():
    from recserve.backends.features.device_transform import unmix64
    from recserve.backends.features.hashing import splitmix64

    keys = np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 4096, dtype=np.int64)
    keys[:3] = [0, -1, np.iinfo(np.int64).min]
    assert np.array_equal(splitmix64(unmix64(keys).view(np.uint64)).view(np.int64), keys)
