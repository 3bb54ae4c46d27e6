"""Domain errors raised while handling one request, and the truncation every echoed value goes through.

Each error carries the Triton error code it maps to; the mapping to ``pb_utils.TritonError`` lives in
:mod:`recserve.backends.triton.adapter` alone. A message never echoes a whole request value: values pass
through :func:`shorten` (and lists of them through :func:`shorten_all`), so a 1 MB string costs a
client a message of about a hundred characters, never a megabyte.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: The longest error message sent back to a client, in characters; the adapter cuts anything longer.
MESSAGE_LIMIT = 1024

# One unit of a repr body: an escape sequence (kept whole) or one plain character.
_REPR_UNIT = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)|.", re.DOTALL)


def shorten(value: object, limit: int = 64) -> str:
    r"""Return a repr-like text of ``value`` at most about ``limit`` characters long.

    Strings and bytes keep their quotes; when cut they end with ``…`` and their full length, e.g.
    ``'aaaa…' (1048576 chars)`` or ``b'\x00\x01…' (70000 bytes)``. Escape sequences are never split,
    and newlines or control characters are escaped, so the text is safe on one log line. Other values
    are cut on their ``repr``.

    Args:
        value: Any value taken from a request or an artifact.
        limit: The most characters of the value's repr to show (escape sequences count in full).

    Returns:
        The text to put in a message.
    """
    if isinstance(value, str | bytes | bytearray | memoryview):
        is_text = isinstance(value, str)
        whole: str | bytes = str(value) if is_text else bytes(value)  # type: ignore[arg-type]
        size = len(whole)
        text = repr(whole[: limit + 1])
        prefix = "" if is_text else "b"
        quote = text[-1]
        units = _REPR_UNIT.findall(text[len(prefix) + 1 : -1])
        if size <= limit and len("".join(units)) <= limit:
            return text
        shown: list[str] = []
        width = 0
        for unit in units[:limit]:
            if width + len(unit) > limit and shown:
                break
            shown.append(unit)
            width += len(unit)
        return f"{prefix}{quote}{''.join(shown)}…{quote} ({size} {'chars' if is_text else 'bytes'})"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} chars)"


def shorten_all(values: Iterable[object], most: int = 5, limit: int = 64) -> str:
    """Return ``values`` as a comma-separated list naming at most ``most`` of them, each shortened.

    Args:
        values: The values to name (names of inputs, keys, tables ...).
        most: How many to name before summing up the rest as ``and N more``.
        limit: The length limit passed to :func:`shorten` for each value.

    Returns:
        For example ``'a', 'b', 'c' and 97 more``.
    """
    items = list(values)
    named = ", ".join(shorten(item, limit) for item in items[:most])
    rest = len(items) - most
    return f"{named} and {rest} more" if rest > 0 else named


def cap_message(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """Cut a finished message to ``limit`` characters, saying how long it was: the last line of defence.

    Args:
        message: A message about to be sent to a client.
        limit: The most characters to keep.

    Returns:
        ``message`` itself when short enough, otherwise its head, ``…`` and its full length.
    """
    if len(message) <= limit:
        return message
    tail = f"… ({len(message)} chars)"
    return message[: max(limit - len(tail), 0)] + tail


class RequestError(Exception):
    """A request cannot be served; only that request fails."""

    code = "INTERNAL"


class InvalidInput(RequestError):
    """A request tensor is missing, mistyped, misshaped or holds a value out of range."""

    code = "INVALID_ARG"

    def __init__(self, input_name: str, message: str) -> None:
        super().__init__(f"input '{input_name}': {message}")
        self.input_name = input_name
        self.detail = message


class InvalidParameter(RequestError):
    """A request parameter (or the header forwarded as one) holds a value the server cannot use."""

    code = "INVALID_ARG"

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(f"parameter '{parameter}': {message}")
        self.parameter = parameter
        self.detail = message


class Refused(RequestError):
    """The server is overloaded and a request's value does not pay for serving it now: retry later."""

    code = "UNAVAILABLE"


class NonFiniteOutput(RequestError):
    """A model returned NaN or infinity for a row: the request fails rather than serve that score."""


class ArtifactError(RuntimeError):
    """A model artifact is missing, corrupt or does not fit the spec; the model refuses to load."""
