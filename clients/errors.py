"""Client errors: one hierarchy for what tritonclient, sockets and aiohttp raise.

:func:`map_exception` turns a low-level exception into one of four kinds a caller can act on:

* :class:`InvalidRequestError`: the request is wrong (HTTP 400, gRPC ``INVALID_ARGUMENT``); retrying
  the same request will fail again. The server's message is kept.
* :class:`ServerUnavailableError`: nothing answered (connection refused, HTTP 502/503, gRPC
  ``UNAVAILABLE``); retry later or elsewhere.
* :class:`RequestTimeoutError`: no answer in time (client timeout, HTTP 408/504, gRPC
  ``DEADLINE_EXCEEDED``).
* :class:`ServerError`: anything else.
"""

from __future__ import annotations

import asyncio
import logging

from tritonclient.utils import InferenceServerException

LOGGER = logging.getLogger(__name__)

_GRPC_PREFIX = "STATUSCODE."

_INVALID = {"INVALID_ARGUMENT", "400"}
_UNAVAILABLE = {"UNAVAILABLE", "502", "503"}
_TIMEOUT = {"DEADLINE_EXCEEDED", "408", "504"}

_TIMEOUT_TEXT = ("deadline exceeded", "timed out", "timeout")
_UNAVAILABLE_TEXT = ("connection refused", "failed to connect", "connect failed", "unavailable")


class RecserveClientError(Exception):
    """Base of every error raised by the recserve client.

    Attributes:
        status: the status reported by the transport (``"StatusCode.INVALID_ARGUMENT"``, ``"400"``),
            or None when there was none (e.g. a refused connection).
    """

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def message(self) -> str:
        """The error message (for :class:`InvalidRequestError`, the server's own words)."""
        return str(self.args[0]) if self.args else ""


class InvalidRequestError(RecserveClientError):
    """The server (or a local check) rejected the request as malformed; do not retry it as is."""


class ServerUnavailableError(RecserveClientError):
    """The server could not be reached or is not serving (refused, unavailable, 502/503)."""


class RequestTimeoutError(RecserveClientError):
    """The request did not complete within the deadline."""


class ServerError(RecserveClientError):
    """Any other failure reported by the server or the transport."""


def _status_kind(status: str) -> type[RecserveClientError] | None:
    code = status.strip().upper()
    if code.startswith(_GRPC_PREFIX):
        code = code[len(_GRPC_PREFIX) :]
    if code in _INVALID:
        return InvalidRequestError
    if code in _UNAVAILABLE:
        return ServerUnavailableError
    if code in _TIMEOUT:
        return RequestTimeoutError
    return None


def _text_kind(text: str) -> type[RecserveClientError] | None:
    lowered = text.lower()
    if any(marker in lowered for marker in _TIMEOUT_TEXT):
        return RequestTimeoutError
    if any(marker in lowered for marker in _UNAVAILABLE_TEXT):
        return ServerUnavailableError
    return None


def _is_aiohttp_connection_error(exc: BaseException) -> bool:
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiohttp comes with tritonclient[http]
        return False
    return isinstance(exc, aiohttp.ClientConnectionError)


def map_exception(exc: BaseException) -> RecserveClientError:
    """Map a transport exception to the client error hierarchy.

    The returned error is not raised; callers do ``raise map_exception(exc) from exc``.

    Args:
        exc: what tritonclient (``InferenceServerException``), the socket layer (``OSError``,
            ``ConnectionRefusedError``, ``TimeoutError``) or aiohttp raised.

    Returns:
        The matching :class:`RecserveClientError`; ``exc`` itself if it already is one.
    """
    if isinstance(exc, RecserveClientError):
        return exc
    if isinstance(exc, InferenceServerException):
        status = exc.status()
        message = exc.message() or str(exc)
        kind = _status_kind(str(status)) if status is not None else None
        if kind is None:
            kind = _text_kind(message) or ServerError
        return kind(message, status=None if status is None else str(status))
    message = str(exc) or type(exc).__name__
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return RequestTimeoutError(message)
    if isinstance(exc, (ConnectionError, OSError)) or _is_aiohttp_connection_error(exc):
        kind = _text_kind(message) if not isinstance(exc, ConnectionError) else None
        return (kind if kind is RequestTimeoutError else ServerUnavailableError)(message)
    return (_text_kind(message) or ServerError)(message)


__all__ = [
    "InvalidRequestError",
    "RecserveClientError",
    "RequestTimeoutError",
    "ServerError",
    "ServerUnavailableError",
    "map_exception",
]
