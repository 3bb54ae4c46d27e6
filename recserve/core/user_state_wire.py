"""What ``[user_state]`` adds to the wire and to the dense contract, and when.

With ``[user_state] enabled`` on a spec with a sequence, the row layout takes two optional INT64
inputs, ``user_id`` and ``user_seq`` (``[B, 1]``), and the dense network takes
``history_log_weights`` (``[B, L]``, FP32) beside the first group's history: ``ln count`` per
token of a user's merged state, 0 elsewhere. Without the section nothing changes: no wire input,
no dense input, today's configs and ONNX graphs.

A user id is an int64 on the wire, in the states and in the event log. A string user id (common in
ads logs) becomes one by :func:`user_key`: the SDK, the file readers and the user-state builder all
call it, so a user named ``"u-17"`` in a request and in its events is the same user.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from recserve.core.names import HISTORY_LOG_WEIGHTS, USER_ID, USER_SEQ
from recserve.core.spec.types import WireTensor
from recserve.core.values import canonical_value, fnv1a64
from recserve.errors import shorten

if TYPE_CHECKING:
    from recserve.core.spec.model import ModelSpec


def serves_user_state(spec: ModelSpec) -> bool:
    """True when requests may carry a user whose state is merged (``[user_state]`` on, a sequence)."""
    return spec.user_state.enabled and bool(spec.sequences)


def user_state_inputs(spec: ModelSpec) -> tuple[WireTensor, ...]:
    """The optional wire inputs ``user_id`` and ``user_seq`` (none without :func:`serves_user_state`)."""
    if not serves_user_state(spec):
        return ()
    return tuple(WireTensor(name, "INT64", (1,), optional=True) for name in (USER_ID, USER_SEQ))


def log_weight_inputs(spec: ModelSpec) -> tuple[str, ...]:
    """``("history_log_weights",)`` when the dense network takes a log-weight per token, else ``()``."""
    return (HISTORY_LOG_WEIGHTS,) if serves_user_state(spec) else ()


_INTEGER = re.compile(rb"[+-]?[0-9]+")
_INT64 = (-(2**63), 2**63 - 1)


def user_key(user: object) -> int:
    """The int64 a user id is served as.

    An integer is itself; a string (or bytes) of decimal digits, in its canonical form (surrounding
    whitespace removed), is its integer; any other string is FNV-1a 64 of its canonical form (the
    project's string hash), as a signed int64.

    Raises:
        ValueError: an integer, or a string of digits, beyond int64; an empty string; or a value
            that is neither an integer nor a string.
    """
    if isinstance(user, bool) or not isinstance(user, int | np.integer | str | bytes):
        raise ValueError(f"a user id is an integer or a string, got {shorten(user)}")
    if isinstance(user, str | bytes):
        text = canonical_value(user)
        if not text:
            raise ValueError("a user id is not empty")
        if not _INTEGER.fullmatch(text):
            return int(np.uint64(fnv1a64(text)).view(np.int64))
        user = int(text)
    if not _INT64[0] <= int(user) <= _INT64[1]:
        raise ValueError(f"user id {shorten(user)} is beyond int64")
    return int(user)


def user_keys(users: Iterable[object]) -> np.ndarray:
    """:func:`user_key` of each of ``users``, as int64 ``[n]``."""
    return np.array([user_key(u) for u in users], np.int64)
