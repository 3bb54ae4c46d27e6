"""The bench's naive peer: one Python-backend model serving the whole path, as the ensemble does."""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from recserve.build.synthetic import generate
from recserve.clients import CTRClient
from recserve.perf.peers.monolith import write_monolith_repository
from recserve.server import Ports, TritonServer

from .helpers import grpc_client, infer_raw


@pytest.fixture(scope="module")
def monolith(spec, repository, tmp_path_factory):
    work = tmp_path_factory.mktemp("monolith")
    target = write_monolith_repository(spec, repository, work / "repository", instances=1)
    with TritonServer(target, Ports.free(), log_path=work / "server.log") as started:
        yield started


def test_monolith_scores_what_the_ensemble_scores(spec, server, monolith):
    with CTRClient(server.grpc_url, spec=spec) as ensemble, CTRClient(monolith.grpc_url, spec=spec) as peer:
        for rows, seed in ((1, 1), (37, 2), (256, 3)):
            inputs = generate(spec, rows, seed).to_wire(spec)
            np.testing.assert_allclose(
                peer.predict_inputs(inputs), ensemble.predict_inputs(inputs), atol=1e-6
            )


def test_a_bad_request_fails_alone_naming_the_input(spec, monolith):
    inputs = generate(spec, 4, 5).to_wire(spec)
    name = spec.dense.name
    inputs[name] = inputs[name].copy()
    inputs[name][1, 4], inputs[spec.dense_missing_input][1, 4] = np.nan, False
    with grpc_client(monolith) as client:
        with pytest.raises(InferenceServerException, match=name):
            infer_raw(grpcclient, client, spec, inputs)
        assert infer_raw(grpcclient, client, spec, generate(spec, 4, 6).to_wire(spec)).shape == (4,)
