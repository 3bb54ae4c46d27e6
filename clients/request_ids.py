"""Request ids as the clients send them: the caller's, checked, or a new random one."""

from __future__ import annotations

import uuid

from recserve.errors import shorten

#: The longest request id the client sends (Triton takes any string; a log keys its records by it).
MAX_REQUEST_ID = 128


def request_id_of(given: str | None) -> str:
    """``given`` checked (printable ASCII, 1..128 characters), or a new random id (32 hex digits).

    Raises:
        ValueError: ``given`` is empty, too long or not printable ASCII.
    """
    if given is None:
        return uuid.uuid4().hex
    if not 0 < len(given) <= MAX_REQUEST_ID or not given.isascii() or not given.isprintable():
        raise ValueError(
            f"request_id must be 1..{MAX_REQUEST_ID} printable ASCII characters, got {shorten(given)}"
        )
    return given


def part_ids(request_id: str | None, parts: int) -> list[str]:
    """The ids of a call sent as ``parts`` requests: ``request_id`` itself for one, else ``<id>.<k>``."""
    base = request_id_of(request_id)
    return [base] if parts == 1 else [f"{base}.{k}" for k in range(parts)]
