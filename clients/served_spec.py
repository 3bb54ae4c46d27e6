"""The spec a server serves, read from a model's config (its ``spec`` parameter).

``recserve predict`` and ``perf`` against a server, and an SDK client made without a spec, need no
spec file: every step's and every ensemble's config carries the spec the repository was built or
imported with, and the server reports it. Through the access layer only the ensembles are public,
so a client there names its model.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from recserve.clients.base import DEFAULT_URLS
from recserve.clients.errors import RecserveClientError, ServerError, map_exception
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import spec_from_json

LOGGER = logging.getLogger(__name__)


def _config(url: str | None, protocol: str, timeout_s: float, model: str) -> dict[str, Any]:
    """``model``'s config as JSON, over gRPC or HTTP."""
    address = (url or DEFAULT_URLS[protocol]).strip().rstrip("/")
    scheme, separator, rest = address.partition("://")
    ssl = bool(separator) and scheme.lower() in ("https", "grpcs")
    address = rest if separator else address
    if protocol == "grpc":
        import tritonclient.grpc as grpc

        with grpc.InferenceServerClient(address, ssl=ssl) as client:
            reply = client.get_model_config(model, as_json=True, client_timeout=timeout_s)
            return dict(reply.get("config", {}))
    import tritonclient.http as http

    with http.InferenceServerClient(
        address, ssl=ssl, connection_timeout=timeout_s, network_timeout=timeout_s
    ) as client:
        return dict(client.get_model_config(model))


def served_spec(
    url: str | None = None, protocol: str = "grpc", timeout_s: float = 10.0, model: str | None = None
) -> ModelSpec:
    """The spec the server at ``url`` serves, from ``model``'s config (None: ``embedding_lookup``'s).

    Raises:
        RecserveClientError: the server cannot be reached, or serves no recserve model (a
            :class:`~recserve.clients.errors.ServerError` naming what is missing).
    """
    model = model or EMBEDDING_LOOKUP
    try:
        config = _config(url, protocol, timeout_s, model)
    except Exception as exc:  # tritonclient raises its own exception types
        raise map_exception(exc) from exc
    text = config.get("parameters", {}).get("spec", {}).get("string_value")
    if not text:
        raise ServerError(f"the server's {model} model carries no spec; pass the spec it serves")
    try:
        return spec_from_json(text)
    except (ValueError, json.JSONDecodeError) as exc:
        raise ServerError(f"the served spec cannot be read: {exc}") from None


def served_limit(
    url: str | None, protocol: str, timeout_s: float, model: str, given: ModelSpec | None
) -> int | None:
    """The most rows one request to ``model`` may carry: its served spec's ``max_batch_size``.

    0 where the served model carries no spec (the client keeps its own spec's limit); None where the
    client was given no spec (the spec it reads is the served one) or the server cannot be reached
    now (asked again at the next use).
    """
    if given is None:
        return None
    try:
        return served_spec(url, protocol, timeout_s, model).model.max_batch_size
    except ServerError as exc:  # a model without a spec: the given spec's limit
        LOGGER.warning("the server's limits are unknown (%s); using the spec's max_batch_size", exc)
        return 0
    except RecserveClientError as exc:  # unreachable now: the request itself will say so
        LOGGER.debug("the server's limits cannot be read now: %s", exc)
        return None
