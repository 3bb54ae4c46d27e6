"""Raw tritonclient requests, so that tests can also send what the SDK would refuse to build."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from recserve.spec import ModelSpec


def _dtype(array: np.ndarray) -> str:
    return {"f": "FP32" if array.dtype == np.float32 else "FP64", "b": "BOOL", "O": "BYTES", "S": "BYTES"}.get(
        array.dtype.kind, {np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32"}.get(array.dtype, "INT8")
    )


def infer_raw(module, client, spec: ModelSpec, inputs: dict[str, np.ndarray], **kwargs) -> np.ndarray:
    """Send ``inputs`` as they are (names, dtypes and shapes unchecked) and return ``probability``."""
    tensors = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), _dtype(array))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = client.infer(spec.name, tensors, **kwargs)
    return result.as_numpy("probability").reshape(-1)


def grpc_client(server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def http_client(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, connection_timeout=30, network_timeout=30)
