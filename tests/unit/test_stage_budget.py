"""recserve lab stages: the in-process stages and the table (the served part runs in the lab)."""

from recserve.build.synthetic import generate
from recserve.core.names import DENSE, EMBEDDING_LOOKUP
from recserve.perf.lab.stage_budget import format_budget, in_process


def test_every_in_process_stage_is_timed_on_the_requests(tiny_spec, tiny_repository):
    rows = generate(tiny_spec, 8, seed=3)
    pool = [rows.take(slice(i, i + 2)).to_wire(tiny_spec) for i in range(0, 8, 2)]
    stages = in_process(tiny_spec, tiny_repository, pool)
    assert set(stages) == {"client_encode", "transform", "store_lookup", "dense_forward"}
    assert all(value > 0 for value in stages.values())


def test_the_budget_table_has_a_column_per_batch_size_and_a_row_per_stage():
    step = {"queue": 100.0, "input": 10.0, "infer": 300.0, "output": 20.0}
    figures = {
        "client_encode_us": 40.0, "transform_us": 120.0, "store_lookup_us": 40.0, "dense_forward_us": 60.0,
        "lookup_handoff_us": 170.0, "dense_handoff_us": 270.0, "rest_us": 300.0, "mean_us": 1200.0,
        "p50_us": 1100.0, "steps_us": {EMBEDDING_LOOKUP: step, DENSE: step},
    }  # fmt: skip
    table = format_budget({1: figures, 64: figures}).splitlines()
    assert table[0].split()[-4:] == ["batch", "1", "batch", "64"]
    assert len(table) == 12 and table[-1].split()[-2:] == ["1100", "1100"]
