"""The spec a server serves, read from its ``embedding_lookup`` config (its ``spec`` parameter).

``recserve predict`` and ``perf`` against a server need no ``--spec``: every step's config carries
the spec the repository was built or imported with, and the server reports it.
"""

from __future__ import annotations

import json
from typing import Any

from recserve.clients.base import DEFAULT_URLS
from recserve.clients.errors import ServerError, map_exception
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec import ModelSpec
from recserve.core.spec_parse import spec_from_json


def _config(url: str | None, protocol: str, timeout_s: float) -> dict[str, Any]:
    """The ``embedding_lookup`` model config as JSON, over gRPC or HTTP."""
    address = (url or DEFAULT_URLS[protocol]).strip().rstrip("/")
    scheme, separator, rest = address.partition("://")
    ssl = bool(separator) and scheme.lower() in ("https", "grpcs")
    address = rest if separator else address
    if protocol == "grpc":
        import tritonclient.grpc as grpc

        with grpc.InferenceServerClient(address, ssl=ssl) as client:
            reply = client.get_model_config(EMBEDDING_LOOKUP, as_json=True, client_timeout=timeout_s)
            return dict(reply.get("config", {}))
    import tritonclient.http as http

    with http.InferenceServerClient(
        address, ssl=ssl, connection_timeout=timeout_s, network_timeout=timeout_s
    ) as client:
        return dict(client.get_model_config(EMBEDDING_LOOKUP))


def served_spec(url: str | None = None, protocol: str = "grpc", timeout_s: float = 10.0) -> ModelSpec:
    """The spec the server at ``url`` serves.

    Raises:
        RecserveClientError: the server cannot be reached, or serves no recserve model (a
            :class:`~recserve.clients.errors.ServerError` naming what is missing).
    """
    try:
        config = _config(url, protocol, timeout_s)
    except Exception as exc:  # tritonclient raises its own exception types
        raise map_exception(exc) from exc
    text = config.get("parameters", {}).get("spec", {}).get("string_value")
    if not text:
        raise ServerError(
            f"the server's {EMBEDDING_LOOKUP} model carries no spec; pass --spec (the spec it serves)"
        )
    try:
        return spec_from_json(text)
    except (ValueError, json.JSONDecodeError) as exc:
        raise ServerError(f"the served spec cannot be read: {exc}") from None
