"""Served probabilities equal the in-process PyTorch model on the same raw rows."""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate

from .helpers import grpc_client, http_client, infer_raw


@pytest.fixture(scope="module")
def reference(spec, repository):
    return reference_pipeline(spec, repository, runtime="torch")


def rows_with_length(spec, batch, length, seed):
    rows = generate(spec, batch, seed)
    rows.lengths[:] = length
    rows.history[:, :length] = np.random.default_rng(seed).integers(
        0, 60000, size=(batch, length)
    )  # some unknown ids too
    return rows.to_wire(spec)


@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("length", [0, 1, 255])
def test_served_equals_pytorch_reference(server, spec, reference, batch, length):
    wire = rows_with_length(spec, batch, length, seed=batch * 1000 + length)
    expected = reference.predict(wire)
    with grpc_client(server) as client:
        served = infer_raw(grpcclient, client, spec, wire)
    assert served.shape == (batch,)
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-5)


def test_http_and_grpc_agree(server, spec):
    wire = generate(spec, 33, seed=5).to_wire(spec)
    with grpc_client(server) as g, http_client(server) as h:
        a = infer_raw(grpcclient, g, spec, wire)
        b = infer_raw(httpclient, h, spec, wire)
    np.testing.assert_array_equal(a, b)
    assert ((a > 0) & (a < 1)).all()
