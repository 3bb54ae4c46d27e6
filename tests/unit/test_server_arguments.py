from recserve.core.names import GPU_PROFILES
from recserve.server import process


def test_a_gpu_profile_gets_a_cuda_pool_on_every_visible_gpu(monkeypatch):
    monkeypatch.setattr(process, "visible_gpus", lambda: ["GPU 0: one", "GPU 1: two"])
    pool = process.CUDA_POOL_BYTES
    for profile in GPU_PROFILES:
        assert process.config_arguments(profile) == [
            f"--model-config-name={profile}",
            f"--cuda-memory-pool-byte-size=0:{pool}",
            f"--cuda-memory-pool-byte-size=1:{pool}",
        ]
    assert pool > 64 << 20  # over Triton's default, which one list of 4,096 candidates nearly fills


def test_a_cpu_config_gets_its_name_alone_and_the_default_none():
    assert process.config_arguments("latency") == ["--model-config-name=latency"]
    assert process.config_arguments(None) == []


def test_the_server_gets_mallocs_thresholds_unless_the_environment_sets_its_own():
    from recserve.server.runtime import MALLOC_SETTINGS, server_env

    env = server_env({"PATH": "/bin"})
    assert {name: env[name] for name in MALLOC_SETTINGS} == MALLOC_SETTINGS
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) == 32 << 20  # glibc ignores a value over its 32 MiB bound
    own = server_env({"PATH": "/bin", "MALLOC_TRIM_THRESHOLD_": "0"})
    assert own["MALLOC_TRIM_THRESHOLD_"] == "0" and own["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
