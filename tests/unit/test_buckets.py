"""The bucket policy: nearest bucket, waste limit, padding, misses compiled in the background."""

import threading

import numpy as np
import pytest

from recserve.backends.base.artifacts import read_manifest, verified_path
from recserve.backends.dense.buckets import Bucket, BucketedRunner, BucketPolicy, pad_to_bucket, spec_buckets
from recserve.backends.dense.runner import (
    PARALLEL_FROM_ROWS,
    InputChecks,
    OnnxDenseRunner,
    bucket_threads,
    bucketed_onnx_runner,
)
from recserve.build.export import example_inputs
from recserve.build.repository import version_dir
from recserve.core.names import DENSE_NET_INPUTS, HISTORY_EMBEDDINGS, HISTORY_MASK, SPARSE_EMBEDDINGS
from recserve.errors import InvalidInput


@pytest.fixture(scope="module")
def model_path(tiny_spec, tiny_repository):
    """The tiny model's graph: its spec has ctr's batch buckets and the 8/32/128 sequence buckets."""
    root = version_dir(tiny_repository, "dense", tiny_spec)
    return verified_path(root, read_manifest(root)["files"]["model"])


@pytest.fixture(scope="module")
def generic(tiny_spec, model_path):
    return OnnxDenseRunner(tiny_spec, model_path)


def test_the_grid_is_every_batch_bucket_times_every_sequence_bucket(spec):
    grid = spec_buckets(spec)
    assert len(grid) == len(spec.serving.batch_buckets) * len(spec.serving.sequence_buckets)
    assert Bucket(1, 8) in grid and Bucket(256, 256) in grid and len(set(grid)) == len(grid)


@pytest.mark.parametrize(
    ("rows", "length", "bucket", "compile"),
    [
        (1, 8, Bucket(1, 8), None),  # exact
        (7, 8, Bucket(8, 8), None),  # nothing tighter exists: rows round up to 8 anyway
        (60, 32, Bucket(64, 32), None),  # 6% padding rows: within the limit
        (50, 32, None, Bucket(56, 32)),  # 22%: beyond it
        (64, 20, Bucket(64, 32), None),  # sequence positions pad to the sequence bucket
        (9, 32, None, Bucket(16, 32)),  # 72% padding: miss, compile a tight bucket
        (129, 128, None, Bucket(136, 128)),
        (5, 32, None, Bucket(5, 32)),  # 37% padding: small batches get buckets of their own size
        (3, 300, None, Bucket(3, 300)),  # beyond the largest sequence bucket
        (0, 8, Bucket(1, 8), None),  # an empty batch pads to the smallest bucket
    ],
)
def test_plan_pads_to_the_nearest_bucket_or_misses(spec, rows, length, bucket, compile):
    plan = BucketPolicy.from_spec(spec).plan(rows, length, spec_buckets(spec))
    assert (plan.bucket, plan.compile) == (bucket, compile)


def test_a_compiled_tight_bucket_turns_the_miss_into_a_hit(spec):
    policy = BucketPolicy.from_spec(spec)
    assert policy.plan(9, 32, (*spec_buckets(spec), Bucket(16, 32))).bucket == Bucket(16, 32)


def test_no_compile_beyond_max_buckets(spec):
    policy = BucketPolicy.from_spec(spec, max_buckets=len(spec_buckets(spec)) + 1)
    assert policy.plan(9, 32, spec_buckets(spec), pending=1).compile is None
    assert policy.plan(9, 32, spec_buckets(spec), pending=0).compile == Bucket(16, 32)


def test_padding_fills_zeros_and_reused_buffers_forget_earlier_requests(spec):
    bucket = Bucket(8, 32)
    big = example_inputs(spec, 8, 32, seed=1)
    small = example_inputs(spec, 3, 8, seed=2)
    buffers = {name: np.empty(shape, np.float32) for name, shape in bucket.input_shapes(spec).items()}
    pad_to_bucket(big, bucket, buffers)
    padded = pad_to_bucket(small, bucket, buffers)
    for name in DENSE_NET_INPUTS:
        assert padded[name].shape == bucket.input_shapes(spec)[name]
        assert not padded[name][3:].any()
    assert not padded[HISTORY_EMBEDDINGS][:, 8:].any() and not padded[HISTORY_MASK][:, 8:].any()
    np.testing.assert_array_equal(padded[HISTORY_EMBEDDINGS][:3, :8], small[HISTORY_EMBEDDINGS])
    np.testing.assert_array_equal(padded[SPARSE_EMBEDDINGS][:3], small[SPARSE_EMBEDDINGS])


def test_preallocated_buffers_are_filled_at_the_exact_bucket_shape_too(spec):
    # the device runners copy from these (pinned) buffers, never from the returned arrays
    bucket = Bucket(8, 32)
    exact = example_inputs(spec, 8, 32, seed=3)
    buffers = {name: np.zeros(shape, np.float32) for name, shape in bucket.input_shapes(spec).items()}
    pad_to_bucket(exact, bucket, buffers)
    for name in DENSE_NET_INPUTS:
        np.testing.assert_array_equal(buffers[name], exact[name])


