"""The generated Envoy config (checked by the real ``envoy --mode validate``), the unbounded repository
view the servers run behind the proxy, and the SDK's user header."""

import dataclasses
import json
import shutil

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from recserve.access import (
    SHADOW_KEY,
    UNBOUNDED,
    AccessError,
    ProxyPorts,
    Upstream,
    behind_proxy,
    cluster_name,
    envoy_config,
    unbounded_view,
    validate,
    weight_key,
    write_config,
)
from recserve.access.front_door import (
    BODY_MARGIN_BYTES,
    GRPC_STREAM_PATH,
    MAX_HEADERS_KB,
    FrontDoor,
    FrontDoorError,
    lua_source,
)
from recserve.clients import AsyncCTRClient, CTRClient
from recserve.core.names import STEPS, USER_HEADER
from recserve.core.sections.serving import AccessSection

PORTS = ProxyPorts(grpc=18001, http=18000, admin=19901)
UPSTREAMS = {"stable": [Upstream(7001, 7000)], "canary": [Upstream(7101, 7100), Upstream(7201, 7200)]}


def _access(**changes) -> AccessSection:
    return dataclasses.replace(AccessSection(), **changes)


def _clusters(config: dict) -> dict[str, dict]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}


def _routes(config: dict) -> dict[str, dict]:
    listeners = config["static_resources"]["listeners"]
    return {
        listener["name"]: listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
            "virtual_hosts"
        ][0]["routes"][0]["route"]
        for listener in listeners
    }


def test_the_generated_config_passes_envoy_validate(tmp_path):
    access = _access(weights={"stable": 90, "canary": 10}, shadow_fraction=0.05)
    path = write_config(envoy_config(access, UPSTREAMS, PORTS), tmp_path / "envoy.json")
    assert "OK" in validate(path)


def test_envoy_validate_refuses_a_broken_config(tmp_path):
    config = envoy_config(_access(), UPSTREAMS, PORTS)
    route = _routes(config)["public_grpc"]
    route["weighted_clusters"]["clusters"][0]["name"] = "no_such_cluster"
    with pytest.raises(AccessError, match="no_such_cluster"):
        validate(write_config(config, tmp_path / "envoy.json"))


def test_public_listeners_take_the_spec_host_and_admin_stays_on_loopback():
    config = envoy_config(_access(host="0.0.0.0"), UPSTREAMS, PORTS)
    addresses = {
        listener["name"]: listener["address"]["socket_address"]
        for listener in config["static_resources"]["listeners"]
    }
    assert addresses["public_grpc"] == {"address": "0.0.0.0", "port_value": PORTS.grpc}
    assert addresses["public_http"] == {"address": "0.0.0.0", "port_value": PORTS.http}
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": PORTS.admin}
    layers = [layer["name"] for layer in config["layered_runtime"]["layers"]]
    assert layers[-1] == "admin"  # what /runtime_modify writes overrides the static values


