"""The online half of ``[user_state]``, inside ``embedding_lookup``: fetch, merge, tokens to keys.

A row carrying ``user_id`` and ``user_seq`` sends its history as the real-time tail (at most
``[user_state] tail`` events, the newest at ``user_seq``). The step fetches the states of the
batch's distinct users (a small local cache, then one batched store call, which for Redis runs
under ``deadline_ms`` and the breaker), merges each row's newer tail events into its user's tokens
(:func:`~recserve.backends.store.user_state.merge.merge_histories`, all rows at once) and puts the tokens'
keys in the row's history, ``ln count`` per token in ``history_log_weights``. The keys are then
looked up with every other key of the batch, in the same store call.

A batch whose every row is a fresh cached hit leaving no gap (the common case) is merged in one
compiled call (:class:`~recserve.backends.store.user_state.index.StateIndex`); the rest take the path
below, which gives the same history.

With sequences aligned to the items (their categories, say: a spec's ``positions``), a token is an
(item, attributes) tuple. The merge runs on one combined key per position
(:func:`~recserve.backends.features.hashing.combined_keys`); each sequence's keys are then put back
from the states' and the tails' own. Such batches take the path below, not the one-call merge.

Without a usable state the row keeps today's history, its tail as sent, with all-zero log-weights:
today's answer for that tail, bit for bit. Its outcome is counted (``miss``: none stored; ``stale``:
a stored value in a format this server does not take; ``error``: the store failed or timed out) and,
but for ``error``, its user is queued for a rebuild. ``gap`` (events between the state and the tail
are in neither) serves the state and the whole tail and queues a rebuild too. The long history is
never computed here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recserve.backends.base.inputs import require
from recserve.backends.features.hashing import combined_keys, missing_key, table_salt
from recserve.backends.steps.keyed_states import KeyedState, aligned_keys
from recserve.backends.store.user_state.index import FRESH, REFRESH, Refresher, StateCache, StateIndex
from recserve.backends.store.user_state.merge import Buckets, merge_histories
from recserve.backends.store.user_state.rebuilds import (
    REBUILD_FILE_SUFFIX,
    REBUILD_SET_SUFFIX,
    FileRebuilds,
    RebuildQueue,
    RebuildSink,
    RedisRebuilds,
)
from recserve.backends.store.user_state.state import MODES, UserState
from recserve.backends.store.user_state.states import (
    BAD_VALUE,
    ERROR,
    FOUND,
    RedisUserStates,
    UserStates,
    open_user_states,
)
from recserve.backends.store.user_state.tokens import GAP, HIT, MISS
from recserve.core.contract import attention_inputs
from recserve.core.names import HISTORY_KEYS, HISTORY_LOG_WEIGHTS, USER_ID, USER_SEQ
from recserve.core.spec.model import ModelSpec
from recserve.errors import ArtifactError, InvalidInput

LOGGER = logging.getLogger(__name__)

#: A row's outcome: merged (``hit``, ``gap``), or served from its tail alone (``miss``, ``stale``, ``error``).
STALE = "stale"
OUTCOMES = (HIT, MISS, STALE, GAP, ERROR)
_HIT, _MISS, _STALE, _GAP, _ERROR = range(len(OUTCOMES))  # a row's outcome as its index in OUTCOMES
_FETCHED = {FOUND: _HIT, BAD_VALUE: _STALE, ERROR: _ERROR}  # absent: MISS
_REBUILD = (_MISS, _STALE, _GAP)
_OUTCOME_NAMES = np.array([*OUTCOMES, ""], object)  # by code; -1 (no user): ""
_MODE_NAMES = np.array([*MODES, ""], object)  # by code; -1 (no state): ""
_LOWEST = -(2**63)


@dataclass(frozen=True)
class RowStates:
    """How each row of a batch met its user's state: codes (by name: :attr:`outcomes`, :attr:`modes`)."""

    outcome_codes: np.ndarray  # int64 per row: the outcome's index in OUTCOMES, -1 without a user
    state_seq: np.ndarray  # int64 per row: the merged state's sequence number, -1 without one
    mode_codes: np.ndarray  # int64 per row: the merged state's mode's index in MODES, -1 without one
    lag_events: np.ndarray  # int64 per row: the request's newest event minus the state's (-1: none)

    @classmethod
    def without_users(cls, rows: int) -> RowStates:
        """A batch whose rows carry no user."""
        return cls(*(np.full(rows, -1, np.int64) for _ in range(4)))

    @property
    def outcomes(self) -> np.ndarray:
        """Each row's outcome, one of OUTCOMES ("" without a user)."""
        return _OUTCOME_NAMES[self.outcome_codes]

    @property
    def modes(self) -> np.ndarray:
        """Each row's merged state's mode ("" without one)."""
        return _MODE_NAMES[self.mode_codes]