def test_a_miss_is_served_by_the_generic_graph_then_compiled_and_swapped_in(tiny_spec, model_path, generic):
    runner = bucketed_onnx_runner(tiny_spec, model_path, prepare=spec_buckets(tiny_spec))
    try:
        sample = example_inputs(tiny_spec, 41, 32, seed=41)  # 64 would pad 36%: miss
        expected = generic.predict(sample)
        np.testing.assert_array_equal(runner.predict(sample), expected)
        assert runner.wait_compiled(timeout_s=60)
        assert Bucket(48, 32) in runner.buckets
        np.testing.assert_allclose(runner.predict(sample), expected, rtol=1e-5, atol=1e-7)
        counts = runner.counters.snapshot()
        assert (counts["misses"], counts["fallbacks"], counts["compiles"], counts["hits"]) == (1, 1, 1, 1)
        assert (counts["real_rows"], counts["padding_rows"]) == (41, 7)
        assert (counts["real_positions"], counts["padding_positions"]) == (41 * 32, 7 * 32)
    finally:
        runner.close()


def test_requests_keep_their_results_while_buckets_are_swapped_in(tiny_spec, model_path, generic):
    runner = bucketed_onnx_runner(tiny_spec, model_path, prepare=(Bucket(256, 8),))
    samples = [example_inputs(tiny_spec, rows, 8, seed=rows) for rows in (9, 17, 33, 65, 129)]
    expected = [generic.predict(s) for s in samples]
    try:
        for _ in range(20):  # misses schedule compiles; swaps happen while these run
            for sample, want in zip(samples, expected, strict=True):
                np.testing.assert_allclose(runner.predict(sample), want, rtol=1e-5, atol=1e-7)
        assert runner.wait_compiled(timeout_s=60)
        assert {Bucket(16, 8), Bucket(24, 8), Bucket(40, 8), Bucket(72, 8), Bucket(136, 8)} <= set(
            runner.buckets
        )
        before = runner.counters.snapshot()["hits"]
        for sample, want in zip(samples, expected, strict=True):
            np.testing.assert_allclose(runner.predict(sample), want, rtol=1e-5, atol=1e-7)
        assert runner.counters.snapshot()["hits"] == before + len(samples)
    finally:
        runner.close()


def test_a_failed_compile_is_not_retried_and_the_generic_graph_keeps_serving(tiny_spec, generic):
    def refuse(bucket):
        raise RuntimeError(f"cannot compile {bucket}")

    runner = BucketedRunner(BucketPolicy.from_spec(tiny_spec), refuse, generic.predict, background=False)
    sample = example_inputs(tiny_spec, 5, 8, seed=5)
    for _ in range(3):
        np.testing.assert_array_equal(runner.predict(sample), generic.predict(sample))
    counts = runner.counters.snapshot()
    assert counts["compile_failures"] == 1 and counts["compiles"] == 0 and counts["fallbacks"] == 3
    assert runner.buckets == ()


def test_one_compile_per_bucket_under_concurrent_misses(tiny_spec, generic):
    calls, gate = [], threading.Event()

    def slow_compile(bucket):
        calls.append(bucket)
        gate.wait(10)
        return generic.predict

    runner = BucketedRunner(BucketPolicy.from_spec(tiny_spec), slow_compile, generic.predict)
    sample = example_inputs(tiny_spec, 9, 8, seed=9)
    threads = [threading.Thread(target=runner.predict, args=(sample,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gate.set()
    assert runner.wait_compiled(timeout_s=10)
    runner.close()
    assert calls == [Bucket(16, 8)]


def test_small_buckets_run_on_one_thread_whatever_the_cores():
    assert bucket_threads(Bucket(PARALLEL_FROM_ROWS - 1, 256), 2) == 1
    assert bucket_threads(Bucket(PARALLEL_FROM_ROWS, 8), 2) == 2


def test_the_input_checks_name_the_input_whose_shape_disagrees(spec):
    check = InputChecks(spec)
    inputs = example_inputs(spec, 3, 8, seed=4)
    assert set(check(inputs)) == set(check.names)
    shorter = {**inputs, HISTORY_EMBEDDINGS: inputs[HISTORY_EMBEDDINGS][:, :5]}
    with pytest.raises(InvalidInput, match=rf"{HISTORY_EMBEDDINGS}.*expected float32\[3, 8, "):
        check(shorter)
    wrong = {**inputs, SPARSE_EMBEDDINGS: inputs[SPARSE_EMBEDDINGS].astype(np.float64)}
    with pytest.raises(InvalidInput, match=rf"'{SPARSE_EMBEDDINGS}': is float64"):
        check(wrong)
    with pytest.raises(InvalidInput, match="is required but missing"):
        check({k: v for k, v in inputs.items() if k != HISTORY_MASK})
