"""What a state costs in accuracy, in process with PyTorch: exact mode's error and clustered mode's.

Every figure compares probabilities of the same rows under the built network:

* the full-length attention over each user's whole 4,096-event history (the reference);
* a state built from all but the newest events, merged with the request's real-time tail, its
  tokens attended with their log-weights (what the served step hands the dense step);
* truncation to the newest 256 events (what today's wire carries).

``exact``: users whose distinct items fit the budget, so their states are exact: the largest
``|Δp|`` against the reference is ``longseq_exact_max_abs``. ``clustered``: the synthetic long
users (thousands of distinct items, so their older items are grouped): per-row ``|Δp|`` p50, p99
and max against the reference and against truncation, and the held-out AUC of each on the users'
labels (the spec's click rule over the whole history). These are measurements, not bounds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recserve.backends.features.hashing import keys_for, table_salt
from recserve.backends.steps.user_state_keys import RepositoryKeySpace
from recserve.backends.store.user_state.groups import Budget, build_state
from recserve.backends.store.user_state.state import CLUSTERED, EXACT
from recserve.backends.store.user_state.tokens import Tokens, merge
from recserve.build.repository import load_reference_net, reference_pipeline
from recserve.build.synthetic import generate
from recserve.build.synthetic_users import LongUsers
from recserve.core.contract import attention_inputs
from recserve.core.names import HISTORY_LOG_WEIGHTS, USER_ID, USER_SEQ
from recserve.core.ranking import roc_auc
from recserve.core.spec.model import ModelSpec

#: Today's longest history: what truncation keeps.
TRUNCATED = 256
#: Events of a user newer than its state (in the request's tail only).
FRESH_EVENTS = 8
#: Rows scored per PyTorch call.
CHUNK = 32


class Scorer:
    """The built network's probabilities for rows whose first history is given as tokens."""

    def __init__(self, spec: ModelSpec, repository: Path) -> None:
        self.spec = spec
        self.pipeline = reference_pipeline(spec, repository, runtime="torch")
        self.net = load_reference_net(spec, repository)
        self.group = attention_inputs(spec)[0]
        table = spec.sequences[0].table
        self.store = self.pipeline.lookup.store
        self.salt, self.table_id = table_salt(spec.hashing.namespace, table), self.store.table_id(table)

    def vectors(self, items: np.ndarray) -> np.ndarray:
        """The served embedding rows of item ids ``items``, ``[n, dim]``."""
        keys = keys_for(np.asarray(items, np.int64).astype(np.uint64), self.salt)
        ids = np.full(keys.size, self.table_id, np.int16)
        return self.store.lookup(keys, ids, record=False).vectors[:, : self.spec.model.embedding_dim]

    def score(self, wire: dict[str, np.ndarray], histories: list[Tokens]) -> np.ndarray:
        """Probabilities of the rows of ``wire`` with ``histories`` as their first history."""
        plain = {k: v for k, v in wire.items() if k not in (USER_ID, USER_SEQ)}
        named = {k: torch.from_numpy(np.asarray(v)) for k, v in self.pipeline.embeddings(plain).items()}
        width = max(max(len(t) for t in histories), 1)
        history = np.zeros((len(histories), width, self.spec.model.embedding_dim), np.float32)
        mask = np.zeros((len(histories), width), np.float32)
        weights = np.zeros((len(histories), width), np.float32)
        for r, tokens in enumerate(histories):
            n = len(tokens)
            if n:
                history[r, :n] = self.vectors(tokens.items)
                mask[r, :n], weights[r, :n] = 1.0, tokens.log_weights()
        named[self.group.history] = torch.from_numpy(history)
        named[self.group.mask] = torch.from_numpy(mask)
        named[HISTORY_LOG_WEIGHTS] = torch.from_numpy(weights)
        with torch.no_grad():
            return self.net.score(named).numpy().reshape(-1).astype(np.float64)


def _chunks(count: int) -> Iterator[slice]:
    for start in range(0, count, CHUNK):
        yield slice(start, min(start + CHUNK, count))


def _events_as_tokens(events: np.ndarray) -> Tokens:
    """Every event its own token (count 1): the full-length attention, position by position."""
    return Tokens(np.asarray(events, np.int64), np.ones(events.size, np.int64))


