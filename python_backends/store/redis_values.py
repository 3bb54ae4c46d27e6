"""Rows of L3 read back from Redis, which is untrusted storage: decoded whole batches at a time.

Anyone who can write to the Redis Cluster can put anything under a key. :func:`decode_rows` keeps
what is the float32 row of its key's width and refuses the rest key by key (wrong length, empty, not
bytes, NaN or Inf, or a finite value over
:data:`~recserve.backends.base.artifacts.MAX_EMBEDDING_VALUE` in magnitude, which would make the
request's scores Inf or NaN), so a bad value costs its own key its row and nothing else.
"""

from __future__ import annotations

import numpy as np

from recserve.backends.base.artifacts import MAX_EMBEDDING_VALUE
from recserve.errors import shorten


def decode_rows(
    values: list, vectors: np.ndarray, widths: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Write the float32 rows of an MGET reply into ``vectors``; the found mask and the refused positions.

    A value is refused (not found, its row untouched, its position listed) when it is not bytes,
    when its length is not 4 bytes times its key's width (``widths[i]``; ``vectors``' width when
    ``widths`` is None; a width of 0 accepts any whole number of floats up to ``vectors``' width), or
    when it holds NaN, Inf or a value over :data:`MAX_EMBEDDING_VALUE` in magnitude. Rows narrower
    than ``vectors`` fill its first columns and zeros. Absent keys (None) are neither found nor
    refused.

    With well-formed values the cost is one ``len`` pass over the reply, one join, one ``min`` and
    one ``max`` over the decoded block; no Python code runs per key.
    """
    if len(values) != vectors.shape[0]:  # not a reply to these keys: refuse every one
        return np.zeros(vectors.shape[0], bool), np.arange(vectors.shape[0])
    try:
        return _decode_bytes(values, vectors, widths)
    except (TypeError, ValueError):  # a value that is not bytes (len, join or the array refused it)
        wrong = np.fromiter((not _is_bytes_or_none(v) for v in values), bool, len(values))
        kept = [None if bad else value for value, bad in zip(values, wrong.tolist(), strict=True)]
        found, refused = _decode_bytes(kept, vectors, widths)
        return found, np.union1d(refused, np.flatnonzero(wrong))


def _decode_bytes(
    values: list, vectors: np.ndarray, widths: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`decode_rows` for a reply of bytes and None; raises TypeError on anything else."""
    n, dim = vectors.shape
    reply = np.empty(n, object)
    reply[:] = values
    present = np.flatnonzero(reply != None)  # noqa: E711 - elementwise: ``is not None`` tests the array
    found = np.zeros(n, bool)
    if present.size == 0:
        return found, present
    given = reply if present.size == n else reply[present]
    lengths = np.fromiter(map(len, given), np.int64, present.size)  # TypeError for a value without len
    if widths is None:
        fits = lengths == 4 * dim
    else:
        expected = 4 * np.asarray(widths, np.int64)[present]
        fits = lengths == expected
        fits |= (expected == 0) & (lengths > 0) & (lengths % 4 == 0) & (lengths <= 4 * dim)
    whole = bool(fits.all())
    rows, taken, sizes = (present, given, lengths) if whole else (present[fits], given[fits], lengths[fits])
    data = np.frombuffer(b"".join(taken), np.float32)  # TypeError for a value that is not bytes
    if widths is None or bool((sizes == 4 * dim).all()):  # every row full width: one block
        block = data.reshape(-1, dim)
        if whole and _servable_block(data):  # the common case: every value well formed
            if present.size == n:
                vectors[:] = block
                found[:] = True
            else:
                vectors[present] = block
                found[present] = True
            return found, present[:0]
        finite = _servable(block).all(axis=1)
        vectors[rows[finite]] = block[finite]
    elif rows.size:  # rows of narrower tables: scattered into their first columns, zeros after
        counts = sizes // 4
        starts = np.cumsum(counts) - counts
        finite = np.logical_and.reduceat(_servable(data), starts)
        keep = np.repeat(finite, counts)
        vectors[rows[finite]] = 0.0
        columns = np.arange(data.size) - np.repeat(starts, counts)
        vectors[np.repeat(rows, counts)[keep], columns[keep]] = data[keep]
    else:
        finite = np.zeros(0, bool)
    found[rows[finite]] = True
    return found, np.sort(np.concatenate([present[~fits], rows[~finite]]))


def _servable(values: np.ndarray) -> np.ndarray:
    """Which values are finite and at most :data:`MAX_EMBEDDING_VALUE` in magnitude (NaN compares False)."""
    return np.abs(values) <= MAX_EMBEDDING_VALUE


def _servable_block(data: np.ndarray) -> bool:
    """Is every value servable? Two reductions, no temporary array (NaN makes both comparisons False)."""
    return bool(data.size == 0 or (data.min() >= -MAX_EMBEDDING_VALUE and data.max() <= MAX_EMBEDDING_VALUE))


def _is_bytes_or_none(value: object) -> bool:
    return value is None or isinstance(value, bytes | bytearray)


def describe_value(value: object) -> str:
    """What is wrong with a refused value, for the log (never the whole value)."""
    if not isinstance(value, bytes | bytearray):
        return f"a {type(value).__name__}, not bytes: {shorten(value)}"
    if len(value) % 4 == 0 and value and not _servable(np.frombuffer(bytes(value), np.float32)).all():
        return f"{len(value)} bytes holding NaN or Inf, or a value over {MAX_EMBEDDING_VALUE:g} in magnitude"
    return f"{len(value)} bytes, not the key's row of float32 ({shorten(value, 32)})"
