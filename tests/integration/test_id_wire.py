"""Both wire forms through a real tritonserver: the same scores bit for bit, rows and candidate lists.

``ctr`` on the session's server; ``tiny``, ``avazu`` (strings, a time column, no numeric feature, no
sequence) and ``taobao`` (a multi-hot list, a unix time, two behaviours, a profile) each built and
served here. The rows carry empty values, values no table holds and awkward text in every column.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from recserve.build.repository import build_repository
from recserve.clients import CTRClient, InvalidRequestError
from recserve.core.names import BYTES_WIRE, IDS_WIRE
from recserve.core.spec.parse import load_spec
from recserve.server import Ports, TritonServer
from tests.wire_rows import edge_rows

from .helpers import grpc_client, infer_raw


@pytest.fixture(scope="module", params=("ctr", "tiny", "avazu", "taobao"))
def served(request, tmp_path_factory):
    """A spec and the server serving it (``ctr``: the session's)."""
    spec = load_spec(request.param)
    if spec.name == "ctr":
        yield spec, request.getfixturevalue("server")
        return
    path = tmp_path_factory.mktemp(spec.name) / "repository"
    build_repository(spec, path)
    log = tmp_path_factory.mktemp(f"{spec.name}_server") / "server.log"
    with TritonServer(path, Ports.free(), log_path=log) as running:
        yield spec, running


def test_both_forms_score_rows_bit_for_bit_alike(served):
    spec, server = served
    rows = edge_rows(spec, count=48)
    scores = {}
    for wire in (IDS_WIRE, BYTES_WIRE):
        with CTRClient(server.grpc_url, spec=spec, wire=wire) as client:
            scores[wire] = client.score_inputs(rows.to_inputs(spec))
    np.testing.assert_array_equal(scores[IDS_WIRE].probabilities, scores[BYTES_WIRE].probabilities)
    np.testing.assert_array_equal(scores[IDS_WIRE].embedding_version, scores[BYTES_WIRE].embedding_version)
    assert np.isfinite(scores[IDS_WIRE].probabilities).all()


def test_both_forms_score_candidate_lists_bit_for_bit_alike(served):
    spec, server = served
    if spec.candidates_model is None:
        pytest.skip("a spec without sequences has no candidate lists")
    rows = edge_rows(spec, count=20)
    user = rows.user_of(spec, 0)
    scores = {}
    for wire in (IDS_WIRE, BYTES_WIRE):
        with CTRClient(server.grpc_url, spec=spec, wire=wire) as client:
            scores[wire] = client.score_candidates(user, rows)
    np.testing.assert_array_equal(scores[IDS_WIRE], scores[BYTES_WIRE])
    assert scores[IDS_WIRE].shape == (20,)


def test_a_request_with_both_forms_or_neither_fails_alone_naming_the_input(served):
    spec, server = served
    rows = edge_rows(spec, count=8)
    both = {**rows.to_wire(spec, BYTES_WIRE), **rows.to_wire(spec, IDS_WIRE)}
    neither = {n: a for n, a in both.items() if not n.startswith(spec.categorical.name)}
    client = grpc_client(server)
    for inputs, name, how in ((both, "categorical__ids", "both"), (neither, "categorical", "neither")):
        # avazu's requests hold only categorical values: without them Triton refuses the empty request
        expected = f"input '{name}'.*this one carries {how}" if inputs else "request has 0 inputs"
        with pytest.raises(Exception, match=expected) as error:
            infer_raw(grpcclient, client, spec, inputs)
        assert "INVALID_ARG" in str(error.value)
    with CTRClient(server.grpc_url, spec=spec) as sdk, pytest.raises(InvalidRequestError, match="both"):
        sdk.predict_inputs(both)
