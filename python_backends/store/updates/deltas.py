"""Delta files and their checks: the rows one update brings, refused before they are published or applied.

:func:`check_delta` is the one check of a delta's rows: ``recserve update`` runs it before it
publishes and every server after it loads a version, so nothing is published that the servers
would refuse (byte order included: the update log holds little-endian arrays only).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from recserve.backends.base.artifacts import MAX_EMBEDDING_VALUE, first_unservable, map_safetensors
from recserve.backends.base.bounded_files import load_npz
from recserve.backends.store.tiered import TieredStore
from recserve.errors import ArtifactError


class DeltaError(ArtifactError):
    """A delta that cannot be published or applied; nothing of it was applied."""


def read_delta_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` and ``vectors`` of a ``.npz`` or ``.safetensors`` delta file (never unpickles)."""
    if path.suffix == ".npz":
        try:
            arrays = load_npz(path)
        except ArtifactError as exc:
            raise DeltaError(f"delta {exc}") from None
    elif path.suffix == ".safetensors":
        try:
            arrays = map_safetensors(path)
        except ArtifactError as exc:
            raise DeltaError(f"delta {path.name}: {exc}") from None
    else:
        raise DeltaError(f"delta {path.name}: use a .npz or .safetensors file")
    missing = {"keys", "vectors"} - set(arrays)
    if missing:
        raise DeltaError(
            f"delta {path.name}: missing array(s) {sorted(missing)}; it needs 'keys' and 'vectors'"
        )
    return little_endian(arrays["keys"]), little_endian(arrays["vectors"])


def little_endian(array: np.ndarray) -> np.ndarray:
    """``array`` with its numbers in little-endian order (a copy only when they are not already)."""
    wanted = array.dtype.newbyteorder("<")
    return array if array.dtype == wanted else array.astype(wanted)


def check_delta(
    table: str,
    keys: np.ndarray,
    vectors: np.ndarray,
    dim: int,
    dtypes: tuple[str, ...] = ("float32",),
    what: str = "delta for",
) -> None:
    """Refuse a delta whose dtypes, byte order, shapes or values do not fit ``table`` (width ``dim``).

    Values must be finite and at most :data:`MAX_EMBEDDING_VALUE` in magnitude (the bound L3
    applies to Redis values). ``what`` starts each message (``recserve import`` checks whole keyed
    tables: ``table``).
    """
    if keys.dtype != np.dtype("<i8") or keys.ndim != 1:
        raise DeltaError(
            f"{what} {table!r}: keys are {keys.dtype}{list(keys.shape)}, expected int64[n] (little-endian)"
        )
    if vectors.dtype.name not in dtypes or vectors.dtype != vectors.dtype.newbyteorder("<"):
        raise DeltaError(
            f"{what} {table!r}: vectors are {vectors.dtype}, expected {' or '.join(dtypes)} (little-endian)"
        )
    if vectors.shape != (len(keys), dim):
        raise DeltaError(
            f"{what} {table!r}: vectors are {list(vectors.shape)}, "
            f"expected [{len(keys)}, {dim}] (table dim {dim})"
        )
    if len(keys) == 0:
        raise DeltaError(f"{what} {table!r} holds no rows")
    if len(np.unique(keys)) != len(keys):
        raise DeltaError(f"{what} {table!r} repeats keys")
    bad = first_unservable(vectors)
    if bad is not None:
        raise DeltaError(
            f"{what} {table!r}: row {bad} holds NaN or Inf, or a value over {MAX_EMBEDDING_VALUE:g} "
            "in magnitude"
        )


def check_ownership(store: TieredStore, table: str, keys: np.ndarray) -> None:
    """Refuse keys that the local tier stores for another table."""
    table_id = store.table_id(table)
    for number, shard in enumerate(store.shards):
        rows = shard.index.find(keys)
        owners = store.table_of_row(number, rows[rows >= 0])
        foreign = owners[owners != table_id]
        if foreign.size:
            bad = keys[rows >= 0][owners != table_id][0]
            raise DeltaError(
                f"delta for {table!r}: key {int(bad)} belongs to table {store.table_names[int(foreign[0])]!r}"
            )


def check_foreign_deltas(
    rows: Mapping[str, tuple[np.ndarray, np.ndarray]],
    versions: Mapping[str, int],
    table: str,
    keys: np.ndarray,
) -> None:
    """Refuse keys that another table's published delta already holds (``rows``: merged delta rows per table).

    The servers make this check for every version they apply and ``recserve update`` before it
    publishes, so a clash is refused where it is made rather than wedging every server's updates.
    """
    for other, (other_keys, _) in rows.items():
        if other == table or not len(other_keys):
            continue
        shared = np.intersect1d(keys, other_keys)
        if shared.size:
            raise DeltaError(
                f"delta for {table!r}: key {int(shared[0])} is in the published delta of table {other!r} "
                f"(version {versions.get(other, '?')}); {shared.size} key(s) shared"
            )


__all__ = [
    "DeltaError",
    "check_delta",
    "check_foreign_deltas",
    "check_ownership",
    "little_endian",
    "read_delta_file",
]
