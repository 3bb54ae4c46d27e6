"""The dense network's inputs packed into one tensor between the steps: the same values back."""

import numpy as np
import pytest

from recserve import wire
from recserve.backends.dense.runner import check_inputs
from recserve.build.export import example_inputs
from recserve.errors import InvalidInput
from recserve.spec import load_spec


@pytest.mark.parametrize("name", ["ctr", "avazu", "taobao"])
def test_packing_gives_back_every_input_of_the_contract(name):
    spec = load_spec(name)
    packing = wire.dense_packing(spec)
    length = spec.sequence_buckets[0]
    inputs = example_inputs(spec, rows=5, length=length, seed=3)
    packed = packing.pack({**inputs, wire.EMBEDDING_VERSION: np.ones((5, 2), np.int64)})
    assert set(packed) == {wire.PACKED_INPUTS, wire.EMBEDDING_VERSION}  # what is not packed stays
    width = packed[wire.PACKED_INPUTS].shape[1]
    assert width == packing.fixed + packing.per_position * (length if spec.sequences else 0)
    assert width == sum(int(np.prod(a.shape[1:])) for a in inputs.values())
    unpacked = packing.unpack({wire.PACKED_INPUTS: packed[wire.PACKED_INPUTS]})
    assert list(unpacked) == list(wire.dense_net_inputs(spec))
    for key, array in inputs.items():
        np.testing.assert_array_equal(unpacked[key], array, err_msg=key)
    checked = check_inputs(spec, unpacked)
    assert checked.keys() == check_inputs(spec, inputs).keys()


def test_inputs_by_name_pass_through_and_a_packed_width_that_fits_no_length_is_refused():
    spec = load_spec("taobao")
    packing = wire.dense_packing(spec)
    inputs = example_inputs(spec, rows=2, length=8)
    assert packing.unpack(inputs).keys() == inputs.keys()
    packed = packing.pack(inputs)[wire.PACKED_INPUTS]
    for bad in (packed[:, :-1], packed[:, : packing.fixed], packed[0]):
        with pytest.raises(InvalidInput, match=f"'{wire.PACKED_INPUTS}': has shape"):
            packing.unpack({wire.PACKED_INPUTS: bad})
