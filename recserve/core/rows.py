"""Rows as clients hold them: raw feature values of N rows, column-wise, and their wire inputs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from recserve.core.names import BYTES_WIRE, IDS_WIRE, USER_ID, USER_SEQ
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import NUMERIC_INPUT, NUMPY_DTYPES
from recserve.core.user_state_wire import serves_user_state, user_keys
from recserve.core.values import canonical_value, split_list
from recserve.core.wire_forms import check_form, ids_from_bytes


class SideSequences:
    """Rows with attention groups: the first group's arrays as attributes, the others in ``side``.

    ``target``, ``history`` and ``lengths`` are the first group's; the other sequences and targets
    are in ``side`` by name, and so are the lengths of every further group, by its length input.
    """

    target: np.ndarray
    history: np.ndarray
    lengths: np.ndarray
    side: dict[str, np.ndarray]

    def sequence(self, name: str) -> np.ndarray:
        """Ids ``[N, W]`` of one sequence (the first is ``history``)."""
        return self.side.get(name, self.history)

    def lengths_of(self, length_input: str) -> np.ndarray:
        """Lengths ``[N]`` of the attention group whose length input is named so (the first: ``lengths``)."""
        return self.side.get(length_input, self.lengths)

    def target_ids(self, name: str) -> np.ndarray:
        """int64 ids ``[N]`` of one attention target (the first is ``target``; -1: absent)."""
        return self.side.get(name, self.target).astype(np.int64)


@dataclass
class Rows(SideSequences):
    """Raw feature values of ``N`` rows, column-wise as numpy arrays: what a client reads and sends.

    One container for every source of rows (files read by :func:`recserve.clients.read_rows`, the
    synthetic generator, the training split). Parts the spec lacks are empty: ``dense`` ``[N, 0]``
    without numeric features; without a sequence every target is absent and every history empty.

    Attributes:
        dense: float32 ``[N, D]`` raw numeric values, 0 where missing (``D = 0`` without numeric features).
        dense_missing: bool ``[N, D]``, True where a numeric value is absent.
        categorical: object ``[N, C]`` of ``bytes`` as sent (checked by type), ``b""`` when empty.
        target: int64 ``[N]`` target item id, -1 when absent.
        history: int64 ``[N, W]`` history item ids, newest last, valid below ``lengths``; ``W >= 1``.
        lengths: int32 ``[N]`` number of valid history positions per row.
        labels: float32 ``[N]`` click labels, or None when the input had no label column.
        side: the other sequences (``[N, W]``) and their targets (``[N]``) by name, and the lengths
            (``[N]``) of every further attention group by the name of its length input.
        users: int64 ``[N]``, each row's user (the key of its state, ``[user_state]``), or None.
        user_seqs: int64 ``[N]``, the sequence number of the newest event of each row's history
            (the history is then the user's real-time tail), or None. With both, a spec serving
            user states gets them as ``user_id`` and ``user_seq``.
    """

    dense: np.ndarray
    dense_missing: np.ndarray
    categorical: np.ndarray
    target: np.ndarray
    history: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray | None = None
    side: dict[str, np.ndarray] = field(default_factory=dict)
    users: np.ndarray | None = None
    user_seqs: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def take(self, index: slice | np.ndarray) -> Rows:
        """Rows selected by a slice or an index array (the history keeps its padded width)."""
        parts: dict[str, Any] = {
            name: None if getattr(self, name) is None else getattr(self, name)[index]
            for name in self.__dataclass_fields__
            if name != "side"
        }
        return Rows(**parts, side={name: values[index] for name, values in self.side.items()})

    def batches(self, size: int) -> Iterator[Rows]:
        """Consecutive slices of at most ``size`` rows, in order.

        Args:
            size: rows per batch, at least 1.

        Raises:
            ValueError: ``size`` is not positive.
        """
        if size < 1:
            raise ValueError(f"batch size must be at least 1, got {size}")
        for start in range(0, len(self), size):
            yield self.take(slice(start, start + size))

    def label_values(self) -> np.ndarray:
        """The labels ``[N]`` of rows that have them (generated, or read with a label column).

        Raises:
            ValueError: the rows carry no label.
        """
        if self.labels is None:
            raise ValueError("these rows carry no label")
        return self.labels

    def with_labels(self, labels: np.ndarray) -> Rows:
        """These rows in their canonical dtypes (0 where a numeric value is missing), with ``labels``."""
        return Rows(
            dense=np.where(self.dense_missing, 0.0, self.dense).astype(np.float32),
            dense_missing=self.dense_missing.astype(bool),
            categorical=self.categorical,
            target=self.target.astype(np.int64),
            history=self.history.astype(np.int64),
            lengths=self.lengths.astype(np.int32),
            labels=labels,
            side=self.side,
            users=self.users,
            user_seqs=self.user_seqs,
        )

    def with_user_state(
        self, spec: ModelSpec, users: Sequence[object] | np.ndarray, user_seqs: np.ndarray
    ) -> Rows:
        """These rows as a user's real-time tails: each row's user and its newest event's number.

        ``users``: ids as integers or strings; the rows carry their :func:`user_key`. Where
        ``[inputs] user`` names a categorical column, that column holds the users' ids as given.
        """
        categorical = self.categorical
        if spec.inputs.user in spec.categorical.columns:
            categorical = categorical.copy()
            column = spec.categorical.columns.index(spec.inputs.user)
            categorical[:, column] = [canonical_value(u) for u in np.asarray(users, object).tolist()]
        return replace(
            self,
            categorical=categorical,
            users=user_keys(np.asarray(users, object).reshape(-1)),
            user_seqs=np.asarray(user_seqs, np.int64).reshape(-1),
        )

    def user_state_wire(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        """``user_id`` and ``user_seq`` ``[N, 1]`` when the rows carry them and the spec serves states.

        Empty otherwise (no user, or ``[user_state]`` off).
        """
        if self.users is None or self.user_seqs is None or not serves_user_state(spec):
            return {}
        return {
            USER_ID: np.ascontiguousarray(self.users, np.int64).reshape(-1, 1),
            USER_SEQ: np.ascontiguousarray(self.user_seqs, np.int64).reshape(-1, 1),
        }

    def to_raw(self, spec: ModelSpec) -> Rows:
        """The rows to train on: canonical dtypes and float32 labels.

        Raises:
            ValueError: the rows carry no label.
        """
        if self.labels is None:
            raise ValueError(
                f"rows to train on need a label column (label first in TSV, {spec.inputs.label!r} in CSV)"
            )
        return self.with_labels(self.labels.astype(np.float32))

    def to_inputs(self, spec: ModelSpec, form: str = BYTES_WIRE) -> dict[str, np.ndarray]:
        """Request tensors of the spec's ensemble for these rows.

        The history is trimmed or zero padded to ``W = max(1, longest history of these rows)``.

        Args:
            spec: the model spec naming the wire inputs and their dtypes.
            form: the wire form, ``bytes`` or ``ids`` (:mod:`recserve.core.wire_forms`).

        Returns:
            One array per wire input, keyed by input name, dtypes as in ``spec.wire_form(form).inputs``;
            ``user_id`` and ``user_seq`` too when the rows carry them (:meth:`user_state_wire`).
        """
        wire_rows = self.with_labels(np.zeros(len(self), np.float32)).to_wire(spec, form)
        return {
            **{
                wire.name: np.ascontiguousarray(wire_rows[wire.name], dtype=NUMPY_DTYPES[wire.dtype])
                for wire in spec.wire_form(form).inputs
            },
            **self.user_state_wire(spec),
        }

    def user_runs(self, spec: ModelSpec) -> list[slice]:
        """Consecutive rows of one user (``[inputs] user``) that share every sequence and profile column.

        Such rows are one candidate list: the same user at the same moment. A row whose user,
        sequences or profile (``[inputs] profile``) differ from the row before starts a new run;
        without ``[inputs] user`` every row is its own run.
        """
        rows = len(self)
        if not spec.inputs.user or rows == 0:
            return [slice(i, i + 1) for i in range(rows)]
        changed = np.zeros(rows, dtype=bool)
        raw, numeric = spec.categorical.columns, spec.numeric_columns
        for name in spec.profile_columns:  # the user column among them
            if name in raw:
                columns = [self.categorical[:, raw.index(name)]]
            else:
                j = numeric.index(name)
                columns = [self.dense[:, j], self.dense_missing[:, j]]
            for values in columns:
                changed[1:] |= values[1:] != values[:-1]
        changed[0] = True
        for group in spec.attention_groups:
            lengths = self.lengths_of(group.length_input)
            changed[1:] |= lengths[1:] != lengths[:-1]
        for sequence in spec.sequences:
            ids = self.sequence(sequence.name)
            changed[1:] |= (ids[1:] != ids[:-1]).any(axis=1)
        starts = [*np.flatnonzero(changed).tolist(), rows]
        return [slice(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)]

    def user_of(self, spec: ModelSpec, row: int) -> dict[str, np.ndarray]:
        """The sequences of one row by name: the user context of a candidate list."""
        context = {}
        for group in spec.attention_groups:
            length = int(self.lengths_of(group.length_input)[row])
            context.update({s.name: self.sequence(s.name)[row, :length] for s in group.sequences})
        return context

    def to_wire(self, spec: ModelSpec, form: str = BYTES_WIRE) -> dict[str, np.ndarray]:
        """Request tensors of the spec's ensemble for these rows (history width = longest row).

        ``form``: ``bytes`` (the values as text) or ``ids`` (parsed and hashed by the value codec).

        Raises:
            InvalidInput: ``ids``, and a value is not of its column's type.
        """
        values = {
            NUMERIC_INPUT: self.dense.astype(np.float32),
            spec.dense_missing_input: self.dense_missing.astype(bool),
            spec.categorical.name: self.categorical[:, list(spec.categorical.wire_columns)],
        }
        for i in spec.categorical.list_columns:
            column = spec.categorical.raw_columns[i]
            values[column.name] = split_list(self.categorical[:, i], column)
        for target in spec.targets:
            values[target.name] = self.target_ids(target.name)[:, None]
        for group in spec.attention_groups:
            lengths = self.lengths_of(group.length_input)
            width = max(int(lengths.max(initial=0)), 1)
            for sequence in group.sequences:
                values[sequence.name] = np.ascontiguousarray(
                    self.sequence(sequence.name)[:, :width], dtype=np.int64
                )
            values[group.length_input] = lengths.astype(np.int32)[:, None]
        wire = {tensor.name: values[tensor.name] for tensor in spec.wire_inputs()}
        wire = ids_from_bytes(spec, wire) if check_form(form) == IDS_WIRE else wire
        return {**wire, **self.user_state_wire(spec)}
