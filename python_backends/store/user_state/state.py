"""A user's state: at most ``T`` tokens, the sequence number of its last event, its mode and versions.

Stored as one byte string (no pickle), read back from storage that is not trusted, so
:func:`decode_state` checks every field and size before it builds anything::

    b"RSU1"                      magic and format
    20 ASCII digits              seq: the last event the state includes (zero-padded, so that
                                 the store's compare-on-write is a byte comparison)
    <B B I Q Q (little-endian)   mode (0 exact, 1 clustered), attribute columns k, tokens n,
                                 table version, dense version
    int64[n]                     item ids, by last occurrence, oldest first
    uint32[n]                    counts, each >= 1 (the token's log-weight is ln count)
    int64[n, k]                  each token's attributes (the values of the sequences aligned to the
                                 items, e.g. their categories), row by row; none when k = 0

A token is a distinct item, or with attributes a distinct (item, attributes) tuple: events that
differ in an attribute are different tokens, so the merge stays exact.

Ids are stored, not vectors: an embedding update or a new dense model never makes a state stale in
value; a clustered state's grouping was made in one model's key space, so it records the versions.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from recserve.backends.store.user_state.tokens import Tokens
from recserve.errors import shorten

MAGIC = b"RSU1"
SEQ_DIGITS = 20
#: The largest sequence number (a request's ``user_seq`` is an INT64).
MAX_SEQ = 2**63 - 1
_FIELDS = struct.Struct("<BBIQQ")
HEADER_BYTES = len(MAGIC) + SEQ_DIGITS + _FIELDS.size
#: The state's mode: every distinct item its own token, or the older items grouped.
EXACT, CLUSTERED = "exact", "clustered"
MODES = (EXACT, CLUSTERED)
#: The most attribute columns a state may carry (its header's byte).
MAX_ATTRIBUTES = 255


class StateFormatError(ValueError):
    """A stored value that is not a user state this server can use (the reason names what is wrong)."""


@dataclass(frozen=True)
class UserState:
    """One user's state as the builder writes it and the lookup step reads it."""

    seq: int  # the last event included
    mode: str  # EXACT or CLUSTERED
    tokens: Tokens
    table_version: int = 0  # of the item table the grouping was made with
    dense_version: int = 0  # of the dense model whose key space grouped the items
    #: int64 [n, k]: each token's values of the sequences aligned to the items (None: k = 0)
    attributes: np.ndarray | None = None
    #: The stored bytes it was read from (b"": built here): a store that reads the same bytes
    #: again reuses the state instead of decoding and checking it again.
    raw: bytes = field(default=b"", compare=False, repr=False)

    def encode(self) -> bytes:
        """The stored bytes."""
        if not 0 <= self.seq <= MAX_SEQ or self.mode not in MODES:
            raise ValueError(f"a state needs 0 <= seq and a mode of {MODES}, got {self.seq}, {self.mode!r}")
        counts = np.asarray(self.tokens.counts)
        if counts.size and (counts.min() < 1 or counts.max() > np.iinfo(np.uint32).max):
            raise ValueError("token counts must lie in 1..2**32-1")
        attributes = self.attribute_array
        if attributes.shape[0] != len(self.tokens) or attributes.shape[1] > MAX_ATTRIBUTES:
            raise ValueError(
                f"attributes {list(attributes.shape)} for {len(self.tokens)} tokens (at most "
                f"{MAX_ATTRIBUTES} columns)"
            )
        head = _FIELDS.pack(
            MODES.index(self.mode),
            attributes.shape[1],
            len(self.tokens),
            self.table_version,
            self.dense_version,
        )
        return b"".join(
            (
                MAGIC,
                b"%020d" % self.seq,
                head,
                np.ascontiguousarray(self.tokens.items, "<i8").tobytes(),
                np.ascontiguousarray(counts, "<u4").tobytes(),
                np.ascontiguousarray(attributes, "<i8").tobytes(),
            )
        )

    @property
    def attribute_array(self) -> np.ndarray:
        """int64 ``[n, k]``: the tokens' attributes (``[n, 0]`` without)."""
        if self.attributes is None:
            return np.zeros((len(self.tokens), 0), np.int64)
        return np.asarray(self.attributes, np.int64).reshape(len(self.tokens), -1)


def seq_bytes(seq: int) -> bytes:
    """``seq`` as stored (20 zero-padded digits): byte order is numeric order."""
    return b"%020d" % seq


