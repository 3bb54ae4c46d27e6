import shutil

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from recserve.backends.triton.bytes_codec import decode_bytes_tensor
from recserve.build import configs
from recserve.build.configs import ServingPlan
from recserve.cli import main
from recserve.core.names import EMBEDDING_LOOKUP, STEPS
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import parse_spec
from recserve.server import MpsDaemon, ServerProcessError, visible_gpus


def test_naive_plan_turns_dynamic_batching_off(spec):
    for step in STEPS:
        config = configs.step_config(spec, step, plan=ServingPlan.naive())
        assert not config.HasField("dynamic_batching")
        assert config.instance_group[0].count == 1


def test_plan_sets_delay_preferred_sizes_and_instances(spec):
    plan = ServingPlan(1500, (32, 64), {"embedding_lookup": 2, "dense": 3})
    for step in STEPS:
        config = configs.step_config(spec, step, plan=plan)
        assert config.dynamic_batching.max_queue_delay_microseconds == 1500
        assert list(config.dynamic_batching.preferred_batch_size) == [32, 64]
        assert config.instance_group[0].count == plan.instances[step]
        assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU


@pytest.mark.parametrize("profile", ["gpu", "cuda"])
def test_gpu_profiles_run_the_lookup_step_on_gpu_instances_with_gpu_inputs(spec, profile):
    step = EMBEDDING_LOOKUP
    config = configs.step_config(spec, step, profile=profile)
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert config.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "no"
    assert config.dynamic_batching.max_queue_delay_microseconds == spec.serving.max_queue_delay_microseconds
    assert "FORCE_CPU_ONLY_INPUT_TENSORS" not in configs.step_config(spec, step).parameters
    assert configs.step_config(spec, step).instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU


def test_unknown_profile_is_refused(spec):
    with pytest.raises(ValueError, match="profile"):
        configs.step_config(spec, STEPS[0], profile="tpu")


def test_spec_plan_is_the_committed_one(spec):
    for profile in configs.PROFILES:
        assert configs.all_configs(spec, profile) == configs.all_configs(
            spec, profile, ServingPlan.from_spec(spec)
        )


def test_preferred_batch_sizes_must_fit_max_batch(spec):
    document = {**spec.source, "serving": {**spec.source["serving"], "preferred_batch_size": [512]}}
    with pytest.raises(SpecError, match="preferred_batch_size"):
        parse_spec(document)


def test_variant_links_artifacts_and_writes_its_own_configs(spec, tmp_path):
    source = tmp_path / "source"
    for step in STEPS:
        (source / step / str(spec.version)).mkdir(parents=True)
        (source / step / str(spec.version) / "model.py").write_text(step)
    variant = configs.write_variant(
        spec, source, tmp_path / "variant", profile="cuda", plan=ServingPlan.naive()
    )
    for step in STEPS:
        version = variant / step / str(spec.version)
        assert version.is_symlink() and (version / "model.py").read_text() == step
        parsed = text_format.Parse((variant / step / "config.pbtxt").read_text(), mc.ModelConfig())
        assert parsed.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
        assert not parsed.HasField("dynamic_batching")
    assert (variant / spec.name / "config.pbtxt").is_file()
    assert not (variant / STEPS[0] / "configs").exists()  # a scheduled variant has no queue policies
    plain = configs.write_variant(spec, source, tmp_path / "plain")  # as built: served by policy name too
    for queue in spec.serving.queue_policies:
        for step in STEPS:
            text = (plain / step / "configs" / f"{queue}.pbtxt").read_text()
            assert text == configs.render(configs.step_config(spec, step, queue=queue))
    with pytest.raises(ValueError):
        configs.write_variant(spec, source, source)
    shutil.rmtree(source / STEPS[0])
    with pytest.raises(FileNotFoundError):
        configs.write_variant(spec, source, tmp_path / "again")


@pytest.mark.parametrize(
    "values", [[b"1a2b", b"", b"ffffffffffffffff"], [b""], [], ["x" * 300, "", "\u00e9"]]
)
def test_bytes_decoder_matches_the_reference_decoder(values):
    array = np.array(values, dtype=object)
    serialized = serialize_byte_tensor(array)
    buffer = np.frombuffer(
        serialized.item() if serialized.dtype == object and serialized.size else b"", np.uint8
    )
    ours, reference = decode_bytes_tensor(buffer), deserialize_bytes_tensor(buffer)
    assert ours.dtype == object and ours.shape == reference.shape and (ours == reference).all()


def test_bytes_decoder_refuses_truncated_buffers():
    with pytest.raises(ValueError, match="truncated"):
        decode_bytes_tensor(b"\x05\x00\x00\x00abc")
    with pytest.raises(ValueError, match="truncated"):
        decode_bytes_tensor(b"\x01\x00")


@pytest.mark.skipif(bool(visible_gpus()), reason="this machine has a GPU")
def test_gpu_profile_and_mps_fail_clearly_without_a_gpu(tiny_repository, capsys, tmp_path):
    assert main(["serve", "--repository", str(tiny_repository), "--profile", "gpu"]) == 2
    assert "nvidia-smi lists none" in capsys.readouterr().err
    assert main(["serve", "--repository", str(tiny_repository), "--mps"]) == 2
    assert "--profile gpu or cuda" in capsys.readouterr().err
    with pytest.raises(ServerProcessError, match="nvidia-cuda-mps-control|nvidia-smi"):
        MpsDaemon(tmp_path).start()


def test_mps_daemon_shares_its_folders_with_the_server(tmp_path):
    daemon = MpsDaemon(tmp_path, control="/bin/true")
    env = daemon.env({"PATH": "/bin"})
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "log")
    assert env["PATH"] == "/bin"
    daemon.stop()  # never started: nothing to stop, no error
