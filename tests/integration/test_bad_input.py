"""Bad requests get a clear error naming the input; the server keeps serving."""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from recserve.build.synthetic import generate
from recserve.core.names import STEPS
from recserve.perf.harness.traffic import infer_request

from .helpers import grpc_client, http_client, infer_inputs, infer_raw


def _cases(spec):
    """Malformed requests built from a valid 3-row one.

    label -> (corrupt in place, text the error must name).
    """
    d, dm, c, t, h, hl = (x.name for x in spec.wire_inputs())

    def set_value(name, index, value):
        return lambda w: w[name].__setitem__(index, value)

    def replace(name, make):
        return lambda w: w.__setitem__(name, make(w[name]))

    def nan(value):
        def corrupt(w):
            w[d][1, 4], w[dm][1, 4] = value, False

        return corrupt

    def history(width, length):
        def corrupt(w):
            w[h] = np.ones((len(w[h]), width), np.int64)
            w[hl][:] = length

        return corrupt

    def big_batch(w):
        for k in list(w):
            w[k] = np.repeat(w[k][:1], spec.model.max_batch_size + 1, axis=0)

    cases = {
        # dtypes (refused by the server core or the feature step, naming the input)
        "dense as FP64": (replace(d, lambda a: a.astype(np.float64)), d),
        "dense as INT32": (replace(d, lambda a: a.astype(np.int32)), d),
        "missing mask as INT8": (replace(dm, lambda a: a.astype(np.int8)), dm),
        "categorical as INT64": (replace(c, lambda a: np.zeros(a.shape, np.int64)), c),
        "target as FP32": (replace(t, lambda a: a.astype(np.float32)), t),
        "huge target id as UINT64": (replace(t, lambda a: np.full(a.shape, 2**64 - 1, np.uint64)), t),
        "history as INT32": (replace(h, lambda a: a.astype(np.int32)), h),
        "history length as INT64": (replace(hl, lambda a: a.astype(np.int64)), hl),
        # shapes
        "dense with 12 columns": (replace(d, lambda a: a[:, :12].copy()), d),
        "dense with 14 columns": (replace(d, lambda a: np.concatenate([a, a[:, :1]], axis=1)), d),
        "dense with 3 dims": (replace(d, lambda a: a[:, :, None].copy()), d),
        "missing mask with 12 columns": (replace(dm, lambda a: a[:, :12].copy()), dm),
        "categorical with 25 columns": (replace(c, lambda a: a[:, :25].copy()), c),
        "target with 2 columns": (replace(t, lambda a: np.repeat(a, 2, axis=1)), t),
        "history length with 2 columns": (replace(hl, lambda a: np.repeat(a, 2, axis=1)), hl),
        "target with one row fewer": (replace(t, lambda a: a[:-1].copy()), t),
        "batch above max_batch_size": (big_batch, str(spec.model.max_batch_size)),
        # missing and extra inputs
        "missing dense": (lambda w: w.pop(d), d),
        "missing mask": (lambda w: w.pop(dm), dm),
        "missing categorical": (lambda w: w.pop(c), c),
        "missing target": (lambda w: w.pop(t), t),
        "missing history": (lambda w: w.pop(h), h),
        "missing history length": (lambda w: w.pop(hl), hl),
        "extra input": (
            lambda w: w.__setitem__("user_secret", np.zeros((len(w[d]), 1), np.float32)),
            "user_secret",
        ),
        # values
        "NaN in a dense value": (nan(np.nan), d),
        "+Inf in a dense value": (nan(np.inf), d),
        "-Inf in a dense value": (nan(-np.inf), d),
        "target id below -1": (set_value(t, (0, 0), -7), t),
        "negative history id": (lambda w: w[hl].fill(1) or w[h].fill(-5), h),
        "negative history length": (set_value(hl, (2, 0), -1), hl),
        "history length beyond its width": (history(4, 9), hl),
        "empty history with a length": (history(0, 3), hl),
        "history longer than the maximum": (history(300, 300), hl),
        "history padded beyond the maximum": (lambda w: history(300, 5)(w) or w[h].fill(7), h),
        "non-hex categorical": (set_value(c, (0, 3), b"not-hex"), c),
        "categorical of 17 hex digits": (set_value(c, (1, 0), b"1" * 17), c),
        "non-UTF-8 categorical": (set_value(c, (2, 5), b"\xff\xfe\x80"), c),
    }
    return cases


