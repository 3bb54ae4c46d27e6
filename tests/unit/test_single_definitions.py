"""Ideas defined once: one row container under one name, the ensemble's steps in one place."""

import numpy as np
import pytest

from recserve import clients
from recserve.build.synthetic import generate
from recserve.clients.rows import read_rows
from recserve.clients.writers import write_tsv
from recserve.core.names import DENSE, EMBEDDING_LOOKUP, STEPS
from recserve.core.rows import Rows


def test_the_sdk_rows_and_the_generated_rows_are_one_class_under_one_name():
    import recserve.clients.rows
    import recserve.core.rows

    assert clients.Rows is recserve.clients.rows.Rows is Rows
    for module in (clients, recserve.clients.rows, recserve.core.rows):  # the retired names are gone
        assert not hasattr(module, "RawRows") and not hasattr(module, "CriteoRows")


def test_the_steps_are_defined_once_in_ensemble_order(tiny_spec):
    from recserve.build.configs import ensemble_config

    assert (EMBEDDING_LOOKUP, DENSE) == STEPS
    assert tuple(s.model_name for s in ensemble_config(tiny_spec).ensemble_scheduling.step) == STEPS


def test_rows_read_from_a_file_are_the_generated_rows_class_and_round_trip(tiny_spec, tmp_path):
    generated = generate(tiny_spec, 6, seed=3)
    read = read_rows(write_tsv(tmp_path / "rows.tsv", generated, tiny_spec, with_label=True), tiny_spec)
    assert type(read) is type(generated)
    for name, array in generated.to_wire(tiny_spec).items():
        np.testing.assert_array_equal(read.to_inputs(tiny_spec)[name], array)
    np.testing.assert_array_equal(read.to_raw(tiny_spec).label_values(), generated.label_values())


def test_rows_without_labels_keep_none_through_take_and_refuse_label_values(tiny_spec, tmp_path):
    generated = generate(tiny_spec, 4, seed=5)
    read = read_rows(write_tsv(tmp_path / "rows.tsv", generated, tiny_spec, with_label=False), tiny_spec)
    assert read.labels is None and read.take(slice(1, 3)).labels is None
    assert [len(batch) for batch in read.batches(3)] == [3, 1]
    with pytest.raises(ValueError, match="no label"):
        read.label_values()
