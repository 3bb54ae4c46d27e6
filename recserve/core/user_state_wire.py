"""What ``[user_state]`` adds to the wire and to the dense contract, and when.

With ``[user_state] enabled`` on a spec with a sequence, the row layout takes two optional INT64
inputs, ``user_id`` and ``user_seq`` (``[B, 1]``), and the dense network takes
``history_log_weights`` (``[B, L]``, FP32) beside the first group's history: ``ln count`` per
token of a user's merged state, 0 elsewhere. Without the section nothing changes: no wire input,
no dense input, today's configs and ONNX graphs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recserve.core.names import HISTORY_LOG_WEIGHTS, USER_ID, USER_SEQ
from recserve.core.spec.types import WireTensor

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
