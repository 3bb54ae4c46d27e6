"""The GPU bench's specs: trained on fewer rows with the served shapes kept; the bound's widened batch."""

import json

from recserve.core.spec.parse import load_spec, parse_spec
from recserve.perf.gpu_check.bench.bound import widened
from recserve.perf.gpu_check.bench.spec import bench_document, write_bench_spec
from recserve.perf.gpu_check.common import BENCH, BENCH_DRY


def test_the_bench_spec_trains_on_fewer_rows_and_serves_the_same_shapes(spec, tmp_path):
    doc, changes = bench_document(spec, BENCH)
    bench = parse_spec(doc)
    assert (bench.training.rows, bench.training.holdout_rows, bench.training.epochs) == (20_000, 2_000, 1)
    assert changes[0] == "[training] rows 20000, holdout_rows 2000, epochs 1"
    assert bench.name == spec.name and bench.tables == spec.tables and bench.model == spec.model
    assert bench.serving.batch_buckets == spec.serving.batch_buckets
    assert spec.training.rows == 120_000  # the spec it came from is left as it was
    changes = write_bench_spec("ctr", BENCH_DRY, tmp_path / "bench" / "spec.json")
    assert load_spec(tmp_path / "bench" / "spec.json").training.rows == BENCH_DRY.train_rows
    assert json.loads(json.dumps(changes)) == changes


def test_the_bench_spec_can_serve_more_lookup_instances(spec):
    doc, changes = bench_document(spec, BENCH, lookup_instances=4)
    bench = parse_spec(doc)
    assert bench.serving.instances == {**spec.serving.instances, "embedding_lookup": 4}
    was = spec.serving.instances["embedding_lookup"]
    assert changes[-1] == f"[serving.instances] embedding_lookup 4 (was {was})"
    assert bench_document(spec, BENCH)[0]["serving"].get("instances") == spec.source.get("serving", {}).get(
        "instances"
    )


def test_the_bound_takes_batches_beyond_the_served_maximum(spec):
    wide = widened(spec, 16_384)
    assert wide.model.max_batch_size == 16_384 and wide.serving.batch_buckets[-1] == 16_384
    assert wide.serving.batch_buckets[:-1] == spec.serving.batch_buckets
    assert wide.tables == spec.tables and wide.serving.sequence_buckets == spec.serving.sequence_buckets
    assert widened(spec, spec.model.max_batch_size) is spec
