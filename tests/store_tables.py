"""Small embedding tables and tiered stores for tests, built in memory from a seed."""

from __future__ import annotations

import numpy as np

from recserve.backends.store.table_data import TableArrays
from recserve.backends.store.tiered import TieredStore
from recserve.core.spec.model import ModelSpec

DIM = 4  # the width of :func:`make_tables`' vectors


def make_tables(seed: int = 0, rows: tuple[int, ...] = (500, 300)) -> dict[str, TableArrays]:
    """Tables ``t0``, ``t1``, ... of ``rows`` random keys each (no key in two tables), ``DIM`` wide.

    Table ``tN``'s default vector is all ``100 + N``, so a default is told from a stored row at a glance.
    """
    rng = np.random.default_rng(seed)
    keys = rng.choice(np.iinfo(np.int64).max, size=sum(rows), replace=False) * rng.choice(
        [-1, 1], size=sum(rows)
    )
    tables, start = {}, 0
    for number, count in enumerate(rows):
        name = f"t{number}"
        tables[name] = TableArrays(
            name,
            keys[start : start + count].astype(np.int64),
            rng.normal(size=(count, DIM)).astype(np.float32),
            np.full(DIM, 100 + number, np.float32),
        )
        start += count
    return tables


def spec_store(spec: ModelSpec, base_version: int = 1) -> tuple[dict[str, TableArrays], TieredStore]:
    """Ten rows for each of ``spec``'s tables (keys 1, 2, ... in table order) and a store serving them."""
    rng = np.random.default_rng(5)
    tables, start = {}, 1
    for name in spec.table_names:
        keys = np.arange(start, start + 10, dtype=np.int64)
        start += 10
        dim = spec.tables[name].dim
        tables[name] = TableArrays(
            name, keys, rng.normal(size=(10, dim)).astype(np.float32), np.zeros(dim, np.float32)
        )
    return tables, TieredStore.from_tables(tables, base_version=base_version)
