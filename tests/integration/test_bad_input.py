"""Bad requests get a clear error naming the input; the server keeps serving."""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from recserve.build.synthetic import generate

from .helpers import grpc_client, http_client, infer_inputs, infer_raw


def _cases(spec):
    d, dm, c, t, h, hl = (x.name for x in spec.wire_inputs())

    def nan(w):
        w[d][1, 4], w[dm][1, 4] = np.nan, False

    def too_long(w):
        w[h] = np.ones((len(w[h]), 300), np.int64)
        w[hl][:] = 300

    def big_batch(w):
        for k in list(w):
            w[k] = np.repeat(w[k][:1], spec.max_batch_size + 1, axis=0)

    return {
        "wrong dtype": (lambda w: w.__setitem__(d, w[d].astype(np.float64)), d),
        "wrong shape": (lambda w: w.__setitem__(d, w[d][:, :12].copy()), d),
        "missing input": (lambda w: w.pop(c), c),
        "NaN in a dense value": (nan, d),
        "sequence longer than the maximum": (too_long, hl),
        "batch above max_batch_size": (big_batch, str(spec.max_batch_size)),
        "non-hex categorical": (lambda w: w[c].__setitem__((0, 3), b"not-hex"), c),
        "negative history id": (lambda w: w[hl].fill(1) or w[h].fill(-5), h),
    }


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_each_bad_request_names_its_input_and_the_next_one_succeeds(server, spec, protocol):
    module, make = (grpcclient, grpc_client) if protocol == "grpc" else (httpclient, http_client)
    good = generate(spec, 3, seed=77).to_wire(spec)
    with make(server) as client:
        expected = infer_raw(module, client, spec, good)
        for label, (corrupt, named) in _cases(spec).items():
            bad = {k: v.copy() for k, v in good.items()}
            corrupt(bad)
            with pytest.raises(InferenceServerException) as err:
                infer_raw(module, client, spec, bad)
            message = err.value.message()
            assert named in message, f"{label}: {message}"
            assert "/" not in message.replace("n/a", ""), f"{label} leaks a path: {message}"
            assert "Traceback" not in message
            np.testing.assert_array_equal(infer_raw(module, client, spec, good), expected)


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
        before = _stats(client, "feature_transform")
        results = _fire(client, spec.name, requests)
        after = _stats(client, "feature_transform")
        for i, result in enumerate(results):
            if i == bad:
                assert isinstance(result, InferenceServerException)
                assert "input 'dense'" in result.message() and "nan" in result.message()
            else:
                assert not isinstance(result, Exception), result
                np.testing.assert_allclose(
                    result.as_numpy("probability").reshape(-1), infer_raw(grpcclient, client, spec, requests[i]), atol=1e-6
                )
    rows, executions = after[0] - before[0], after[1] - before[1]
    assert rows == 2 * 32 and executions < 32, "requests were not batched together"


def test_a_bad_request_fails_alone_inside_a_merged_batch(server, spec):
    """Direct calls to the dense step: its requests are merged into one ONNX Runtime call."""
    rng = np.random.default_rng(0)
    dim = spec.embedding_dim

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
