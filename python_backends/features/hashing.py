"""64-bit feature keys: ``splitmix64(salt(table) XOR value)``, vectorised over numpy arrays.

Production dynamic embeddings are keyed by a hash of feature and raw value, not by dense row
indices; the same functions run at build time (to key the trained tables) and at serving time.
"""

from __future__ import annotations

import numpy as np

from recserve.backends.features import compiled_keys
from recserve.core.values import fnv1a64

__all__ = ["combined_keys", "fnv1a64", "keys_for", "missing_key", "splitmix64", "table_salt"]


_GAMMA, _MIX1, _MIX2 = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
)
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser applied element-wise to a ``uint64`` array (a new array)."""
    z = np.add(np.asarray(x, dtype=np.uint64), _GAMMA)
    if not isinstance(z, np.ndarray) or z.ndim == 0:  # one value: numpy's scalar arithmetic, which warns
        with np.errstate(over="ignore"):
            z = (z ^ (z >> _SHIFTS[0])) * _MIX1
            z = (z ^ (z >> _SHIFTS[1])) * _MIX2
            return z ^ (z >> _SHIFTS[2])
    # arrays wrap around silently: in place, without temporaries beyond the shifts
    z ^= z >> _SHIFTS[0]
    z *= _MIX1
    z ^= z >> _SHIFTS[1]
    z *= _MIX2
    z ^= z >> _SHIFTS[2]
    return z


def table_salt(namespace: str, table: str) -> np.uint64:
    """Salt that separates the key spaces of tables."""
    return np.uint64(fnv1a64(f"{namespace}/{table}"))


def keys_for(values: np.ndarray, salt: np.uint64 | np.ndarray) -> np.ndarray:
    """Keys (int64 view of the 64-bit hash) for unsigned raw values of one table.

    ``salt`` is one table's salt, or an array of salts that broadcasts against ``values``. The
    compiled loop computes it where it was built (:mod:`.compiled_keys`): the same keys.
    """
    values = np.asarray(values, dtype=np.uint64)
    loops = compiled_keys.load()
    keys = None if loops is None else loops.keys(values, np.asarray(salt))
    return splitmix64(values ^ salt).view(np.int64) if keys is None else keys


def missing_key(namespace: str, feature: str) -> np.int64:
    """The per-feature key served for an empty value."""
    return splitmix64(np.array([fnv1a64(f"{namespace}/{feature}#missing")], dtype=np.uint64)).view(np.int64)[
        0
    ]


def combined_keys(columns: list[np.ndarray]) -> np.ndarray:
    """One int64 key per position for the keys of several aligned columns (same shapes).

    ``splitmix64`` chained over the columns: tuples of keys that differ anywhere get different keys
    (but for the odds of a 64-bit collision); one column is returned as it is.
    """
    acc = np.asarray(columns[0], np.int64)
    for column in columns[1:]:
        with np.errstate(over="ignore"):
            mixed = acc.view(np.uint64) * _MIX1 ^ np.asarray(column, np.int64).view(np.uint64)
        acc = splitmix64(mixed).view(np.int64)
    return acc
