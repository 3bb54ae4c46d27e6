"""The joiner takes in only features records the learner can lay out: of the spec's shape."""

import numpy as np
import pytest
import tomllib

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.request_log.records import Identity
from recserve.backends.request_log.step_log import FeatureLog
from recserve.build.synthetic import generate
from recserve.core.spec.parse import load_spec, parse_spec
from recserve.loop.batch import record_problem
from recserve.loop.join import Join
from tests.model_exports import DEEPFM_SPEC
from tests.unit.helpers import tagged_ctr_spec, two_behaviour_ctr_spec, two_sequence_ctr_spec

SPECS = {
    "ctr": lambda: load_spec("ctr"),
    "avazu": lambda: load_spec("avazu"),
    "multi-hot": tagged_ctr_spec,
    "two sequences": lambda: two_sequence_ctr_spec("concat"),
    "two behaviours": two_behaviour_ctr_spec,
    "deepfm": lambda: parse_spec(tomllib.loads(DEEPFM_SPEC)),
}


def served_records(spec, rows=8):
    """The features records the lookup step logs for generated rows, each with its history resolved."""
    served = FeatureTransform(spec).transform(generate(spec, rows, seed=5).to_wire(spec))
    versions = np.ones((1, len(spec.table_names)), np.int64)
    log = FeatureLog(spec, spec.logging, None)  # type: ignore[arg-type]
    records = log.records(Identity("r"), 0, served, versions).to_pylist()
    for record in records:
        carrier = records[record["history_row"]] if record["history_row"] >= 0 else {}
        record["history"], record["history_lengths"] = carrier.get("history"), carrier.get("history_lengths")
    return records


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_record_a_step_logs_is_of_its_specs_shape(name):
    spec = SPECS[name]()
    problem = record_problem(spec)
    assert [problem(record) for record in served_records(spec)] == [""] * 8


def test_a_record_of_another_shape_is_named_counted_and_never_held():
    spec = two_behaviour_ctr_spec()
    good = served_records(spec, 2)[0]
    bad = {
        "keys": {**good, "keys": good["keys"][:-1]},
        "embedding_version": {**good, "embedding_version": []},
        "history_lengths": {**good, "history_lengths": [1, 1]},  # 2 keys, not the history's
    }
    problem = record_problem(spec)
    for column, record in bad.items():
        assert problem(record).startswith(column), problem(record)
    assert problem({**good, "history_lengths": None}) == ""  # a log written before the column
    join = Join(60.0, 60.0, problem=problem)
    join.add_features([{**record, "request_id": column} for column, record in bad.items()] + [good])
    assert join.counts["malformed_records"] == 3 and list(join.open) == [(good["request_id"], good["row"])]
