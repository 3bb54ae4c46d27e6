import asyncio
import socket
import time

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from recserve.build.synthetic import generate
from recserve.clients import (
    AsyncCTRClient,
    CTRClient,
    InvalidRequestError,
    RecserveClientError,
    RequestTimeoutError,
    Rows,
    ServerError,
    ServerUnavailableError,
    map_exception,
)


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        ("StatusCode.INVALID_ARGUMENT", "input 'dense': has dtype float64", InvalidRequestError),
        ("StatusCode.UNAVAILABLE", "failed to connect to all addresses", ServerUnavailableError),
        ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", RequestTimeoutError),
        ("StatusCode.INTERNAL", "boom", ServerError),
        ("StatusCode.NOT_FOUND", "Request for unknown model: 'x' is not found", ServerError),
        ("400", "input 'target_item': row 0 is -3", InvalidRequestError),
        ("503", "Server not ready", ServerUnavailableError),
        ("502", "bad gateway", ServerUnavailableError),
        ("504", "gateway timeout", RequestTimeoutError),
        ("500", "internal", ServerError),
        (None, "Deadline Exceeded", RequestTimeoutError),
        (None, "the request timed out", RequestTimeoutError),
        (None, "something odd", ServerError),
    ],
)
def test_map_inference_server_exception(status, message, kind):
    error = map_exception(InferenceServerException(message, status))
    assert type(error) is kind
    assert isinstance(error, RecserveClientError)
    assert error.message == message and str(error) == message
    assert error.status == status


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ConnectionRefusedError(111, "Connection refused"), ServerUnavailableError),
        (ConnectionResetError(104, "Connection reset by peer"), ServerUnavailableError),
        (OSError(113, "No route to host"), ServerUnavailableError),
        (TimeoutError("timed out"), RequestTimeoutError),
        (TimeoutError(), RequestTimeoutError),
        (asyncio.TimeoutError(), RequestTimeoutError),
        (RuntimeError("weird"), ServerError),
    ],
)
def test_map_os_level_errors(exc, kind):
    assert type(map_exception(exc)) is kind


def test_map_keeps_client_errors():
    error = InvalidRequestError("bad")
    assert map_exception(error) is error


def _inputs(spec, rows=3):
    return generate(spec, rows, seed=0).to_wire(spec)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_connection_refused_is_unavailable(spec, protocol):
    url = f"127.0.0.1:{_closed_port()}"
    if protocol == "http":
        url = "http://" + url
    started = time.monotonic()
    with CTRClient(url, protocol=protocol, timeout_s=2, spec=spec) as client:
        with pytest.raises(ServerUnavailableError) as info:
            client.predict_inputs(_inputs(spec))
        assert not client.is_ready()
    assert time.monotonic() - started < 5
    assert info.value.__cause__ is not None


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_async_connection_refused_is_unavailable(spec, protocol):
    url = f"127.0.0.1:{_closed_port()}"

    async def run() -> None:
        async with AsyncCTRClient(url, protocol=protocol, timeout_s=2, spec=spec) as client:
            with pytest.raises(ServerUnavailableError):
                await client.predict_inputs(_inputs(spec))
            assert not await client.is_ready()

    started = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - started < 5


def test_local_checks_raise_invalid_request(spec):
    client = CTRClient(f"127.0.0.1:{_closed_port()}", timeout_s=2, spec=spec)
    inputs = _inputs(spec)
    with pytest.raises(InvalidRequestError, match="missing"):
        client.predict_inputs({k: v for k, v in inputs.items() if k != spec.target.name})
    with pytest.raises(InvalidRequestError, match="unknown"):
        client.predict_inputs({**inputs, "extra": np.zeros((3, 1))})
    with pytest.raises(InvalidRequestError, match="batch size"):
        client.predict_inputs({**inputs, spec.target.name: np.zeros((2, 1), dtype=np.int64)})
    with pytest.raises(ValueError):
        client.predict(Rows(*(np.zeros((0, 1)),) * 6), batch_size=spec.model.max_batch_size + 1)
    client.close()


def test_predict_with_no_rows_does_not_contact_the_server(spec):
    empty = Rows(
        dense=np.zeros((0, 13), np.float32),
        dense_missing=np.zeros((0, 13), bool),
        categorical=np.zeros((0, 26), object),
        target=np.zeros(0, np.int64),
        history=np.zeros((0, 1), np.int64),
        lengths=np.zeros(0, np.int32),
    )
    with CTRClient(f"127.0.0.1:{_closed_port()}", protocol="http", timeout_s=2, spec=spec) as client:
        out = client.predict(empty)
    assert out.dtype == np.float32 and out.shape == (0,)


def test_constructor_arguments(spec):
    with pytest.raises(ValueError, match="protocol"):
        CTRClient(protocol="thrift", spec=spec)
    with CTRClient(protocol="http", spec=spec) as client:
        assert client.url == "127.0.0.1:8000" and client.model_name == spec.name
    with CTRClient(spec=spec, model_name="other") as client:
        assert client.url == "127.0.0.1:8001" and client.model_name == "other"


def test_local_refusals_name_huge_values_shortened(spec):
    client = CTRClient(f"127.0.0.1:{_closed_port()}", timeout_s=2, spec=spec)
    inputs = _inputs(spec)
    many = {f"extra_{'x' * 10_000}_{i}": np.zeros((3, 1)) for i in range(100)}
    with pytest.raises(InvalidRequestError, match=r"unknown inputs \['extra_xxx.*and 95 more\]") as err:
        client.predict_inputs({**inputs, **many})
    assert len(str(err.value)) < 1000
    with pytest.raises(ValueError, match=r"user_id .*\(100000 chars\)") as err:
        CTRClient(spec=spec, user_id="u" * 99_999 + "\n")
    assert len(str(err.value)) < 200
    client.close()


def test_the_limit_is_the_specs_while_the_server_cannot_tell_and_may_be_set(spec):
    with CTRClient(f"127.0.0.1:{_closed_port()}", timeout_s=2, spec=spec) as client:
        assert client.max_batch_size == spec.model.max_batch_size  # unreachable: the spec's, for now
        assert client._limit is None  # the server is asked again at the next use
        client.max_batch_size = 32
        assert client.max_batch_size == 32
        with pytest.raises(ValueError, match="at least 1"):
            client.max_batch_size = 0
