"""Domain errors raised while handling one request.

Each error carries the Triton error code it maps to; the mapping to ``pb_utils.TritonError`` lives in
:mod:`recserve.backends.triton.adapter` alone.
"""

from __future__ import annotations


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


class NonFiniteOutput(RequestError):
    """A model returned NaN or infinity for a row: the request fails rather than serve that score."""


class ArtifactError(RuntimeError):
    """A model artifact is missing, corrupt or does not fit the spec; the model refuses to load."""
