"""Secure defaults of the launcher, and the dense/embedding fit check."""

import pytest

from recserve.backends.dense.compatibility import check_dense_fits
from recserve.build import configs
from recserve.cli import parser
from recserve.core.names import (
    DENSE_NORMALIZED,
    HISTORY_EMBEDDINGS,
    HISTORY_MASK,
    SPARSE_EMBEDDINGS,
    STEPS,
    TARGET_EMBEDDING,
)
from recserve.errors import ArtifactError
from recserve.server import ADMIN_HEADER, Ports, Security, ServerProcessError, server_command


def _flags(command: list[str]) -> dict[str, list[str]]:
    flags: dict[str, list[str]] = {}
    for arg in command[1:]:
        key, _, value = arg.partition("=")
        flags.setdefault(key, []).append(value)
    return flags


def test_default_command_listens_on_loopback_with_admin_apis_locked(tmp_path):
    flags = _flags(server_command(tmp_path, Ports(1, 2, 3)))
    for key in ("--http-address", "--grpc-address", "--metrics-address"):
        assert flags[key] == ["127.0.0.1"]
    assert flags["--model-control-mode"] == ["none"]
    for key in ("--http-restricted-api", "--grpc-restricted-protocol"):
        (value,) = flags[key]
        apis, _, header = value.partition(":")
        assert set(apis.split(",")) == {"model-repository", "logging", "trace", "shared-memory"}
        name, _, secret = header.partition("=")
        assert name == ADMIN_HEADER and len(secret) >= 32
    assert "--load-model" not in flags


def test_an_unset_admin_key_is_random_per_start(tmp_path):
    first = _flags(server_command(tmp_path, Ports(1, 2, 3)))["--http-restricted-api"]
    second = _flags(server_command(tmp_path, Ports(1, 2, 3)))["--http-restricted-api"]
    assert first != second


def test_explicit_model_control_needs_a_key_and_loads_everything(tmp_path):
    with pytest.raises(ServerProcessError, match="admin key"):
        Security("explicit")
    security = Security("explicit", admin_key="k" * 40, client_shared_memory=True)
    flags = _flags(server_command(tmp_path, Ports(1, 2, 3), security=security))
    assert flags["--model-control-mode"] == ["explicit"] and flags["--load-model"] == ["*"]
    assert flags["--grpc-restricted-protocol"] == [
        f"model-repository,logging,trace:{ADMIN_HEADER}={'k' * 40}"
    ]
    assert security.headers("http") == {ADMIN_HEADER: "k" * 40}
    assert security.headers("grpc") == {f"triton-grpc-protocol-{ADMIN_HEADER}": "k" * 40}
    with pytest.raises(ServerProcessError, match="model control"):
        Security("poll")


def test_serve_defaults_to_loopback_and_no_model_control():
    args = parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.model_control == "none" and not args.client_shared_memory


def test_serve_refuses_a_queue_policy_the_repository_lacks(tiny_repository, capsys):
    args = parser().parse_args(["serve", "--repository", str(tiny_repository), "--queue", "nope"])
    assert args.func(args) == 2
    assert "no queue policy 'nope'" in capsys.readouterr().err


def test_throughput_first_sheds_load_at_every_step(spec):
    policy = spec.serving.queue_policies["throughput_first"]
    assert 0 < policy.entry_max_queue_size <= policy.max_queue_size, (
        "the first step must be the tightest gate"
    )
    for step in STEPS:
        limits = configs.step_config(
            spec, step, queue="throughput_first"
        ).dynamic_batching.default_queue_policy
        limit = policy.entry_max_queue_size if step == STEPS[0] else policy.max_queue_size
        assert limits.max_queue_size == limit > 0
        assert limits.default_timeout_microseconds == policy.default_timeout_microseconds > 0
        assert limits.timeout_action == limits.REJECT


def test_the_served_configs_have_no_queue_policy(spec):
    # with one, tritonserver's batcher waits for an idle instance and may sleep 500 ms with requests queued
    for step in STEPS:
        assert not configs.step_config(spec, step).dynamic_batching.HasField("default_queue_policy"), step


def _graph(spec, **overrides):
    dim, sparse = spec.model.embedding_dim, spec.num_sparse
    shapes = {
        DENSE_NORMALIZED: ["batch", len(spec.dense.columns)],
        SPARSE_EMBEDDINGS: ["batch", sparse, dim],
        TARGET_EMBEDDING: ["batch", dim],
        HISTORY_EMBEDDINGS: ["batch", "length", dim],
        HISTORY_MASK: ["batch", "length"],
    }
    shapes.update(overrides)
    return {k: v for k, v in shapes.items() if v is not None}


def test_a_dense_graph_built_for_the_spec_fits(spec):
    check_dense_fits(spec, _graph(spec))


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({SPARSE_EMBEDDINGS: ["batch", 26, 32]}, "'sparse_embeddings' is [26, 32]"),
        ({TARGET_EMBEDDING: ["batch", 8]}, "'target_embedding' is [8]"),
        ({SPARSE_EMBEDDINGS: ["batch", 25, 16]}, "'sparse_embeddings' is [25, 16]"),
        ({DENSE_NORMALIZED: ["batch", 12]}, "'dense_normalized' is [12]"),
        ({HISTORY_MASK: None}, "no input 'history_mask'"),
    ],
)
def test_a_dense_graph_for_other_embeddings_is_refused_with_both_shapes(spec, overrides, named):
    with pytest.raises(ArtifactError) as err:
        check_dense_fits(spec, _graph(spec, **overrides))
    assert named in str(err.value) and f"embedding_dim {spec.model.embedding_dim}" in str(err.value)


def test_the_exported_dense_graph_fits(tiny_spec, tiny_repository):
    import onnxruntime as ort

    session = ort.InferenceSession(str(tiny_repository / "dense" / str(tiny_spec.version) / "model.onnx"))
    check_dense_fits(tiny_spec, {i.name: i.shape for i in session.get_inputs()})


def test_the_process_error_has_one_name_and_differs_from_the_sdks():
    import recserve.server
    from recserve.clients import ServerError as ClientServerError
    from recserve.server import ServerProcessError

    assert not hasattr(recserve.server, "ServerError")  # the retired alias collided with the SDK's
    assert not issubclass(ServerProcessError, ClientServerError)
