"""TensorRT profiles from the bucket grid, the GPU dense config, and the build without TensorRT."""

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from recserve.backends.dense.buckets import Bucket, spec_buckets
from recserve.backends.dense.tensorrt_engine import (
    EngineOptions,
    OptimizationProfile,
    ShapeRange,
    TensorRTUnavailable,
    build_engine,
    spec_profiles,
    tensorrt_available,
)
from recserve.build import configs
from recserve.build.dense_configs import TENSORRT_PLAN
from recserve.cli import main
from recserve.core.gpu_batches import gpu_spec
from recserve.core.names import DENSE, EMBEDDING_LOOKUP, L1_DEVICE_PARAMETER
from tests.unit.conftest import COMMITTED_CONFIGS, TINY_SPEC


def test_one_profile_per_bucket_tuned_for_the_bucket(spec):
    profiles = spec_profiles(spec)
    assert [p.bucket for p in profiles] == list(spec_buckets(spec))
    for profile in profiles:
        for name, shape in profile.bucket.input_shapes(spec).items():
            assert profile[name].opt == profile[name].max == shape


@pytest.mark.parametrize("length", [1, 8, 9, 32, 100, 256])
def test_profiles_tile_every_shape_exactly_once(spec, length):
    profiles = spec_profiles(spec)
    for rows in range(1, spec.model.max_batch_size + 1):
        shapes = Bucket(rows, length).input_shapes(spec)
        holding = [p.bucket for p in profiles if p.holds(shapes)]
        assert holding == [Bucket(spec.batch_bucket(rows), spec.sequence_bucket(length))], (rows, length)


def test_a_missed_bucket_gets_a_profile_of_its_own_shape(spec):
    profile = OptimizationProfile.for_bucket(spec, Bucket(48, 32))
    assert profile["history_embeddings"] == ShapeRange((48, 32, 16), (48, 32, 16), (48, 32, 16))


def test_shape_ranges_and_options_are_checked():
    with pytest.raises(ValueError, match="min <= opt <= max"):
        ShapeRange((4, 8), (2, 8), (8, 8))
    with pytest.raises(ValueError, match="precision"):
        EngineOptions(precision="int4")


@pytest.mark.skipif(tensorrt_available(), reason="checks the message where TensorRT is absent")
def test_building_without_tensorrt_says_so(spec, tmp_path):
    with pytest.raises(TensorRTUnavailable, match="not installed"):
        build_engine(tmp_path / "model.onnx", spec_profiles(spec), EngineOptions())


@pytest.mark.skipif(tensorrt_available(), reason="checks the message where TensorRT is absent")
def test_build_profile_gpu_says_so_in_one_line_and_keeps_the_cpu_path(tiny_repository, capsys):
    before = (tiny_repository / "dense" / "config.pbtxt").read_text()
    argv = [
        "--spec",
        TINY_SPEC,
        "build",
        "--if-missing",
        "--profile",
        "gpu",
        "--repository",
        str(tiny_repository),
    ]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "TensorRT" in line]
    assert len(lines) == 1 and "not installed" in lines[0] and "CPU path" in lines[0]
    assert (tiny_repository / "dense" / "config.pbtxt").read_text() == before
    assert not list((tiny_repository / "dense").glob("*/model.plan"))


def test_gpu_dense_config_is_a_tensorrt_plan_batched_to_the_buckets(spec):
    config = configs.step_config(spec, DENSE, profile="gpu")
    gpu = gpu_spec(spec)  # the GPU profiles' buckets: up to [serving] gpu_max_batch_size
    assert config.platform == "tensorrt_plan" and config.default_model_filename == TENSORRT_PLAN
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert config.instance_group[0].count == spec.serving.instances["dense"]
    assert list(config.dynamic_batching.preferred_batch_size) == list(gpu.serving.batch_buckets)
    assert config.max_batch_size == max(gpu.serving.batch_buckets) == spec.serving.gpu_max_batch_size
    assert not any(i.allow_ragged_batch for i in config.input)
    assert [w.name for w in config.model_warmup] == [f"bucket_{b.rows}x{b.length}" for b in spec_buckets(gpu)]
    assert (COMMITTED_CONFIGS / "dense" / "configs" / "gpu.pbtxt").read_text() == configs.render(config)


def test_cpu_dense_config_warms_every_bucket_at_load(spec):
    config = configs.step_config(spec, DENSE)
    assert config.backend == "python" and config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    for warmup, bucket in zip(config.model_warmup, spec_buckets(spec), strict=True):
        assert warmup.batch_size == bucket.rows
        assert list(warmup.inputs["history_embeddings"].dims) == [bucket.length, spec.model.embedding_dim]
        assert list(warmup.inputs["history_mask"].dims) == [bucket.length]
        assert all(i.zero_data for i in warmup.inputs.values())


def test_cuda_dense_config_is_the_python_step_on_gpu_instances(spec):
    config = configs.step_config(spec, DENSE, profile="cuda")
    cpu = configs.step_config(gpu_spec(spec), DENSE)  # the CPU profile's config at the GPU's batches
    assert config.backend == "python" and config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert config.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "no"  # lookups arrive on the GPU
    cpu.instance_group[0].kind = mc.ModelInstanceGroup.KIND_GPU
    cpu.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value = "no"
    assert config == cpu
    assert (COMMITTED_CONFIGS / "dense" / "configs" / "cuda.pbtxt").read_text() == configs.render(config)


def test_the_lookup_step_differs_between_profiles_only_in_instance_kind_and_device_parameters(spec):
    step = EMBEDDING_LOOKUP
    for profile in configs.PROFILES:
        config = configs.step_config(spec, step, profile)
        config.instance_group[0].kind = mc.ModelInstanceGroup.KIND_CPU
        if profile != "cpu":
            del config.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"]
        l1_device = ""
        if L1_DEVICE_PARAMETER in config.parameters:
            l1_device = config.parameters[L1_DEVICE_PARAMETER].string_value
            del config.parameters[L1_DEVICE_PARAMETER]
        assert l1_device == ("cuda" if (step, profile) == (EMBEDDING_LOOKUP, "cuda") else "")
        assert config == configs.step_config(spec if profile == "cpu" else gpu_spec(spec), step)
    # the ensembles differ on the GPU profiles by their batches; on gpu also because a TensorRT plan
    # has no dense_version output
    hardware = [
        p.as_posix()
        for p in configs.profile_configs(spec)
        if p.parent.name == "configs" and p.stem in configs.PROFILES
    ]
    assert sorted(hardware) == [
        "ctr/configs/cuda.pbtxt",
        "ctr/configs/gpu.pbtxt",
        "ctr_candidates/configs/cuda.pbtxt",
        "ctr_candidates/configs/gpu.pbtxt",
        *(
            f"{model}/configs/{profile}.pbtxt"
            for model in ("dense", "embedding_lookup")
            for profile in ("cuda", "gpu")
        ),
    ]
    with pytest.raises(ValueError, match="profile"):
        configs.step_config(spec, DENSE, profile="tpu")
