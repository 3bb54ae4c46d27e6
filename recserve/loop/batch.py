"""A batch of joined examples as the learner reads it (keys, tables, history mask), and the specs it trains.

Columns are read whole (no row-by-row Python): an example's ``keys`` (its single-valued slots' keys,
its multi-hot positions', then its targets'), and its own ``history`` laid out left-aligned and
masked (the attention ignores position; padding is never trained).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recserve.core.spec.model import ModelSpec


@dataclass(frozen=True)
class BatchLayout:
    """Where a batch's keys go: the table of each slot, multi-hot position and target column, the history's.

    Args:
        column_tables: the table id of each single-valued slot, each multi-hot position, each target.
        history_table: the behaviour sequence's table id (None: the spec has no sequence).
    """

    column_tables: np.ndarray
    history_table: int | None

    def of(self, examples: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Keys ``[B, F + T + L]``, their table ids and the history mask ``[B, L]`` of a batch."""
        rows = examples.num_rows
        keys = pc.list_flatten(examples["keys"]).to_numpy().astype(np.int64).reshape(rows, -1)
        keys = keys[:, : len(self.column_tables)]
        tables = np.broadcast_to(self.column_tables, keys.shape)
        if self.history_table is None:
            return keys, np.array(tables), np.zeros((rows, 0), np.float32)
        lengths = pc.fill_null(pc.list_value_length(examples["history"]), 0).to_numpy().astype(np.int64)
        values = pc.list_flatten(examples["history"]).to_numpy().astype(np.int64)
        history = np.zeros((rows, max(1, int(lengths.max(initial=0)))), np.int64)
        mask = np.zeros(history.shape, np.float32)
        owner = np.repeat(np.arange(rows), lengths)
        position = np.arange(len(values)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        history[owner, position] = values  # left-aligned
        mask[owner, position] = 1.0
        return (
            np.concatenate([keys, history], axis=1),
            np.concatenate([tables, np.full(history.shape, self.history_table, np.int16)], axis=1),
            mask,
        )


def distinct_rows(keys: np.ndarray, tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (table, key) rows of a batch (structured, sorted) and each position's index among them."""
    flat_keys, flat_tables = keys.reshape(-1), tables.reshape(-1)
    order = np.lexsort((flat_keys, flat_tables))
    sorted_keys, sorted_tables = flat_keys[order], flat_tables[order]
    first = np.ones(len(order), bool)
    first[1:] = (sorted_keys[1:] != sorted_keys[:-1]) | (sorted_tables[1:] != sorted_tables[:-1])
    inverse = np.empty(len(order), np.int64)
    inverse[order] = np.cumsum(first) - 1
    unique = np.empty(int(first.sum()), [("table", np.int16), ("key", np.int64)])
    unique["table"], unique["key"] = sorted_tables[first], sorted_keys[first]
    return unique, inverse


def trainable(spec: ModelSpec) -> str:
    """Why the learner cannot train ``spec`` (empty: it can)."""
    if len(spec.sequences) > 1:
        return "more than one behaviour sequence"
    return ""


@dataclass
class BatchFigures:
    """One trained batch: its examples, its weighted log loss before the step, the rows it touched."""

    examples: int
    log_loss: float
    rows: int