def _state_tokens(
    events: np.ndarray, budget: Budget, keys: RepositoryKeySpace, tail: int
) -> tuple[Tokens, str]:
    """A state of all but the newest events merged with the newest ``tail`` events; and its mode."""
    built = build_state(events[:-FRESH_EVENTS], events.size - FRESH_EVENTS, budget, keys, keys.versions)
    merged = merge(built.state.tokens, built.state.seq, events[-tail:], int(events.size))
    return merged.tokens, built.state.mode


def compare(
    scorer: Scorer, wire: dict[str, np.ndarray], users: list[np.ndarray], keys: RepositoryKeySpace
) -> dict[str, Any]:
    """The full-length, state-plus-tail and truncated probabilities of rows whose events are ``users``."""
    section = scorer.spec.user_state
    budget = Budget(section.tokens, section.exact_tokens, section.group_radius)
    full, state, truncated, modes = [], [], [], []
    for part in _chunks(len(users)):
        rows = {k: v[part] for k, v in wire.items()}
        events = users[part]
        merged = [_state_tokens(e, budget, keys, section.tail) for e in events]
        modes += [mode for _, mode in merged]
        full.append(scorer.score(rows, [_events_as_tokens(e) for e in events]))
        state.append(scorer.score(rows, [tokens for tokens, _ in merged]))
        truncated.append(scorer.score(rows, [_events_as_tokens(e[-TRUNCATED:]) for e in events]))
    return {
        "full": np.concatenate(full),
        "state": np.concatenate(state),
        "truncated": np.concatenate(truncated),
        "modes": modes,
    }


def _spread(delta: np.ndarray) -> dict[str, float]:
    p50, p99 = np.percentile(delta, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "max": float(delta.max(initial=0.0))}


def exact_users(spec: ModelSpec, count: int, distinct: int, events: int, seed: int) -> list[np.ndarray]:
    """``count`` users of ``events`` events over ``distinct`` items each (Zipf): their states are exact."""
    rng = np.random.default_rng(seed)
    cardinality = spec.tables[spec.sequences[0].table].cardinality or 1000
    users = []
    for _ in range(count):
        items = rng.choice(np.arange(1, cardinality), distinct, replace=False)
        users.append(items[np.minimum(rng.zipf(1.3, events) - 1, distinct - 1)].astype(np.int64))
    return users


def measure_error(
    spec: ModelSpec, repository: Path, long: LongUsers, exact_count: int, seed: int = 29
) -> dict[str, Any]:
    """Exact mode's largest error and clustered mode's measured error (see the module docstring).

    Args:
        spec: the bench-local spec (``[user_state]`` on) its repository was built with.
        repository: the built repository.
        long: held-out synthetic long users (their states are mostly clustered), with labels.
        exact_count: how many users with exact states to score.
        seed: of the exact users' events.
    """
    scorer = Scorer(spec, repository)
    keys = RepositoryKeySpace.load(spec, repository, spec.version)
    distinct = min(spec.user_state.tokens - spec.user_state.tail, 120)
    exact_events = exact_users(spec, exact_count, distinct, int(long.rows.history.shape[1]), seed)
    exact_wire = generate(spec, exact_count, seed).to_wire(spec)
    exact = compare(scorer, exact_wire, exact_events, keys)
    users = [long.events(i) for i in range(len(long.rows))]
    clustered = compare(scorer, long.wire(spec, tail=1), users, keys)
    labels = long.rows.label_values()
    full, state, truncated = clustered["full"], clustered["state"], clustered["truncated"]
    grouped = np.asarray([m == CLUSTERED for m in clustered["modes"]])
    return {
        "longseq_exact_max_abs": float(np.abs(exact["state"] - exact["full"]).max()),
        "exact_users": exact_count,
        "exact_share": float(np.mean([m == EXACT for m in exact["modes"]])),
        "exact_truncated_max_abs": float(np.abs(exact["truncated"] - exact["full"]).max()),
        "clustered": {
            "users": len(users),
            "clustered_share": float(grouped.mean()) if grouped.size else 0.0,
            "state_vs_full": _spread(np.abs(state - full)),
            "truncated_vs_full": _spread(np.abs(truncated - full)),
            "state_vs_truncated": _spread(np.abs(state - truncated)),
            "auc": {
                "full": roc_auc(labels, full),
                "state": roc_auc(labels, state),
                "truncated": roc_auc(labels, truncated),
            },
        },
    }