def decode_state(value: object, max_tokens: int, attributes: int = 0) -> UserState:
    """The state in ``value``, checked.

    Args:
        value: the stored value.
        max_tokens: the most tokens this server accepts.
        attributes: the attribute columns this server's states carry (its aligned sequences).

    Raises:
        StateFormatError: not bytes, a wrong magic or format, a length that disagrees with its token
            count, too many tokens, another number of attribute columns, an unknown mode, a count
            of 0, or a token twice.
    """
    decoded = decode_states([value], max_tokens, attributes)[0]
    if isinstance(decoded, StateFormatError):
        raise decoded
    return decoded


def decode_states(
    values: Sequence[object], max_tokens: int, attributes: int = 0
) -> list[UserState | StateFormatError]:
    """Each of ``values`` decoded and checked as :func:`decode_state` does, or the error it raises.

    The headers are read one by one; the tokens of all the values are converted and their counts
    checked in one pass (a batch's states cost a few numpy calls, not a few per state).
    """
    out: list[UserState | StateFormatError] = []
    headers: list[tuple[int, _Header]] = []  # (position in values, its header)
    for position, value in enumerate(values):
        try:
            headers.append((position, _header(value, max_tokens, attributes)))
            out.append(_PENDING)
        except StateFormatError as exc:
            out.append(exc)
    if not headers:
        return out
    items = np.frombuffer(
        b"".join(h.value[HEADER_BYTES : HEADER_BYTES + 8 * h.tokens] for _, h in headers), "<i8"
    ).astype(np.int64)
    counts = np.frombuffer(
        b"".join(h.value[HEADER_BYTES + 8 * h.tokens : HEADER_BYTES + 12 * h.tokens] for _, h in headers),
        "<u4",
    ).astype(np.int64)
    columns = (
        np.frombuffer(b"".join(h.value[HEADER_BYTES + 12 * h.tokens :] for _, h in headers), "<i8")
        .astype(np.int64)
        .reshape(-1, attributes)
        if attributes
        else None
    )
    zero_count = bool(counts.size) and counts.min() < 1
    end = 0
    for position, h in headers:
        start, end = end, end + h.tokens
        state_items, state_counts = items[start:end], counts[start:end]
        state_columns = columns[start:end] if columns is not None else None
        if zero_count and h.tokens and state_counts.min() < 1:
            out[position] = StateFormatError("a token with count 0")
        elif _repeats(state_items, state_columns):
            out[position] = StateFormatError("an item in two tokens")
        else:
            tokens = Tokens(state_items, state_counts)
            out[position] = UserState(
                h.seq, MODES[h.mode], tokens, h.table_version, h.dense_version, state_columns, h.value
            )
    return out


class _Header(NamedTuple):
    """A stored value's bytes and what its header says, checked (:func:`_header`)."""

    value: bytes
    seq: int
    mode: int  # the index in MODES
    tokens: int
    table_version: int
    dense_version: int


def _repeats(items: np.ndarray, attributes: np.ndarray | None) -> bool:
    """Whether a token repeats: an item twice, or with attributes an (item, attributes) tuple twice."""
    if attributes is None:
        ordered = np.sort(items)
        return bool((ordered[1:] == ordered[:-1]).any())
    return len(np.unique(np.column_stack([items, attributes]), axis=0)) != items.size


def _header(value: object, max_tokens: int, attributes: int = 0) -> _Header:
    """The bytes of ``value`` and its header's sequence number, mode, tokens and versions, checked."""
    if not isinstance(value, bytes | bytearray):
        raise StateFormatError(f"a {type(value).__name__}, not bytes: {shorten(value)}")
    value = bytes(value)
    if len(value) < HEADER_BYTES or not value.startswith(MAGIC):
        raise StateFormatError(f"{len(value)} bytes, not a user state ({shorten(value, 32)})")
    digits = value[len(MAGIC) : len(MAGIC) + SEQ_DIGITS]
    if not digits.isdigit():
        raise StateFormatError(f"sequence number {shorten(digits, 32)} is not {SEQ_DIGITS} digits")
    seq = int(digits)
    if seq > MAX_SEQ:
        raise StateFormatError(f"sequence number {seq} is beyond {MAX_SEQ}")
    mode, columns, n, table_version, dense_version = _FIELDS.unpack_from(value, len(MAGIC) + SEQ_DIGITS)
    if mode >= len(MODES):
        raise StateFormatError(f"unknown mode {mode}")
    if columns != attributes:
        raise StateFormatError(f"tokens of {columns} attributes; this spec's states carry {attributes}")
    if n > max_tokens:
        raise StateFormatError(f"{n} tokens, over the limit of {max_tokens}")
    expected = HEADER_BYTES + (12 + 8 * columns) * n
    if len(value) != expected:
        raise StateFormatError(f"{len(value)} bytes for {n} tokens (expected {expected})")
    return _Header(value, seq, mode, n, table_version, dense_version)


#: A value not decoded yet (replaced before :func:`decode_states` returns).
_PENDING = StateFormatError("not decoded")
