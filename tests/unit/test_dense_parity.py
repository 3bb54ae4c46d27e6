"""Every dense runner agrees with the PyTorch reference at every bucket edge, padding included."""

import numpy as np
import pytest

from recserve.backends.base.artifacts import read_manifest, verified_path
from recserve.backends.dense.buckets import Bucket, BucketPolicy, grid_floors, spec_buckets
from recserve.backends.dense.runner import bucketed_onnx_runner
from recserve.backends.dense.tensorrt_engine import tensorrt_available
from recserve.backends.dense.torch_runners import bucketed_torch_runner, cuda_available
from recserve.build.export import example_inputs, torch_predict
from recserve.build.repository import load_reference_net, version_dir

needs_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (none on this machine)")
needs_tensorrt = pytest.mark.skipif(
    not (tensorrt_available() and cuda_available()),
    reason="needs TensorRT and a CUDA GPU (not installable here)",
)
FP32 = {"rtol": 1e-5, "atol": 1e-7}
FP16 = {"rtol": 1e-2, "atol": 1e-4}
# bf16 keeps 8 mantissa bits: this net lands at about 1.7% relative (0.4% absolute) on probabilities,
# so bf16 is held to 1e-2 absolute; fp16 meets 1e-2 relative (about 0.25%).
BF16 = {"rtol": 0, "atol": 1e-2}
HALF = {"fp16": FP16, "bf16": BF16}


def bucket_edges(spec):
    """Per grid bucket: its own shape and the smallest shape padded up to it (rows and positions)."""
    for bucket, floor in grid_floors(spec).items():
        yield bucket.rows, bucket.length
        yield floor.rows, floor.length


@pytest.fixture(scope="module")
def spec(tiny_spec):
    """Parity holds for any built model: the tiny one (tests/unit/conftest.py), same serving grid as ctr."""
    return tiny_spec


@pytest.fixture(scope="module")
def net(spec, tiny_repository):
    return load_reference_net(spec, tiny_repository)


@pytest.fixture(scope="module")
def dense_dir(spec, tiny_repository):
    return version_dir(tiny_repository, "dense", spec)


def always_pad(spec):
    """Every shape pads to its grid bucket: the worst padding the policy can produce."""
    return BucketPolicy.from_spec(spec, max_padding_waste=1.0)


def assert_parity_at_every_edge(spec, net, runner, tolerance, seed=0):
    assert set(runner.buckets) == set(spec_buckets(spec))
    for rows, length in bucket_edges(spec):
        sample = example_inputs(spec, rows, length, seed=seed + rows * 1000 + length)
        got = runner.predict(sample)
        assert got.shape == (rows, 1)
        np.testing.assert_allclose(
            got, torch_predict(net, sample), **tolerance, err_msg=f"rows={rows} length={length}"
        )
    counts = runner.counters.snapshot()
    assert counts["fallbacks"] == 0 and counts["padding_rows"] > 0 and counts["padding_positions"] > 0


def test_onnx_runtime_buckets(spec, net, dense_dir):
    model = verified_path(dense_dir, read_manifest(dense_dir)["files"]["model"])
    runner = bucketed_onnx_runner(spec, model, policy=always_pad(spec), background=False)
    assert_parity_at_every_edge(spec, net, runner, FP32)


def test_pytorch_eager_buckets(spec, net):
    runner = bucketed_torch_runner(
        spec, net, "cpu", policy=always_pad(spec), prepare=spec_buckets(spec), background=False
    )
    assert_parity_at_every_edge(spec, net, runner, FP32)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_pytorch_half_precision_buckets(spec, net, precision):
    runner = bucketed_torch_runner(
        spec,
        net,
        "cpu",
        precision=precision,
        policy=always_pad(spec),
        prepare=spec_buckets(spec),
        background=False,
    )
    assert_parity_at_every_edge(spec, net, runner, HALF[precision])


def test_generic_fallback_matches_too(spec, net, dense_dir):
    model = verified_path(dense_dir, read_manifest(dense_dir)["files"]["model"])
    runner = bucketed_onnx_runner(spec, model, prepare=(), background=False)
    sample = example_inputs(spec, 37, 100, seed=37)
    np.testing.assert_allclose(
        runner.predict(sample), torch_predict(net, sample), **FP32
    )  # generic, then compiled
    np.testing.assert_allclose(
        runner.predict(sample), torch_predict(net, sample), **FP32
    )  # the compiled bucket
    assert runner.buckets == (Bucket(40, 128),)


@needs_cuda
@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", FP32), ("fp16", FP16), ("bf16", BF16)])
def test_cuda_graph_buckets(spec, tiny_repository, net, precision, tolerance):
    gpu_net = load_reference_net(spec, tiny_repository)
    runner = bucketed_torch_runner(
        spec,
        gpu_net,
        "cuda",
        precision,
        policy=always_pad(spec),
        prepare=spec_buckets(spec),
        background=False,
    )
    # TF32 matmuls are off by default in PyTorch, so fp32 graphs match to 1e-5
    assert_parity_at_every_edge(spec, net, runner, tolerance)


@needs_tensorrt
@pytest.mark.tensorrt
def test_tensorrt_buckets(spec, tiny_repository, net, dense_dir, tmp_path):
    from recserve.backends.dense.tensorrt_engine import EngineOptions, build_engine, spec_profiles
    from recserve.backends.dense.tensorrt_runner import bucketed_tensorrt_runner

    model = verified_path(dense_dir, read_manifest(dense_dir)["files"]["model"])
    profiles = spec_profiles(spec)
    plan = build_engine(model, profiles, EngineOptions(timing_cache=tmp_path / "timing.cache"))
    runner = bucketed_tensorrt_runner(
        spec,
        plan,
        tuple(p.bucket for p in profiles),
        model,
        load_reference_net(spec, tiny_repository),
        "cuda:0",
        policy=always_pad(spec),
    )
    assert_parity_at_every_edge(spec, net, runner, FP32)