def _stubs_unchanged(server, before):
    assert server.stubs() == before, "a Python-backend stub restarted"


def _assert_clear(label, message, named):
    assert named in message, f"{label}: {message}"
    assert "/" not in message.replace("n/a", ""), f"{label} leaks a path: {message}"
    for secret in ("Traceback", "triton_python_backend_shm", ".py", "model_repository"):
        assert secret not in message, f"{label} leaks {secret!r}: {message}"


def test_the_corpus_covers_at_least_thirty_malformed_requests(spec):
    assert len(_cases(spec)) >= 30


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_each_bad_request_names_its_input_and_the_next_one_succeeds(server, spec, protocol):
    module, make = (grpcclient, grpc_client) if protocol == "grpc" else (httpclient, http_client)
    good = generate(spec, 3, seed=77).to_wire(spec)
    stubs = server.stubs()
    with make(server) as client:
        expected = infer_raw(module, client, spec, good)
        for label, (corrupt, named) in _cases(spec).items():
            bad = {k: v.copy() for k, v in good.items()}
            corrupt(bad)
            with pytest.raises(InferenceServerException) as err:
                infer_raw(module, client, spec, bad)
            assert str(err.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), f"{label}: {err.value}"
            _assert_clear(label, err.value.message(), named)
            np.testing.assert_array_equal(infer_raw(module, client, spec, good), expected)
    _stubs_unchanged(server, stubs)


def test_edge_values_that_are_valid_are_served(server, spec):
    """Huge int64 ids and empty histories are legal: served with the out-of-vocabulary vector / no history."""
    good = generate(spec, 3, seed=78).to_wire(spec)
    good[spec.target.name][:] = np.iinfo(np.int64).max
    good[spec.sequence.name] = np.zeros((3, 0), np.int64)
    good[spec.sequence_length_input][:] = 0
    with grpc_client(server) as client:
        probabilities = infer_raw(grpcclient, client, spec, good)
    assert probabilities.shape == (3,) and np.isfinite(probabilities).all()