class UserHistories:
    """Puts users' states into a batch's history keys (see the module docstring).

    Args:
        spec: the model spec (``[user_state]`` on, one sequence and those aligned to it).
        states: the state store.
        rebuilds: where users without a usable state are queued (None: nowhere).
        cache: the local cache (None: ``[user_state] cache_users`` and ``cache_ttl_ms``, followed by a
            :class:`StateIndex` where the kernels are built).
        refresh: serve stale cached states while a thread reads them again (else read them on the
            request path once past their time to live).

    Raises:
        ArtifactError: the spec's sequences are not one group (one sequence and those aligned to it).
    """

    def __init__(
        self,
        spec: ModelSpec,
        states: UserStates,
        rebuilds: RebuildQueue | None = None,
        cache: StateCache[KeyedState] | None = None,
        refresh: bool = True,
    ) -> None:
        if len(spec.attention_groups) != 1:
            raise ArtifactError(
                f"[user_state] needs one behaviour sequence (with the sequences aligned to it); "
                f"{spec.name!r} has {len(spec.attention_groups)}"
            )
        section = spec.user_state
        self.spec, self.states, self.rebuilds = spec, states, rebuilds
        if cache is None:
            index = StateIndex.of(section.cache_users)
            cache = StateCache(section.cache_users, section.cache_ttl_ms / 1000.0, mirror=index)
        self.cache: StateCache[KeyedState] = cache
        #: where a batch of fresh hits is merged in one call (None: every batch takes the other path)
        self.index = cache.mirror if isinstance(cache.mirror, StateIndex) else None
        #: reads stale cached states again off the request path (None: no cache, or ``refresh`` off)
        self.refresher = Refresher(self._refresh) if refresh and cache.capacity > 0 else None
        self.sequence = spec.sequences[0]
        self.group = spec.attention_groups[0]
        self.mask = attention_inputs(spec)[0].mask
        self.left = self.sequence.padding == "left"
        namespace = spec.hashing.namespace
        #: the items' table's salt, then the aligned sequences' (their keys are merged together)
        self.salts = [table_salt(namespace, s.table) for s in self.group.sequences]
        self.pad_keys = [int(missing_key(namespace, s.name)) for s in self.group.sequences]
        self.pad_key = self.pad_keys[0]
        self.buckets = Buckets.of(spec.serving.sequence_buckets)
        self.room = self.buckets.width(section.tokens + section.tail, 1)  # the widest state and tail

    @staticmethod
    def mask_name(spec: ModelSpec) -> str:
        """The mask of the history a state is merged into (the first group's)."""
        return attention_inputs(spec)[0].mask

    @classmethod
    def open(cls, spec: ModelSpec, folder: Path) -> UserHistories:
        """The states and rebuild queue ``[user_state]`` names (relative paths: under ``folder``)."""
        section = spec.user_state
        states = open_user_states(section, spec.store, folder, attributes=len(spec.sequences) - 1)
        sink: RebuildSink
        if isinstance(states, RedisUserStates):
            sink = RedisRebuilds(states.client, section.event_stream + REBUILD_SET_SUFFIX)
        else:
            sink = FileRebuilds(folder / (section.event_path + REBUILD_FILE_SUFFIX))
        return cls(spec, states, RebuildQueue(sink))

    def close(self) -> None:
        """Stop the refresher, flush the rebuild queue and release the store's resources."""
        if self.refresher is not None:
            self.refresher.close()
        if self.rebuilds is not None:
            self.rebuilds.close()
        close = getattr(self.states, "close", None)
        if close is not None:
            close()

    def serving(self) -> AbstractContextManager[None]:
        """Held around a request's work in the step: stale states are read again between requests."""
        return self.refresher.serving() if self.refresher is not None else nullcontext()

    def request_users(
        self, inputs: Mapping[str, np.ndarray], rows: int
    ) -> tuple[list[int], list[int], list[int]]:
        """Each row's user and newest sequence number, and its tail length, checked.

        Plain Python lists, checked in one loop: cheaper than numpy's calls on a request path
        whose code and data are cold between requests.

        Raises:
            InvalidInput: one of them missing or not of its type and shape, ``user_seq`` below
                the tail's length, or a tail over ``[user_state] tail``.
        """
        users = require(inputs, USER_ID, "INT64", rows, 1).ravel().tolist()
        newest = require(inputs, USER_SEQ, "INT64", rows, 1).ravel().tolist()
        lengths = require(inputs, self.group.length_input, "INT32", rows, 1).ravel().tolist()
        limit = self.spec.user_state.tail
        for r, (seq, length) in enumerate(zip(newest, lengths, strict=True)):
            if length > limit:
                raise InvalidInput(
                    self.group.length_input,
                    f"row {r} is {length}; with {USER_ID} the history is the real-time tail, "
                    f"at most [user_state] tail = {limit} events",
                )
            if seq < length:
                raise InvalidInput(
                    USER_SEQ,
                    f"row {r} is {seq}, below its history's {length} events "
                    f"(the tail's events are {USER_SEQ} - length + 1 .. {USER_SEQ}, numbered from 1)",
                )
        return users, newest, lengths

    def states_of(self, users: list[int], needed: list[int]) -> tuple[list[KeyedState | None], list[int]]:
        """Each distinct user's state and outcome (its code): cached when it leaves no gap, else fetched.

        A state cached longer ago than its time to live is still served (it merges exactly while it
        leaves no gap) and read again off the request path (:class:`Refresher`); past twice that
        age it is read here. Either way it is reused as it is when the store holds the same bytes.

        Args:
            users: distinct users.
            needed: per user, the lowest state sequence number that leaves none of its rows a gap.
        """
        states: list[KeyedState | None] = [None] * len(users)
        outcomes = [_MISS] * len(users)
        todo, known, again = [], [], []
        servable = (FRESH, REFRESH) if self.refresher is not None else (FRESH,)
        for i, (user, lowest) in enumerate(zip(users, needed, strict=True)):
            cached, age = self.cache.peek(user)
            if cached is not None and age in servable and cached.state.seq >= lowest:
                states[i], outcomes[i] = cached, _HIT
                if age == REFRESH:
                    again.append(user)
            else:
                todo.append(i)
                known.append(cached)
        if again and self.refresher is not None:
            self.refresher.add(again)
        if todo:
            read, codes = self._read([users[i] for i in todo], known)
            for i, state, code in zip(todo, read, codes, strict=True):
                states[i], outcomes[i] = state, code
        return states, outcomes

    def _refresh(self, users: list[int]) -> None:
        """Read ``users``' states again into the cache (on the refresher's thread)."""
        self._read(users, [self.cache.peek(user)[0] for user in users])

    def _read(
        self, users: list[int], known: list[KeyedState | None]
    ) -> tuple[list[KeyedState | None], list[int]]:
        """``users``' states from the store (``known``: what the cache held), cached; their outcome codes.

        A state the store no longer holds, or holds in a format this server does not take, leaves
        the cache; after a store error the cached one stays.
        """
        fetched = self.states.fetch(
            np.array(users, np.int64), [k.state if k is not None else None for k in known]
        )
        states: list[KeyedState | None] = [None] * len(users)
        codes = [_FETCHED.get(outcome, _MISS) for outcome in fetched.outcomes]
        new: list[tuple[int, UserState]] = []  # the states read anew, keyed below in one call
        for i, (before, read) in enumerate(zip(known, fetched.states, strict=True)):
            if read is None:
                if codes[i] != _ERROR:
                    self.cache.remove(users[i])
            elif before is not None and before.state is read:  # the same bytes: reused as it is
                states[i] = before
            else:
                new.append((i, read))
        if new:
            for (i, _), keyed in zip(new, KeyedState.many([s for _, s in new], self.salts), strict=True):
                states[i] = keyed
        for user, state in zip(users, states, strict=True):
            if state is not None:
                self.cache.put(user, state)
        return states, codes

    def apply(self, inputs: Mapping[str, np.ndarray], features: dict[str, np.ndarray]) -> RowStates:
        """Merge the rows' users' states into ``features`` (the transform's keys), in place.

        Replaces the history keys and mask (merged rows: their tokens; the others: their own keys
        and mask, on the padding side of a history widened to the sequence bucket of the longest
        row when needed) and sets ``history_log_weights`` (zeros where no state is merged). The
        merge runs on keys: the states' (hashed when read) and the tails' (the transform's).

        Raises:
            InvalidInput: see :meth:`request_users`.
        """
        keys, mask = features[HISTORY_KEYS], features[self.mask]
        rows = mask.shape[0]
        if USER_ID not in inputs:
            features[HISTORY_LOG_WEIGHTS] = np.zeros(mask.shape, np.float32)
            return RowStates.without_users(rows)
        columns = None
        if len(self.salts) > 1:  # aligned sequences: merged on one combined key per position
            width = keys.shape[1] // len(self.salts)
            columns = [keys[:, s * width : (s + 1) * width] for s in range(len(self.salts))]
            keys = combined_keys(columns)
        elif self.index is not None:
            fast = self.index.merge(
                (inputs.get(USER_ID), inputs.get(USER_SEQ), inputs.get(self.group.length_input)),
                self.spec.user_state.tail,
                self.cache.clock(),
                self.refresher is not None,
                keys,
                mask,
                self.left,
                self.pad_key,
                self.buckets.array,
                max(self.room, keys.shape[1]),
            )
            if fast is not None:  # every row a hit
                self._served(features, *fast[:3])
                fields = fast[3]
                if self.refresher is not None and fields[:, 3].any():  # served past their freshness
                    self.refresher.add(inputs[USER_ID][fields[:, 3] == 1, 0].tolist())
                return RowStates(np.full(rows, _HIT), fields[:, 0], fields[:, 1], fields[:, 2])
        users, newest, lengths = self.request_users(inputs, rows)
        slots: dict[int, int] = {}
        where = [slots.setdefault(user, len(slots)) for user in users]
        needed = [_LOWEST] * len(slots)
        for w, seq, length in zip(where, newest, lengths, strict=True):
            needed[w] = max(needed[w], seq - length)  # the event just before the row's tail
        states, fetched = self.states_of(list(slots), needed)
        row_states = [states[w] for w in where]
        merged = merge_histories(
            [k.keyed if k is not None else None for k in row_states],
            keys,
            mask,
            lengths,
            newest,
            self.left,
            self.pad_key,
            self.buckets,
        )
        outcomes, seqs, modes = [], [], []
        for k, w, gap in zip(row_states, where, merged.gaps.tolist(), strict=True):
            if k is None:
                outcomes.append(fetched[w])
                seqs.append(-1)
                modes.append(-1)
            else:
                outcomes.append(_GAP if gap else _HIT)
                seqs.append(k.state.seq)
                modes.append(k.mode)
        if self.rebuilds is not None:
            again = [users[r] for r, outcome in enumerate(outcomes) if outcome in _REBUILD]
            if again:
                self.rebuilds.add(np.array(again, np.int64))
        served = merged.keys
        if columns is not None:
            known = [s for s in states if s is not None]
            served = aligned_keys(merged.keys, merged.mask, known, keys, mask, columns, self.pad_keys)
        self._served(features, served, merged.mask, merged.weights)
        return RowStates(np.array(outcomes), np.array(seqs), np.array(modes), merged.lag_events)

    def _served(
        self, features: dict[str, np.ndarray], keys: np.ndarray, mask: np.ndarray, weights: np.ndarray
    ) -> None:
        """The merged history in the transform's place, and its log-weights."""
        features[HISTORY_KEYS], features[self.mask], features[HISTORY_LOG_WEIGHTS] = keys, mask, weights
