"""The front door live: Envoy refuses what would kill or mislead a tritonserver before it reaches one.

Two parts. The scanner alone: a real Envoy whose HTTP listener carries the front door in front of a
route that answers 200 itself, so many hostile bodies are checked in seconds. The whole stack: the
access layer over two replicas of the tiny repository, where the JSON shape bombs that abort
tritonserver 2.51 (``std::bad_alloc``) are refused, oversized headers get 431 without ejecting a
replica, and legitimate requests (the SDK over HTTP and gRPC, JSON flat, nested and pretty-printed,
at the largest batch) are served as directly.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from recserve.access import AccessLayer, EnvoyProxy, ProxyPorts, write_config
from recserve.access.config import listener
from recserve.access.front_door import FrontDoor
from recserve.build.repository import build_repository
from recserve.build.synthetic import generate
from recserve.clients import CTRClient, RecserveClientError, read_rows
from recserve.clients.writers import write_tsv
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from recserve.perf.harness.traffic import infer_request

pytestmark = pytest.mark.integration

_DATATYPES = {"float32": "FP32", "int64": "INT64", "int32": "INT32", "bool": "BOOL", "object": "BYTES"}
PASSED = "passed the front door"


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _json_inputs(inputs: dict[str, np.ndarray], nested: bool) -> list[dict[str, object]]:
    """Triton's JSON form of ``inputs``: ``data`` flat or nested as the shape."""
    out = []
    for name, array in inputs.items():
        values = array.tolist() if nested else array.reshape(-1).tolist()
        if array.dtype == object:
            values = json.loads(json.dumps(values, default=lambda b: b.decode()))
        out.append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": _DATATYPES[array.dtype.name],
                "data": values,
            }
        )
    return out


def _bomb(shape: str, data: str = "[0]", name: str = "dense") -> bytes:
    return f'{{"inputs":[{{"name":"{name}","shape":{shape},"datatype":"FP32","data":{data}}}]}}'.encode()


def _typed(datatype: str, data: str) -> bytes:
    body = {"inputs": [{"name": "history_items", "shape": [1, 1], "data": "@", "datatype": datatype}]}
    return json.dumps(body).replace('"@"', data).encode()


@pytest.fixture(scope="module")
def tiny() -> ModelSpec:
    return load_spec("tiny")


