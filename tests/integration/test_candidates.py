"""One user's candidate list per request, served by the candidates ensemble of the live server."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from recserve.build.synthetic import generate
from recserve.clients import AsyncCTRClient, CTRClient, InvalidRequestError, read_rows
from recserve.clients.writers import write_tsv
from recserve.core.names import DENSE_VERSION, EMBEDDING_LOOKUP, EMBEDDING_VERSION, IDS_WIRE, PROBABILITY
from tests.integration.helpers import run_perf


@pytest.fixture(scope="module")
def candidates(spec, tmp_path_factory):
    raw = generate(spec, 300, seed=77)
    return read_rows(write_tsv(tmp_path_factory.mktemp("candidates") / "rows.tsv", raw, spec), spec)


def user_of(rows, row=3):
    """The sequences of one row, as the user's context."""
    return {"history_items": rows.history[row, : rows.lengths[row]].tolist()}


def as_rows(spec, user, rows):
    """The row layout of a candidate list: every row carries the user's sequences."""
    inputs = rows.to_inputs(spec)
    (name,) = user
    items = np.asarray(user[name], np.int64)
    inputs[name] = np.tile(items if items.size else np.zeros(1, np.int64), (len(rows), 1))
    inputs[spec.sequence_length_input] = np.full((len(rows), 1), items.size, np.int32)
    return inputs


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_candidate_list_scores_as_its_rows_in_order(server, spec, candidates, protocol):
    user = user_of(candidates)
    assert len(user["history_items"]) > 0
    first = candidates.take(slice(0, 40))
    url = server.grpc_url if protocol == "grpc" else server.http_url
    with CTRClient(url, protocol=protocol, timeout_s=30, spec=spec) as client:
        expected = client.predict_inputs(as_rows(spec, user, first))
        served = client.score_candidates(user, first)
        # more candidates than max_batch_size: several requests, one order
        many = client.score_candidates(user, candidates)
        row_layout = np.concatenate(
            [client.predict_inputs(as_rows(spec, user, part)) for part in candidates.batches(100)]
        )
        empty_history = client.score_candidates({"history_items": []}, first)
        expected_empty = client.predict_inputs(as_rows(spec, {"history_items": []}, first))

    async def run_async():
        async with AsyncCTRClient(url, protocol=protocol, timeout_s=30, spec=spec) as client:
            return await client.score_candidates(user, first)

    np.testing.assert_allclose(served, expected, atol=1e-6)
    np.testing.assert_allclose(many, row_layout, atol=1e-6)
    np.testing.assert_allclose(empty_history, expected_empty, atol=1e-6)
    np.testing.assert_array_equal(asyncio.run(run_async()), served)
    assert len(many) == len(candidates) > spec.model.max_batch_size


def test_a_bad_candidate_list_fails_alone_naming_the_input(server, spec, candidates):
    user, rows = user_of(candidates), candidates.take(slice(0, 6))
    with CTRClient(server.grpc_url, timeout_s=30, spec=spec) as client:
        with pytest.raises(InvalidRequestError, match="input 'history_items'.*position 1 is -5"):
            client.score_candidates({"history_items": [4, -5, 6]}, rows)
        with pytest.raises(InvalidRequestError, match="unknown user inputs \\['clicks'\\]"):
            client.score_candidates({"clicks": [1]}, rows)
        good = client.score_candidates(user, rows)

        good_request = next(client._candidate_requests(user, rows))
    target = spec.targets[0].name
    bad_request = dict(good_request, **{target: good_request[target][:, :5]})  # 5 targets, 6 candidates

    def send(bad):
        inputs = []
        for tensor in spec.wire_form(IDS_WIRE).inputs:  # the form the client sends by default
            array = (bad_request if bad else good_request).get(tensor.name)
            if array is None:  # an optional tensor the request leaves out
                continue
            inputs.append(grpcclient.InferInput(tensor.name, list(array.shape), tensor.dtype))
            inputs[-1].set_data_from_numpy(array)
        with grpcclient.InferenceServerClient(server.grpc_url) as raw_client:
            try:
                return raw_client.infer(spec.candidates_model, inputs).as_numpy(PROBABILITY).reshape(-1)
            except Exception as exc:  # the refusal, checked below
                return str(exc)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, [i % 4 == 0 for i in range(16)]))
    for i, result in enumerate(results):
        if i % 4 == 0:
            assert isinstance(result, str) and "target_item" in result and "1 users x 5 candidates" in result
        else:
            np.testing.assert_allclose(result, good, atol=1e-6)


