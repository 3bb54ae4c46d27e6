"""``recserve lab dense-bench`` runs end to end (one short round; its figures are not asserted)."""

from recserve.backends.dense.buckets import spec_buckets
from recserve.perf.lab.dense_bench import run_dense_bench


def test_bench_prints_all_four_tables(tiny_spec, tiny_repository, tmp_path):
    spec = tiny_spec
    out = tmp_path / "buckets.csv"
    report = run_dense_bench(spec, tiny_repository, rounds=1, budget_s=0.0, output=out)
    assert report.count("\n| ") >= len(spec_buckets(spec)) + 5 + 3 + 5
    assert "first miss until the compiled bucket takes over" in report
    lines = out.read_text().splitlines()
    assert lines[0].startswith("rows,length,dynamic_rows_per_s") and len(lines) == len(spec_buckets(spec)) + 1
