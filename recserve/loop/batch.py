"""A batch of joined examples as the learner reads it (keys, masks, network inputs); the specs it trains.

Columns are read whole (no row-by-row Python): an example's ``keys`` (its single-valued slots' keys,
its multi-hot positions', then its targets'), and its own ``history`` laid out left-aligned and
masked, each sequence at its logged length (the attention ignores position; padding is never trained).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from recserve.backends.features.pooling import logged_pooling_weights, pooling_matrix
from recserve.backends.request_log.records import sequence_lengths
from recserve.backends.steps.group_inputs import attention_spans, group_inputs
from recserve.core.contract import sparse_inputs
from recserve.core.spec.model import ModelSpec


class BatchLayout:
    """Where a batch's keys go, and how its rows become the network's inputs, as the lookup step makes them.

    A batch's keys are laid out as logged: the single-valued slots, the multi-hot positions (each
    feature's rows weighted and summed into its slot), the targets, then the history: each sequence's
    positions in turn, every attention group's at one width (a group's sequences share their length).

    Args:
        spec: the served spec.
        table_id: a table's id in the store, by name.
    """

    def __init__(self, spec: ModelSpec, table_id: Callable[[str], int]) -> None:
        self.spec = spec
        self.single = len(spec.categorical.features)
        self.multi = sum(f.max_length for f in spec.categorical.multi_hot)
        self.targets = len(spec.targets)
        tables = [f.table for f in spec.categorical.features]
        tables += [f.table for f in spec.categorical.multi_hot for _ in range(f.max_length)]
        tables += [t.table for t in spec.targets]
        #: the table id of each single-valued slot, each multi-hot position, each target
        self.column_tables = np.array([table_id(t) for t in tables], np.int16)
        sequences = [s for group in spec.attention_groups for s in group.sequences]
        #: the table id of each sequence, group after group
        self.sequence_tables = np.array([table_id(s.table) for s in sequences], np.int16)
        self.groups = attention_spans(spec)
        #: each sequence's attention group
        self.group_of = np.repeat(np.arange(len(self.groups)), [g.stop - g.start for _, g, _ in self.groups])
        self.pooling = torch.tensor(pooling_matrix(spec))
        self.sparse = sparse_inputs(spec)  # (input, width, its slots) per width of the slots' tables

    def of(self, examples: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A batch's keys ``[B, F + M + T + S * L]``, their table ids, and its masks.

        The masks: each attention group's history mask ``[B, groups, L]`` and the multi-hot positions'
        pooling weights ``[B, M]`` (read back from their keys).
        """
        rows = examples.num_rows
        keys = pc.list_flatten(examples["keys"]).to_numpy().astype(np.int64).reshape(rows, -1)
        keys = keys[:, : len(self.column_tables)]
        tables = np.broadcast_to(self.column_tables, keys.shape)
        weights = logged_pooling_weights(self.spec, keys[:, self.single : self.single + self.multi])
        count = len(self.sequence_tables)
        if not count:
            return keys, np.array(tables), np.zeros((rows, 0, 0), np.float32), weights
        logged = examples["history_lengths"] if "history_lengths" in examples.column_names else None
        split = sequence_lengths(examples["history"], logged, count)  # [B, S]
        values = pc.list_flatten(examples["history"]).to_numpy().astype(np.int64)
        width = max(1, int(split.max(initial=0)))
        history = np.zeros((rows, count, width), np.int64)
        each = split.reshape(-1)  # (row, sequence) after (row, sequence)
        pair = np.repeat(np.arange(rows * count), each)
        history[
            pair // count, pair % count, np.arange(len(values)) - np.repeat(np.cumsum(each) - each, each)
        ] = values  # left-aligned
        group_lengths = split[:, [span.start for _, span, _ in self.groups]]  # [B, groups]
        mask = (np.arange(width) < group_lengths[:, :, None]).astype(np.float32)
        history_tables = np.repeat(self.sequence_tables, width)
        return (
            np.concatenate([keys, history.reshape(rows, -1)], axis=1),
            np.concatenate([tables, np.broadcast_to(history_tables, (rows, len(history_tables)))], axis=1),
            mask,
            weights,
        )

    def named(self, vectors: torch.Tensor, mask: np.ndarray, weights: np.ndarray) -> dict[str, torch.Tensor]:
        """The network's embedding inputs from a batch's rows ``[B, keys, width]`` (not its dense values)."""
        slots = vectors[:, : self.single]
        after = self.single + self.multi  # the targets' first column
        if self.multi:
            weighted = vectors[:, self.single : after] * torch.tensor(weights)[:, :, None]
            slots = torch.cat([slots, torch.einsum("bmd,mk->bkd", weighted, self.pooling)], dim=1)
        named = {name: slots[:, list(at), :width] for name, width, at in self.sparse}
        if self.groups:  # as the lookup step makes each group's query and positions
            rows, count, dim = vectors.shape[0], len(self.sequence_tables), vectors.shape[2]
            targets = vectors[:, after : after + self.targets]
            histories = vectors[:, after + self.targets :].reshape(rows, count, -1, dim)
            named.update(group_inputs(targets, histories, self.groups, self.spec.model.embedding_dim))
            for g, (names, _, _) in enumerate(self.groups):
                named[names.mask] = torch.tensor(mask[:, g])
        return named

    def trained(self, mask: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The positions of a batch whose rows train, flat: never padding (a history's, a multi-hot's)."""
        ones = np.ones((mask.shape[0], 1), bool)
        history = (mask[:, self.group_of] > 0).reshape(mask.shape[0], -1)  # each sequence: its group's
        parts = [ones.repeat(self.single, 1), weights > 0, ones.repeat(self.targets, 1), history]
        return np.concatenate(parts, axis=1).reshape(-1)


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


def record_problem(spec: ModelSpec) -> Callable[[Mapping[str, Any]], str]:
    """What is wrong with a logged features record for ``spec`` ("": nothing), its history resolved.

    A record the learner could not lay out (its keys, dense values, versions or history of another
    shape than the spec's) names the first column that is not.
    """
    keys = len(spec.categorical.features) + sum(f.max_length for f in spec.categorical.multi_hot)
    keys += len(spec.targets)
    widths = {"keys": keys, "dense": len(spec.normalized_columns), "embedding_version": len(spec.table_names)}
    sequences = len(spec.sequences)

    def problem(record: Mapping[str, Any]) -> str:
        for name, width in widths.items():
            if len(record.get(name) or ()) != width:
                return f"{name}: {len(record.get(name) or ())} values, the spec's are {width}"
        lengths, logged = record.get("history_lengths"), len(record.get("history") or ())
        if lengths is not None and (
            len(lengths) != sequences or min(lengths, default=0) < 0 or sum(lengths) != logged
        ):
            return f"history_lengths {list(lengths)[:8]} do not split {logged} keys in {sequences}"
        return ""

    return problem


def trainable(spec: ModelSpec) -> str:
    """Why the learner cannot train ``spec`` (empty: it can)."""
    if spec.user_state.enabled:  # trained on the tail, the rows would learn from what was not served
        return "[user_state] (the log holds each request's tail, not the history merged with its state)"
    return ""


@dataclass
class BatchFigures:
    """One trained batch: its examples, its weighted log loss before the step, the rows it touched."""

    examples: int
    log_loss: float
    rows: int