def test_admission_caps_are_per_replica_and_never_queue():
    clusters = _clusters(envoy_config(_access(max_requests=3, shadow_max_requests=1), UPSTREAMS, PORTS))
    assert set(clusters) == {
        "stable_grpc",
        "stable_http",
        "canary_grpc",
        "canary_http",
        "canary_grpc_shadow",
        "canary_http_shadow",
    }

    def threshold(name: str) -> dict:
        return clusters[name]["circuit_breakers"]["thresholds"][0]

    assert threshold("stable_grpc")["max_requests"] == 3
    assert threshold("canary_grpc")["max_requests"] == 6  # two replicas
    assert threshold("canary_http_shadow")["max_requests"] == 2
    # retries and ejections only where another replica can take the request
    assert threshold("stable_grpc")["max_retries"] == 0 and "outlier_detection" not in clusters["stable_grpc"]
    assert threshold("canary_grpc")["max_retries"] == 6
    assert clusters["canary_grpc"]["outlier_detection"]["consecutive_local_origin_failure"] == 1
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in clusters["canary_http"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert ports == [7100, 7200]
    grpc_options = clusters["stable_grpc"]["typed_extension_protocol_options"]
    assert "http2_protocol_options" in json.dumps(grpc_options)  # gRPC upstreams speak HTTP/2
    http_options = json.dumps(clusters["stable_http"]["typed_extension_protocol_options"])
    assert "http2" not in http_options and '"idle_timeout": "1.000s"' in http_options
    # no kept-alive HTTP connection holds a stopping tritonserver until its exit timeout
    assert clusters["stable_http"]["health_checks"][0]["reuse_connection"] is False
    assert "grpc_health_check" in clusters["stable_grpc"]["health_checks"][0]
    assert clusters["stable_http"]["health_checks"][0]["http_health_check"]["path"] == "/v2/health/ready"


def test_routes_split_by_runtime_weights_sticky_on_the_user_header_and_mirror_to_the_shadow():
    access = _access(weights={"stable": 80, "canary": 20}, shadow_fraction=0.125, request_timeout_s=7)
    for protocol, route in (
        ("grpc", _routes(envoy_config(access, UPSTREAMS, PORTS))["public_grpc"]),
        ("http", _routes(envoy_config(access, UPSTREAMS, PORTS))["public_http"]),
    ):
        assert route["hash_policy"] == [{"header": {"header_name": USER_HEADER}}]
        split = route["weighted_clusters"]
        assert split["use_hash_policy"] is True
        weights = {c["name"]: c["weight"] for c in split["clusters"]}
        assert weights == {cluster_name("stable", protocol): 80, cluster_name("canary", protocol): 20}
        for variant in ("stable", "canary"):
            prefix = split["runtime_key_prefix"]
            assert f"{prefix}.{cluster_name(variant, protocol)}" == weight_key(variant, protocol)
        (mirror,) = route["request_mirror_policies"]
        assert mirror["cluster"] == cluster_name("canary", protocol, shadow=True)
        assert mirror["runtime_fraction"]["runtime_key"] == SHADOW_KEY
        assert mirror["runtime_fraction"]["default_value"] == {"numerator": 125_000, "denominator": "MILLION"}
        assert route["timeout"] == "7.000s"
        # retried only when the request never reached a replica: no inference runs twice
        assert set(route["retry_policy"]["retry_on"].split(",")) == {
            "connect-failure",
            "refused-stream",
            "reset-before-request",
        }


def test_a_variant_without_a_server_gets_no_cluster_unless_it_takes_traffic():
    stable_only = {"stable": UPSTREAMS["stable"]}
    config = envoy_config(_access(), stable_only, PORTS)  # canary weight 0, no shadow: fine
    assert set(_clusters(config)) == {"stable_grpc", "stable_http"}
    assert "request_mirror_policies" not in _routes(config)["public_grpc"]
    with pytest.raises(AccessError, match=r"\['canary'\] take traffic"):
        envoy_config(_access(weights={"stable": 50, "canary": 50}), stable_only, PORTS)
    with pytest.raises(AccessError, match=r"\['canary'\] take traffic"):
        envoy_config(_access(shadow_fraction=0.5), stable_only, PORTS)
    with pytest.raises(AccessError, match="stable"):
        envoy_config(_access(weights={"stable": 0, "canary": 1}), {"canary": [Upstream(1, 2)]}, PORTS)


def test_the_config_is_written_as_json_only(tmp_path):
    config = envoy_config(_access(), UPSTREAMS, PORTS)
    assert json.loads(write_config(config, tmp_path / "envoy.json").read_text()) == config
    with pytest.raises(AccessError, match="must end in .json"):
        write_config(config, tmp_path / "envoy.yaml")


def test_the_unbounded_view_clears_queue_policies_and_links_everything_else(tiny_repository, tmp_path):
    source = tmp_path / "source"  # as built from a spec whose [serving.queue] sheds load
    shutil.copytree(tiny_repository, source)
    for step in STEPS:
        (source / step / "config.pbtxt").write_text(
            (source / step / "configs" / "throughput_first.pbtxt").read_text()
        )
    view = unbounded_view(source, tmp_path / "view")
    for step in STEPS:
        built = text_format.Parse((source / step / "config.pbtxt").read_text(), mc.ModelConfig())
        served = text_format.Parse((view / step / "config.pbtxt").read_text(), mc.ModelConfig())
        assert built.dynamic_batching.HasField("default_queue_policy")
        assert not served.dynamic_batching.HasField("default_queue_policy")
        served.dynamic_batching.ClearField("default_queue_policy")
        built.dynamic_batching.ClearField("default_queue_policy")
        assert served == built  # nothing else changed
        version = view / step / "1"
        assert version.is_symlink() and version.resolve() == (source / step / "1").resolve()
    ensemble = view / "tiny" / "config.pbtxt"
    assert ensemble.is_symlink()  # no queue policy there: linked as it is
    with pytest.raises(AccessError, match="holds no model"):
        unbounded_view(tmp_path / "view" / "tiny", tmp_path / "nothing")


def test_behind_proxy_picks_the_servers_queue_policy(tiny_repository, tmp_path):
    repositories = {"stable": tiny_repository}
    served, name = behind_proxy(repositories, UNBOUNDED, (), tmp_path)
    assert name is None and served["stable"] == tmp_path / "repository-stable"
    assert behind_proxy(repositories, "default", (), tmp_path) == (repositories, None)
    assert behind_proxy(repositories, "latency_first", ("latency_first",), tmp_path) == (
        repositories,
        "latency_first",
    )
    with pytest.raises(AccessError, match="'fast' is not a"):
        behind_proxy(repositories, "fast", ("latency_first",), tmp_path)


def test_the_sdk_sends_a_user_header_only_when_given_a_valid_user_id(tiny_spec):
    with CTRClient("127.0.0.1:1", spec=tiny_spec, user_id="user-42") as client:
        assert client._headers == {USER_HEADER: "user-42"}
    with CTRClient("127.0.0.1:1", spec=tiny_spec) as client:
        assert client._headers is None
    assert AsyncCTRClient("127.0.0.1:1", spec=tiny_spec, user_id="user-42")._headers == {
        USER_HEADER: "user-42"
    }
    for bad in ("", "line\nbreak", "naïve"):
        for client in (CTRClient, AsyncCTRClient):
            with pytest.raises(ValueError, match="user_id"):
                client("127.0.0.1:1", spec=tiny_spec, user_id=bad)


def test_the_commands_parse(tmp_path):
    from recserve.cli import main, parser

    args = parser().parse_args(["access", "--canary", str(tmp_path), "--workdir", str(tmp_path)])
    assert args.canary == tmp_path and args.workdir == tmp_path
    args = parser().parse_args(["lab", "overload", "--access", "--max-requests", "2", "--json", "o.json"])
    assert args.access and args.max_requests == 2 and str(args.json) == "o.json"
    # a repository that is not built is refused before anything starts
    assert main(["--spec", "tiny", "access", "--repository", str(tmp_path / "none")]) == 2


def test_the_overload_summary_gives_the_two_verdicts():
    from recserve.perf.lab.open_loop import SERVED, SHED, Outcome, phase_stats
    from recserve.perf.lab.overload import OverloadReport

    def phase(index, served_ms, shed_ms):
        outcomes = [Outcome(index, i / 100, i / 100, served_ms, SERVED) for i in range(100)]
        if shed_ms is not None:
            outcomes += [Outcome(index, 1 + i / 100, 1 + i / 100, shed_ms, SHED) for i in range(10)]
        return phase_stats(f"phase {index}", 100.0, outcomes)

    phases = [phase(0, 10.0, None), phase(1, 14.0, 2.0), phase(2, 10.0, None)]
    report = OverloadReport(200.0, phases, 0.25, [], {"overflow": 10}, [], "cores", "")
    summary = json.loads(json.dumps(report.summary()))  # JSON-ready: NaN written as null
    assert summary["served_p99_ratio"] == pytest.approx(1.4)
    assert summary["shed_p99_ms"] == pytest.approx(2.0)
    assert summary["phases"][0]["shed_p99_ms"] is None and summary["failed"] == 0
    assert summary["recovery_s"] == 0.25 and summary["capacity_rps"] == 200.0


def _manager(config: dict, protocol: str) -> dict:
    (listener,) = [
        item for item in config["static_resources"]["listeners"] if item["name"] == f"public_{protocol}"
    ]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def test_the_front_door_limits_come_from_the_served_configs(tiny_spec, tiny_repository):
    door = FrontDoor.from_repositories([tiny_repository])
    batch, longest = tiny_spec.model.max_batch_size, max(tiny_spec.serving.sequence_buckets)
    ensemble = door.inputs[tiny_spec.name]
    dims = {t.name: t.dims for t in tiny_spec.wire_inputs()}
    assert ensemble["dense"] == batch * dims["dense"][0]
    assert ensemble["history_items"] == batch * longest  # a variable dim holds the longest sequence
    assert ensemble["history_items__length"] == batch
    # the candidate-list ensemble (no batch dimension): users x candidates rows, as the row layout
    assert door.inputs[tiny_spec.candidates_model] == ensemble
    assert door.max_elements == max(ensemble.values())
    per_row = sum(ensemble.values()) // batch
    assert 40 * per_row * batch < door.max_body_bytes < 200 * per_row * batch + BODY_MARGIN_BYTES
    with pytest.raises(FrontDoorError, match="no model config"):
        FrontDoor.from_repositories([tiny_repository / "nothing"])


def test_the_public_listeners_carry_the_front_door_and_pass_envoy_validate(tiny_repository, tmp_path):
    door = FrontDoor.from_repositories([tiny_repository])
    config = envoy_config(_access(), UPSTREAMS, PORTS, door)
    http, grpc = _manager(config, "http"), _manager(config, "grpc")
    assert http["max_request_headers_kb"] == grpc["max_request_headers_kb"] == MAX_HEADERS_KB < 8
    for manager in (http, grpc):  # both listeners: the body bounded, then what Triton reads checked
        assert [f["name"] for f in manager["http_filters"]] == [
            "envoy.filters.http.buffer",
            "envoy.filters.http.lua",
            "envoy.filters.http.router",
        ]
        assert manager["http_filters"][0]["typed_config"]["max_request_bytes"] == door.max_body_bytes
        assert manager["normalize_path"] and manager["merge_slashes"]  # one spelling of each model path
    source = http["http_filters"][1]["typed_config"]["default_source_code"]["inline_string"]
    assert "@" not in source and f"local MAX_ELEMENTS = {door.max_elements}" in source
    assert '["tiny"] = {' in source and '["history_items"] = ' in source
    assert 'local PUBLIC = {["tiny"] = true, ["tiny_candidates"] = true}' in source  # the steps are not
    assert '["probability"] = true' in source  # the ensemble's outputs
    assert {
        m["filter"]["status_code_filter"]["comparison"]["value"]["default_value"]
        for m in http["local_reply_config"]["mappers"]
    } == {413, 431}
    # gRPC: the stream call (whose body never ends) is not buffered; the front door refuses it at once
    stream, catch_all = grpc["route_config"]["virtual_hosts"][0]["routes"]
    assert (
        stream["match"] == {"path": GRPC_STREAM_PATH}
        and "envoy.filters.http.buffer" in stream["typed_per_filter_config"]
    )
    assert catch_all["match"] == {"prefix": "/"} and stream["route"] == catch_all["route"]
    assert "OK" in validate(write_config(config, tmp_path / "envoy.json"))


def test_without_a_repository_the_front_door_still_bounds_everything():
    config = envoy_config(_access(), UPSTREAMS, PORTS)
    http = _manager(config, "http")
    assert http["http_filters"][0]["typed_config"]["max_request_bytes"] == FrontDoor().max_body_bytes
    assert (
        "local LIMITS = {}" in http["http_filters"][1]["typed_config"]["default_source_code"]["inline_string"]
    )


def test_only_a_dead_replica_is_ejected_never_one_that_answered_an_error():
    detection = _clusters(envoy_config(_access(), UPSTREAMS, PORTS))["canary_http"]["outlier_detection"]
    assert detection["consecutive_local_origin_failure"] == 1  # refused or reset: the process is gone
    # a client's malformed body gets Triton's 500: 5xx answers and success rates never eject
    for enforcing in ("consecutive_5xx", "consecutive_gateway_failure", "success_rate", "failure_percentage"):
        assert detection[f"enforcing_{enforcing}"] == 0


def test_model_and_input_names_are_written_into_lua_as_plain_escaped_literals():
    door = FrontDoor(inputs={'a"]]..os.exit()--': {"x\n": 5}})
    source = lua_source(door)
    assert '["a\\034\\093\\093..os.exit\\040\\041--"] = {["x\\010"] = 5}' in source