@pytest.fixture(scope="module")
def repository(tiny: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("front_door") / "tiny"
    build_repository(tiny, path)
    return path


@pytest.fixture(scope="module")
def scanner(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Envoy with the front door on its HTTP listener, answering 200 itself behind it."""
    root = tmp_path_factory.mktemp("scanner")
    ports = ProxyPorts.free()
    access = dataclasses.replace(load_spec("tiny").access, weights={"stable": 100})
    public = listener(access, "http", ports.http, ["stable"], FrontDoor.from_repositories([repository]))
    manager = public["filter_chains"][0]["filters"][0]["typed_config"]
    manager["route_config"]["virtual_hosts"][0]["routes"] = [
        {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": PASSED}}}
    ]
    config = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": ports.admin}}},
        "static_resources": {"listeners": [public]},
    }
    proxy = EnvoyProxy(
        write_config(config, root / "envoy.json"), f"127.0.0.1:{ports.admin}", root / "envoy.log"
    )
    proxy.start()
    try:
        yield f"http://127.0.0.1:{ports.http}"
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            _bomb("[1099511627776,13]"),
            "input 'dense': shape [1099511627776,13] holds 14293651161088 elements",
        ),
        (_bomb("[9223372036854775807,2]"), "input 'dense': dimension 9223372036854775807 is too large"),
        (_bomb("[4294967300,13]"), "input 'dense': shape [4294967300,13] holds 55834574900 elements"),
        (_bomb("[-1,4]"), "input 'dense': a dimension must be a non-negative integer, got '-1'"),
        (_bomb("[1.0,4]"), "a dimension must be a non-negative integer, got '1.0'"),
        (_bomb("[1e3,4]"), "a dimension must be a non-negative integer, got '1e3'"),
        (_bomb('["2",4]'), "input 'dense': 'shape' holds '\"2\",4]"),
        (_bomb("[2,4]", "[1,2,3,4]"), "input 'dense': shape [2,4] holds 8 elements but 'data' holds 4"),
        (_bomb("[2,2]", "[[1,2],[3]]"), "shape [2,2] holds 4 elements but 'data' holds 3"),
        (_bomb("[1,1,1,1,1,1,1,1,1]", "[0]"), "a shape has at most 8 dimensions"),
        (
            _bomb("[1,13]", name="x" * 100_000),
            "input '" + "x" * 64 + "... (100000 characters)' is not an input of model 'tiny'",
        ),
        (b'{"inputs":[{"shape":[1,4],"data":[1,2,3,4]}]}', "inputs[0] has no 'name'"),
        (b'{"inputs":[{"name":"dense","data":[1]}]}', "input 'dense' has no 'shape'"),
        (
            _bomb("[1,1]").replace(b'"shape":[1,1]', b'"shape":[1,1],"shape":[4294967300,13]'),
            "'shape' given twice",
        ),
        (
            b'{"inputs":[{"name":"dense","shape":[1],"data":' + b"[" * 100 + b"]" * 100 + b"}]}",
            "deeper than 16",
        ),
        (b"[" * 200_000, "an inference body is a JSON object"),
        (b'{"inputs":' + b"[" * 200_000, "inputs[0] must be an object, found '[[[["),
        (b'{"inputs":[{"name":"dense","shape":[1,', "'shape' holds the end of the body"),
        (b'{"inputs":[{"name":"dense","shape":[1],"data":["' + b"a" * 5000, "an unterminated JSON string"),
        (
            b"\x00\xff\xfe garbage",
            "an inference body is a JSON object, found '\x00\xff\xfe garbage'",
        ),
        (b'{"inputs":[]} trailing', "bytes after the JSON body"),
        # keys and names are compared as Triton's parser decodes them
        (
            _bomb("[1099511627776,13]").replace(b'"inputs"', b'"in\\u0070uts"'),
            "input 'dense': shape [1099511627776,13] holds 14293651161088 elements",
        ),
        (
            _bomb("[1,13]").replace(b'"shape"', b'"sh\\u0061pe":[1099511627776,13],"shape"'),
            "inputs[0]: key 'shape' given twice",
        ),
        (
            _bomb("[1099511627776,13]", name="d\\u0065nse"),
            "input 'dense': shape [1099511627776,13] holds",
        ),
        (_bomb("[1,4]", name="\\ud800x"), "a lone surrogate escape"),
        (_bomb("[1,4]", name="\\x"), "a bad escape in a JSON string"),
        (_bomb("[1,4]", name="a\tb"), "a raw control character (byte 9)"),
        (b'{"id":"1","id":"2","inputs":[]}', "key 'id' given twice"),
        (b'{"input":[' + _bomb("[1099511627776,13]")[11:], "unknown key 'input' in an inference request"),
        (_bomb("[1,4]").replace(b'"data"', b'"datas"'), "input 'dense': unknown key 'datas'"),
        (_bomb("[1,4]").replace(b'"FP32"', b'"XX"'), "datatype 'XX' is not a KServe v2 datatype"),
        (_bomb("[01,4]"), "a dimension must be a non-negative integer, got '01'"),
        (_bomb("[1,1]", "[01]"), "expected ',' or ']', found '1]"),
        (_bomb("[1,1]", "[1.]"), "unexpected '1.]"),
        (_bomb("[1,1]", "[NaN]"), "unexpected 'NaN]"),
        (_bomb("[1,1]", "[+1]"), "unexpected '+1]"),
        (
            b'{"inputs":[],"outputs":[{"name":"' + b"p" * 1000 + b'"}]}',
            "output '" + "p" * 64 + "... (1000 characters)' is not an output of model 'tiny'",
        ),
        (b'{"inputs":[],"parameters":{"a":1,"a":2}}', "the request parameters: key 'a' given twice"),
        # elements Triton's reader would take for another type (its 500, a client's error)
        (_typed("INT64", "[1.5]"), "input 'history_items': 'data' holds '1.5]"),
        (_typed("INT64", "[-0]"), "not a signed 64-bit integer"),
        (_typed("INT64", "[1e3]"), "not a signed 64-bit integer"),
        (_typed("INT64", "[9223372036854775808]"), "not a signed 64-bit integer"),
        (_typed("UINT64", "[-1]"), "not a unsigned 64-bit integer"),
        (_typed("BYTES", "[1]"), "not a string"),
        (_typed("BOOL", "[1]"), "not a true or false"),
        (_bomb("[1,1]", "[1e400]"), "unexpected '1e400]"),
        (b"", "an inference request needs a JSON body"),
    ],
    ids=lambda value: value[:40] if isinstance(value, str) else "body",
)
def test_the_scanner_refuses_what_it_cannot_prove_safe(scanner, body, message):
    """Refused with a message naming the input; escapes, duplicates and unknown keys as Triton reads them."""
    status, answer = _post(f"{scanner}/v2/models/tiny/infer", body)
    assert status == 400, answer
    error = json.loads(answer)["error"]
    assert message in error
    assert len(error) < 400  # echoed values are truncated


@pytest.mark.parametrize("path", ["/v2/models/tiny/infer", "/v2/models/tiny/versions/1/infer?x=1"])
def test_every_inference_path_is_scanned(scanner, path):
    status, _ = _post(scanner + path, _bomb("[4294967300,13]"))
    assert status == 400


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/dense/infer",
        "/v2/models/embedding_lookup/versions/1/infer",
        "/v2/models/dense/ready",
        "/v2/models/dense",
        "/v2/models/dense/stats",
        "/v2/models/%64ense/infer",
        "//v2//models/dense/infer",
        "/v2/models/tiny/../dense/infer",
        "/v2/models/other/infer?x=1",
    ],
)
def test_only_the_served_ensembles_are_public(scanner, path):
    """An ensemble's steps (and any other name) are answered 404 on every path, however spelled."""
    for method in ("GET", "POST"):
        request = urllib.request.Request(scanner + path, data=_bomb("[1,4]"), method=method)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 404, path
        assert (
            "is not served through this proxy (served: tiny, tiny_candidates)"
            in refused.value.read().decode()
        )
    assert _post(f"{scanner}/v2/models/tiny/ready", b"")[0] == 200


def test_the_scanner_passes_valid_bodies_and_other_paths(scanner, tiny):
    inputs = generate(tiny, 8, seed=1).to_wire(tiny)
    for nested in (False, True):
        for indent in (None, 2):
            body = json.dumps({"id": "1", "inputs": _json_inputs(inputs, nested)}, indent=indent).encode()
            assert _post(f"{scanner}/v2/models/tiny/infer", body) == (200, PASSED.encode())
    empty_data = b'{"inputs":[{"name":"dense","shape":[0,4],"datatype":"FP32","data":[]}],"parameters":{}}'
    assert _post(f"{scanner}/v2/models/tiny/infer", empty_data)[0] == 200
    # the binary form: only its JSON header is scanned, the tensor bytes follow
    header = (
        b'{"inputs":[{"name":"dense","shape":[1,4],"datatype":"FP32","parameters":{"binary_data_size":16}}]}'
    )
    binary = {"Inference-Header-Content-Length": str(len(header))}
    assert _post(f"{scanner}/v2/models/tiny/infer", header + bytes(16), binary)[0] == 200
    lie = _bomb("[4294967300,13]").replace(b'"data":[0]', b'"parameters":{"binary_data_size":4}')
    status, answer = _post(
        f"{scanner}/v2/models/tiny/infer", lie + bytes(4), {"Inference-Header-Content-Length": str(len(lie))}
    )
    assert status == 400 and b"4294967300" in answer
    assert (
        _post(f"{scanner}/v2/models/tiny/infer", header, {"Inference-Header-Content-Length": "99999"})[0]
        == 400
    )
    assert _post(f"{scanner}/v2/health/ready", b"anything")[0] == 200  # not an inference body


def test_sizes_and_encodings_are_refused_with_their_own_status(scanner, repository):
    door = FrontDoor.from_repositories([repository])
    status, answer = _post(f"{scanner}/v2/models/tiny/infer", b" " * (door.max_body_bytes + 1))
    assert status == 413 and str(door.max_body_bytes) in json.loads(answer)["error"]
    status, answer = _post(f"{scanner}/v2/models/tiny/infer", b"{}", {"Content-Encoding": "gzip"})
    assert status == 415 and "gzip" in json.loads(answer)["error"]
    for size in (9 * 1024, 64 * 1024):
        status, answer = _post(f"{scanner}/v2/models/tiny/infer", b"{}", {"X-Big": "a" * size})
        assert status == 431 and json.loads(answer) == {"error": "request headers over 7 KiB"}


@pytest.fixture(scope="module")
def stack(
    tiny: ModelSpec, repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AccessLayer]:
    """The access layer over two replicas of the tiny repository."""
    access = dataclasses.replace(tiny.access, weights={"stable": 100}, shadow_fraction=0.0, replicas=2)
    root = tmp_path_factory.mktemp("front_door_stack")
    with AccessLayer(access, {"stable": repository}, root, ProxyPorts.free()) as layer:
        yield layer


def _ejections(layer: AccessLayer) -> int:
    stats = layer.admin.stats(r"outlier_detection\.ejections_enforced_total")
    return sum(int(value) for value in stats.values())


def test_json_shape_bombs_through_the_proxy_are_refused_and_kill_nothing(stack, tiny):
    replicas = stack.servers["stable"]
    pids = [server.process.pid for server in replicas]
    url = f"http://{stack.http_url}/v2/models/{tiny.name}/infer"
    escaped = _bomb("[1099511627776,13]").replace(b'"inputs"', b'"in\\u0070uts"')
    shadowed = _bomb("[1,13]").replace(b'"shape"', b'"sh\\u0061pe":[1099511627776,13],"shape"')
    bombs = [_bomb(s) for s in ("[1099511627776,13]", "[9223372036854775807,2]", "[4294967300,13]")]
    for body in [*bombs, escaped, shadowed]:
        for _ in range(len(replicas)):  # round robin: each replica would get one
            status, answer = _post(url, body, {"Content-Type": "application/json"})
            assert status == 400, answer
            assert (
                "input 'dense'" in json.loads(answer)["error"] or "inputs[0]" in json.loads(answer)["error"]
            )
    assert [server.process.pid for server in replicas] == pids
    assert all(server.process.poll() is None and server.is_ready() for server in replicas)
    with CTRClient(stack.http_url, protocol="http", spec=tiny, timeout_s=30) as client:
        assert client.predict_inputs(generate(tiny, 4, seed=2).to_wire(tiny)).shape == (4,)
    assert _ejections(stack) == 0


def test_oversized_headers_get_431_and_never_eject_a_replica(stack, tiny):
    url = f"http://{stack.http_url}/v2/models/{tiny.name}/infer"
    sent = stack.admin.cluster_stat("stable", "http", "upstream_rq_total")
    for size in (9 * 1024, 64 * 1024):  # Triton drops the connection on a header line of 8 KiB
        for _ in range(4):
            status, answer = _post(url, b"{}", {"X-Big": "a" * size})
            assert status == 431, answer
    assert stack.admin.cluster_stat("stable", "http", "upstream_rq_total") == sent  # none went on
    assert _ejections(stack) == 0
    inputs = generate(tiny, 4, seed=3).to_wire(tiny)
    with CTRClient(stack.http_url, protocol="http", spec=tiny, timeout_s=30) as client:
        for _ in range(4):  # every replica serves
            assert client.predict_inputs(inputs).shape == (4,)


def test_legitimate_requests_at_the_largest_batch_pass_as_directly(stack, tiny):
    rows = generate(tiny, tiny.model.max_batch_size, seed=4)
    inputs = rows.to_wire(tiny)
    longest = max(tiny.serving.sequence_buckets)
    history = np.resize(inputs["history_items"].reshape(-1), (tiny.model.max_batch_size, longest))
    inputs["history_items"] = np.ascontiguousarray(history, dtype=np.int64)
    inputs["history_items__length"] = np.full((tiny.model.max_batch_size, 1), longest, np.int32)
    direct = stack.servers["stable"][0]
    with CTRClient(direct.grpc_url, spec=tiny, timeout_s=30) as client:
        expected = client.predict_inputs(inputs)
    for protocol, url in (("grpc", stack.grpc_url), ("http", stack.http_url)):
        with CTRClient(url, protocol=protocol, spec=tiny, timeout_s=30) as client:
            np.testing.assert_allclose(client.predict_inputs(inputs), expected, rtol=1e-6)
    for nested, indent in ((False, None), (True, 2)):
        body = json.dumps({"inputs": _json_inputs(inputs, nested)}, indent=indent).encode()
        status, answer = _post(f"http://{stack.http_url}/v2/models/{tiny.name}/infer", body)
        assert status == 200, answer[:300]
        (probability,) = [o for o in json.loads(answer)["outputs"] if o["name"] == "probability"]
        np.testing.assert_allclose(np.asarray(probability["data"]), expected, rtol=1e-5)


def test_a_candidate_list_over_http_passes(stack, tiny, tmp_path):
    rows = read_rows(write_tsv(tmp_path / "rows.tsv", generate(tiny, 300, seed=5), tiny), tiny)
    user = {"history_items": rows.history[0, : rows.lengths[0]].tolist()}
    with CTRClient(stack.http_url, protocol="http", spec=tiny, timeout_s=30) as client:
        assert client.score_candidates(user, rows).shape == (300,)  # two requests, the first at max batch


def test_an_oversized_grpc_message_is_refused_at_the_proxy(stack, tiny, repository):
    door = FrontDoor.from_repositories([repository])
    message = infer_request(tiny.name, generate(tiny, 4, seed=6).to_wire(tiny))
    message.raw_input_contents[0] = bytes(door.max_body_bytes + 1)
    sent = stack.admin.cluster_stat("stable", "grpc", "upstream_rq_total")
    with grpc.insecure_channel(stack.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(message, timeout=30)
        assert str(door.max_body_bytes) in (refused.value.details() or "")
        assert stub.ModelInfer(infer_request(tiny.name, generate(tiny, 4, seed=6).to_wire(tiny)), timeout=30)
    assert stack.admin.cluster_stat("stable", "grpc", "upstream_rq_total") == sent + 1  # only the valid one


def _refused(call: object, *args: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        result = call(*args, timeout=30)  # type: ignore[operator]
        if not isinstance(result, service_pb2.ModelInferResponse):
            list(result)  # a stream answers as it is read
    return refused.value


def test_grpc_reaches_only_the_served_ensembles_by_bounded_names(stack, tiny):
    """Steps are NOT_FOUND, long or unknown names and huge shapes INVALID_ARGUMENT, the stream call
    UNIMPLEMENTED: none reaches a tritonserver, none ejects a replica, a valid call is served."""
    inputs = generate(tiny, 4, seed=7).to_wire(tiny)
    sent = stack.admin.cluster_stat("stable", "grpc", "upstream_rq_total")
    with grpc.insecure_channel(stack.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for model in ("dense", "embedding_lookup", ""):
            message = infer_request(tiny.name, inputs)
            message.model_name = model
            error = _refused(stub.ModelInfer, message)
            assert error.code() == grpc.StatusCode.NOT_FOUND, error
            assert f"model '{model}' is not served through this proxy" in (error.details() or "")
        for call, request in (
            (stub.ModelMetadata, service_pb2.ModelMetadataRequest(name="dense")),
            (stub.ModelReady, service_pb2.ModelReadyRequest(name="embedding_lookup")),
            (stub.ModelConfig, service_pb2.ModelConfigRequest(name="dense")),
            (stub.ModelStatistics, service_pb2.ModelStatisticsRequest(name="dense")),
        ):
            assert _refused(call, request).code() == grpc.StatusCode.NOT_FOUND
        long_name = infer_request(tiny.name, inputs)
        long_name.inputs[0].name = "x" * 100_000
        long_output = infer_request(tiny.name, inputs)
        long_output.outputs.add().name = "p" * 100_000
        huge = infer_request(tiny.name, inputs)
        huge.inputs[0].shape[:] = [2**40, 13]
        for message, text in (
            (long_name, "input '" + "x" * 64 + "... (100000 characters)' is not an input of model 'tiny'"),
            (long_output, "output '" + "p" * 64 + "... (100000 characters)' is not an output"),
            (huge, "shape [1099511627776,13] holds 14293651161088 elements"),
        ):
            error = _refused(stub.ModelInfer, message)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and text in (error.details() or "")
            assert len(error.details() or "") < 400
        stream = _refused(stub.ModelStreamInfer, iter([infer_request(tiny.name, inputs)]))
        assert stream.code() == grpc.StatusCode.UNIMPLEMENTED
        assert stub.ModelInfer(infer_request(tiny.name, inputs), timeout=30).outputs
        assert stub.ModelReady(service_pb2.ModelReadyRequest(name=tiny.name), timeout=30).ready
        every = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(), timeout=30)  # perf_analyzer's
        assert {"dense", tiny.name} <= {m.name for m in every.model_stats}
    assert stack.admin.cluster_stat("stable", "grpc", "upstream_rq_total") == sent + 3  # only the valid ones
    assert _ejections(stack) == 0


def test_a_client_without_a_spec_reads_the_served_one_directly_and_through_the_proxy(stack, tiny):
    """A step's config (on a server) or the ensemble's (the public model) carries the spec."""
    inputs = generate(tiny, 4, seed=8).to_wire(tiny)
    direct = stack.servers["stable"][0]
    with CTRClient(direct.grpc_url, timeout_s=30) as client:
        assert client.spec.to_json() == tiny.to_json() and client.model_name == tiny.name
        expected = client.predict_inputs(inputs)
    for protocol, url in (("grpc", stack.grpc_url), ("http", stack.http_url)):
        with CTRClient(url, protocol=protocol, model_name=tiny.name, timeout_s=30) as client:
            np.testing.assert_array_equal(client.predict_inputs(inputs), expected)
        with CTRClient(url, protocol=protocol, timeout_s=30) as client:  # the steps are not public
            with pytest.raises(RecserveClientError, match="is not served through this proxy"):
                client.predict_inputs(inputs)
