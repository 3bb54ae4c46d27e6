"""Raw tritonclient requests, so that tests can also send what the SDK would refuse to build."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from recserve.spec import ModelSpec


def infer_inputs(module, inputs: dict[str, np.ndarray]) -> list:
    """``InferInput`` objects carrying the arrays as they are (names, dtypes and shapes unchecked)."""
    tensors = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def infer_raw(module, client, spec: ModelSpec, inputs: dict[str, np.ndarray], **kwargs) -> np.ndarray:
    """Send ``inputs`` as they are and return ``probability``."""
    result = client.infer(spec.name, infer_inputs(module, inputs), **kwargs)
    return result.as_numpy("probability").reshape(-1)


def grpc_client(server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def http_client(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, connection_timeout=30, network_timeout=30)
