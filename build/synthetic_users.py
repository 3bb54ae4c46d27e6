"""Synthetic long users: up to ``[user_state] max_events`` behaviour events each, with the same click rule.

The rows come from :func:`~recserve.build.synthetic.generate` run on the spec with its first sequence
allowed ``max_events`` events (``mean_events`` on average), so the label follows the spec's one rule:
the share of the user's whole history in the target's item cluster raises the click logit. Each row
is one user; its history is the user's event log (sequence numbers 1..n), of which a request sends
the newest ``[user_state] tail`` events with ``user_id`` and ``user_seq``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from recserve.backends.store.user_state.events import Events
from recserve.build.synthetic import generate
from recserve.core.names import USER_ID, USER_SEQ
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec


@dataclass(frozen=True)
class LongUsers:
    """One row per user, with the user's whole history; the first user's id is ``first_user``."""

    spec: ModelSpec  # the spec with the long sequence (for the rows' full histories)
    rows: Rows
    first_user: int = 1

    @property
    def users(self) -> np.ndarray:
        """The users' ids, int64 ``[N]``."""
        return np.arange(self.first_user, self.first_user + len(self.rows.lengths), dtype=np.int64)

    def events(self, user: int) -> np.ndarray:
        """The items of row ``user``'s events (its index among the rows), oldest first."""
        return self.rows.history[user, : self.rows.lengths[user]].astype(np.int64)

    @property
    def attribute_names(self) -> tuple[str, ...]:
        """The sequences aligned to the first (each event's attributes, by name)."""
        return tuple(s.name for s in self.spec.sequences[1:] if s.positions == self.spec.sequences[0].name)

    def event_log(self, start_ts: float = 0.0) -> Events:
        """Every user's events as the builder reads them: ``(user, seq, item, ts)``, one second apart.

        With sequences aligned to the first, each event carries their values at its position.
        """
        names = self.attribute_names
        rows = [
            (
                int(user),
                seq + 1,
                int(item),
                start_ts + seq,
                tuple(int(self.rows.side[n][index, seq]) for n in names),
            )
            for index, user in enumerate(self.users.tolist())
            for seq, item in enumerate(self.events(index).tolist())
        ]
        return Events.of(rows, len(names))

    def wire(self, served: ModelSpec, tail: int | None = None) -> dict[str, np.ndarray]:
        """Request tensors for ``served``: each user's newest ``tail`` events, ``user_id`` and ``user_seq``.

        ``tail`` defaults to ``[user_state] tail``; ``tail = 0`` sends the whole history (no user inputs).
        """
        tail = served.user_state.tail if tail is None else tail
        if tail == 0:
            return self.rows.to_wire(self.spec)
        wire = self.tail_rows(tail).to_wire(served)
        wire[USER_ID] = self.users[:, None]
        wire[USER_SEQ] = self.rows.lengths.astype(np.int64)[:, None]
        return wire

    def tail_rows(self, tail: int) -> Rows:
        """The rows with each history (and the sequences aligned to it) cut to its newest ``tail`` events."""
        lengths = self.rows.lengths.astype(np.int64)
        kept = np.minimum(lengths, tail)
        width = max(int(kept.max(initial=0)), 1)
        columns = {"": self.rows.history, **{n: self.rows.side[n] for n in self.attribute_names}}
        cut = {name: np.zeros((lengths.size, width), np.int64) for name in columns}
        for r, (n, k) in enumerate(zip(lengths.tolist(), kept.tolist(), strict=True)):
            for name, column in columns.items():
                cut[name][r, :k] = column[r, n - k : n]
        history = cut.pop("")
        side = {**self.rows.side, **cut}
        return replace(self.rows, history=history, lengths=kept.astype(np.int32), side=side)


def long_spec(spec: ModelSpec, max_events: int, mean_events: float) -> ModelSpec:
    """``spec`` with its first sequence up to ``max_events`` events long (for generating, not serving)."""
    first = replace(spec.sequences[0], max_length=max_events, mean_length=mean_events)
    return replace(spec, sequences=(first, *spec.sequences[1:]))


def long_users(
    spec: ModelSpec, users: int, seed: int, max_events: int | None = None, mean_events: float | None = None
) -> LongUsers:
    """``users`` synthetic users with up to ``max_events`` events (``[user_state] max_events``).

    Raises:
        ValueError: the spec has no sequence.
    """
    if not spec.sequences:
        raise ValueError(f"spec {spec.name!r} has no sequence: no behaviour events to generate")
    max_events = max_events or spec.user_state.max_events
    mean_events = mean_events or max_events / 2
    long = long_spec(spec, max_events, mean_events)
    return LongUsers(long, generate(long, users, seed))