def test_concurrent_candidate_lists_share_executions(server, spec, candidates):
    user, rows = user_of(candidates), candidates.take(slice(0, 50))
    with grpcclient.InferenceServerClient(server.grpc_url) as stats_client:

        def executions():
            (stats,) = stats_client.get_inference_statistics(EMBEDDING_LOOKUP).model_stats
            return stats.execution_count, stats.inference_count

        before = executions()

        def many(_):
            with CTRClient(server.grpc_url, timeout_s=30, spec=spec) as client:
                return [client.score_candidates(user, rows) for _ in range(10)]

        with ThreadPoolExecutor(8) as pool:
            results = [r for batch in pool.map(many, range(8)) for r in batch]
        after = executions()
    assert all(np.array_equal(r, results[0]) for r in results)
    requests = after[1] - before[1]
    assert requests == 80  # one lookup request per candidate list
    assert after[0] - before[0] < requests  # the dynamic batcher handed over several lists at once


def test_perf_sends_candidate_lists_to_the_candidates_ensemble(server, spec, tmp_path):
    out = tmp_path / "perf.csv"
    with grpcclient.InferenceServerClient(server.grpc_url) as client:

        def lists():
            (stats,) = client.get_inference_statistics(spec.candidates_model).model_stats
            return stats.inference_count

        before = lists()
        done = run_perf(server.grpc_url, out, "--candidates", "40", "--concurrency", "1:1")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert lists() - before >= 3  # perf_analyzer's requests were candidate lists
    assert f"{spec.candidates_model} over grpc, one user's 40 candidates per request" in done.stdout
    (point,) = out.read_text().splitlines()[1:]
    assert float(point.split(",")[2]) > 0


def test_the_client_reads_the_served_limit_and_sends_a_longer_lists_parts_together(server, spec, candidates):
    """A client made with a spec still asks the server for its limit; a list over it goes in parts at once."""
    smaller = dataclasses.replace(spec, model=dataclasses.replace(spec.model, max_batch_size=64))
    user, rows = user_of(candidates), candidates.take(slice(0, 200))
    with CTRClient(server.grpc_url, timeout_s=30, spec=smaller) as client:
        assert client.max_batch_size == spec.model.max_batch_size == 256  # the server's, not the file's 64
        whole = client.score_candidates(user, rows, request_id="whole")
        assert client.last_request_ids == ["whole"]  # 200 candidates: one request, no split
        client.max_batch_size = 90
        parts = client.score_candidates(user, rows, request_id="parts")
        assert client.last_request_ids == ["parts.0", "parts.1", "parts.2"]  # in the order of the parts
    with CTRClient(server.http_url, protocol="http", timeout_s=30, spec=smaller) as client:
        client.max_batch_size = 60  # over HTTP each part goes on its worker thread's own transport
        np.testing.assert_allclose(client.score_candidates(user, rows), whole, atol=1e-6)
        assert len(client.last_request_ids) == 4

    async def run_async():
        async with AsyncCTRClient(server.http_url, protocol="http", timeout_s=30, spec=smaller) as client:
            assert client.max_batch_size == 256
            client.max_batch_size = 50
            got = await client.score_candidates(user, rows, request_id="async")
            return got, client.last_request_ids

    together, ids = asyncio.run(run_async())
    assert ids == [f"async.{k}" for k in range(4)]
    np.testing.assert_allclose(parts, whole, atol=1e-6)
    np.testing.assert_allclose(together, whole, atol=1e-6)


def test_a_list_answers_its_versions_once_not_per_candidate(server, spec, candidates):
    """Lists looked up and scored together still get one row of versions each, the rows' own."""
    user, rows = user_of(candidates), candidates.take(slice(0, 120))
    names = (PROBABILITY, DENSE_VERSION, EMBEDDING_VERSION)
    with CTRClient(server.grpc_url, timeout_s=30, spec=spec) as client:
        (arrays,) = client._candidate_requests(user, rows)
        served_rows = client.score_inputs(rows.take(slice(0, 3)).to_inputs(spec))

        def send(_):
            with grpcclient.InferenceServerClient(server.grpc_url) as raw:
                result = raw.infer(
                    spec.candidates_model,
                    client._infer_inputs(grpcclient, arrays),
                    outputs=[grpcclient.InferRequestedOutput(name) for name in names],
                )
            return [result.as_numpy(name) for name in names]

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(send, range(8)))
    for probability, dense, embedding in answers:
        assert probability.shape == (120, 1)
        assert dense.shape == (1, 1) and embedding.shape == (1, len(spec.table_names))
        assert dense[0, 0] == served_rows.dense_version
        np.testing.assert_array_equal(embedding[0], served_rows.embedding_version)