def _post(server, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    import http.client

    connection = http.client.HTTPConnection(server.http_url, timeout=30)
    try:
        connection.request("POST", "/v2/models/ctr/infer", body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def test_grpc_byte_size_lies_are_refused_and_the_next_request_succeeds(server, spec):
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    good = generate(spec, 3, seed=81).to_wire(spec)

    def request(name, change):
        message = infer_request(spec.name, good)
        index = list(good).index(name)
        message.raw_input_contents[index] = change(message.raw_input_contents[index])
        return message

    d, c = spec.dense.name, spec.categorical.name
    lies = {
        "dense 4 bytes short": (request(d, lambda b: b[:-4]), d),
        "dense 4 bytes long": (request(d, lambda b: b + bytes(4)), d),
        "categorical length prefix beyond the data": (request(c, lambda b: b"\xff\xff\x00\x00" + b[4:]), c),
        "categorical cut inside a string": (request(c, lambda b: b[:-1]), c),
    }
    stubs = server.stubs()
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for label, (message, named) in lies.items():
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(message, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{label}: {err.value}"
            _assert_clear(label, err.value.details(), named)
            assert stub.ModelInfer(request(d, lambda b: b), timeout=30).outputs
    _stubs_unchanged(server, stubs)


def _raw_http_cases(spec, good):
    import json

    d, last = spec.dense.name, list(good)[-1]  # a size lie shows where the bytes run out: the last input
    tensors = [
        {"name": k, "datatype": np_to_triton_dtype(v.dtype), "shape": list(v.shape)} for k, v in good.items()
    ]

    def binary(lie=0, shape=None):
        header_tensors, blobs = [], []
        for tensor, array in zip(tensors, good.values(), strict=True):
            blob = infer_request(spec.name, {tensor["name"]: array}).raw_input_contents[0]
            entry = dict(
                tensor, parameters={"binary_data_size": len(blob) + (lie if tensor["name"] == last else 0)}
            )
            if shape and tensor["name"] == d:
                entry["shape"] = shape
            header_tensors.append(entry)
            blobs.append(blob)
        header = json.dumps({"inputs": header_tensors}).encode()
        return header + b"".join(blobs), {"Inference-Header-Content-Length": str(len(header))}

    def json_body(replace):
        inputs = []
        for tensor, array in zip(tensors, good.values(), strict=True):
            data = (
                [x.decode() for x in array.reshape(-1)]
                if array.dtype == object
                else array.reshape(-1).tolist()
            )
            inputs.append(dict(tensor, data=data))
        return replace(json.dumps({"inputs": inputs}).encode()), {"Content-Type": "application/json"}

    # label -> (body and headers, text the error names, status):
    # Triton 2.51 answers JSON parse errors with 500
    return {
        "binary size larger than sent": (binary(lie=+4), last, 400),
        "binary size smaller than sent": (binary(lie=-4), "additional input data", 400),
        "shape promising 2**40 elements": (binary(shape=[2**20, 2**20]), d, 400),
        "negative shape": (binary(shape=[-3, 13]), "shape", 500),
        "non-UTF-8 bytes in the JSON body": (
            json_body(lambda b: b.replace(b'"dense"', b'"de\xffnse"', 1)),
            "",
            400,
        ),
        "JSON body cut short": (json_body(lambda b: b[: len(b) // 2]), "parse", 500),
        "JSON data with too few elements": (
            json_body(lambda b: b.replace(b'"data": [', b'"data": [1.0, ', 1)),
            "data",
            500,
        ),
    }


def test_malformed_http_bodies_are_refused_and_the_next_request_succeeds(server, spec):
    good = generate(spec, 3, seed=79).to_wire(spec)
    stubs = server.stubs()
    with http_client(server) as client:
        expected = infer_raw(httpclient, client, spec, good)
        for label, ((body, headers), named, expected_status) in _raw_http_cases(spec, good).items():
            status, text = _post(server, body, headers)
            assert status == expected_status, f"{label}: {status} {text}"
            _assert_clear(label, text, named)
            np.testing.assert_array_equal(infer_raw(httpclient, client, spec, good), expected)
    _stubs_unchanged(server, stubs)


def test_an_oversized_http_body_is_refused(server, spec):
    good = generate(spec, 1, seed=80).to_wire(spec)
    """A 70 MB body claiming a [1, 13] tensor: refused (Triton 2.51 answers this parse error with 500)."""
    body = (
        b'{"inputs": [{"name": "dense", "datatype": "FP32", "shape": [1, 13], "data": ['
        + b"0.0, " * (14 << 20)
        + b"0.0]}]}"
    )
    status, text = _post(server, body, {"Content-Type": "application/json"})
    assert status in (400, 500) and ("dense" in text or "data" in text), f"{status} {text[:300]}"
    _assert_clear("oversized body", text[:2000], "")
    with http_client(server) as client:
        infer_raw(httpclient, client, spec, good)


def _stats(client, model):
    """(rows inferred, model executions) so far."""
    stats = client.get_inference_statistics(model_name=model, as_json=True)["model_stats"][0]
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def _fire(client, model, requests):
    """Send all requests at once (async) and collect (result or error) in order."""
    import threading

    results = [None] * len(requests)
    done = threading.Semaphore(0)

    def callback(index):
        def record(result, error):
            results[index] = error if error is not None else result
            done.release()

        return record

    for i, inputs in enumerate(requests):
        client.async_infer(model, infer_inputs(grpcclient, inputs), callback(i))
    for _ in requests:
        assert done.acquire(timeout=60)
    return results


def test_one_bad_request_in_a_dynamic_batch_fails_alone(server, spec):
    requests = [generate(spec, 2, seed=100 + i).to_wire(spec) for i in range(32)]
    bad = 13
    requests[bad][spec.dense.name][0, 0], requests[bad][spec.dense_missing_input][0, 0] = np.nan, False
    with grpc_client(server) as client:
        before = _stats(client, STEPS[0])
        results = _fire(client, spec.name, requests)
        after = _stats(client, STEPS[0])
        for i, result in enumerate(results):
            if i == bad:
                assert isinstance(result, InferenceServerException)
                assert "input 'dense'" in result.message() and "nan" in result.message()
            else:
                assert not isinstance(result, Exception), str(result)
                np.testing.assert_allclose(
                    result.as_numpy("probability").reshape(-1),
                    infer_raw(grpcclient, client, spec, requests[i]),
                    atol=1e-6,
                )
    rows, executions = after[0] - before[0], after[1] - before[1]
    assert rows == 2 * 32 and executions < 32, "requests were not batched together"


def test_a_bad_request_fails_alone_inside_a_merged_batch(server, spec):
    """Direct calls to the dense step: its requests are merged into one ONNX Runtime call."""
    rng = np.random.default_rng(0)
    dim = spec.model.embedding_dim

    def request(rows, length, mask_length=None):
        return {
            "dense_normalized": rng.random((rows, 13), dtype=np.float32),
            "sparse_embeddings": rng.normal(size=(rows, spec.num_sparse, dim)).astype(np.float32),
            "target_embedding": rng.normal(size=(rows, dim)).astype(np.float32),
            "history_embeddings": rng.normal(size=(rows, length, dim)).astype(np.float32),
            "history_mask": np.ones((rows, mask_length or length), np.float32),
        }

    requests = [request(3, 8 if i % 2 else 32) for i in range(24)]
    requests[5] = request(3, 8, mask_length=32)
    with grpc_client(server) as client:
        before = _stats(client, "dense")
        results = _fire(client, "dense", requests)
        after = _stats(client, "dense")
    assert isinstance(results[5], InferenceServerException)
    assert "input 'history_embeddings'" in results[5].message()
    assert all(not isinstance(r, Exception) for i, r in enumerate(results) if i != 5)
    assert after[1] - before[1] < len(requests), "requests were not batched together"


# Echoed values are bounded: a huge value or input name costs the client a short message, never its size.

_HUGE = 1 << 20  # a 1 MB value
_SMALL_ERROR = 2048  # the most bytes an error may take


def _json_infer_body(good, replace=None) -> bytes:
    """The HTTP JSON form of ``good``; ``replace(name, flat data)`` edits an input's data in place."""
    import json

    inputs = []
    for name, array in good.items():
        data = (
            [x.decode() for x in array.reshape(-1)] if array.dtype == object else array.reshape(-1).tolist()
        )
        if replace is not None:
            replace(name, data)
        inputs.append(
            {
                "name": name,
                "datatype": np_to_triton_dtype(array.dtype),
                "shape": list(array.shape),
                "data": data,
            }
        )
    return json.dumps({"inputs": inputs}).encode()


def _with_huge_categorical(spec, good):
    bad = {k: v.copy() for k, v in good.items()}
    bad[spec.categorical.name][0, 3] = b"z" * _HUGE
    return bad


def test_a_1mb_value_over_http_gets_a_small_400_naming_the_input(server, spec):
    good = generate(spec, 3, seed=90).to_wire(spec)
    c = spec.categorical.name

    def huge(name, data):
        if name == c:
            data[3] = "z" * _HUGE

    status, text = _post(server, _json_infer_body(good, huge), {"Content-Type": "application/json"})
    assert status == 400, f"{status} {text[:300]}"
    assert len(text.encode()) < _SMALL_ERROR, f"a {len(text.encode())}-byte error body: {text[:300]}"
    _assert_clear("1 MB value over HTTP", text, f"input '{c}'")
    assert f"({_HUGE} " in text, f"the value's length is not stated: {text}"
    with http_client(server) as client:
        infer_raw(httpclient, client, spec, good)


def test_a_1mb_value_over_grpc_is_invalid_argument_with_a_bounded_message(server, spec):
    good = generate(spec, 3, seed=91).to_wire(spec)
    c = spec.categorical.name
    stubs = server.stubs()
    with grpc_client(server) as client:
        with pytest.raises(InferenceServerException) as err:
            infer_raw(grpcclient, client, spec, _with_huge_categorical(spec, good))
        assert str(err.value.status()) == "StatusCode.INVALID_ARGUMENT", str(err.value)[:300]
        assert len(err.value.message().encode()) < _SMALL_ERROR, err.value.message()[:300]
        _assert_clear("1 MB value over gRPC", err.value.message(), f"input '{c}'")
        assert infer_raw(grpcclient, client, spec, good).shape == (3,)
    _stubs_unchanged(server, stubs)
