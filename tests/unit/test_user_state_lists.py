"""Candidate lists with ``[user_state]``: a list that carries its users gets their states merged.

A list's users' histories are merged once per user, and every candidate of the list gets what the
same candidate gets as a row with the same user, tail and newest event, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from recserve.backends.base import batching
from recserve.backends.steps.lookup import EmbeddingLookup
from recserve.backends.steps.stateful_lookup import StatefulFeaturesToEmbeddings
from recserve.backends.steps.user_history import UserHistories
from recserve.backends.store.user_state.state import EXACT, UserState
from recserve.backends.store.user_state.states import LocalUserStates
from recserve.backends.store.user_state.tokens import dedup
from recserve.core.names import (
    BYTES_WIRE,
    CANDIDATE_PREFIX,
    HISTORY_EMBEDDINGS,
    HISTORY_LOG_WEIGHTS,
    HISTORY_MASK,
    IDS_WIRE,
    USER_ID,
    USER_SEQ,
)
from recserve.core.spec.parse import parse_spec
from recserve.errors import InvalidInput
from tests.candidate_list_rows import served_store, user_rows
from tests.unit.helpers import ctr_spec_document

TAIL, EVENTS, USERS, CANDIDATES = 16, 400, 3, 4


def _spec(padding: str):
    doc = ctr_spec_document()
    doc["user_state"] = {"enabled": True, "tokens": 96, "exact_tokens": 64, "tail": TAIL}
    for feature in doc["features"]:
        if feature.get("kind") == "sequence":
            feature["padding"] = padding
    return parse_spec(doc)


def _case(spec, users, seed, first_user, stored, form=BYTES_WIRE):
    """One request of ``users`` users' candidates as rows and as a list, with ``user_id`` and ``user_seq``.

    Each user's newest ``TAIL`` of ``EVENTS`` events (items 1..49) is the history; ``stored`` gets
    the users' states, built up to ``EVENTS - 6`` (so the tail's newest 6 events are merged in).
    """
    rows, lists = user_rows(spec, users, CANDIDATES, seed, form)
    events = np.random.default_rng(seed).integers(1, 50, (users, EVENTS))
    for u in range(users):
        stored.put(first_user + u, UserState(EVENTS - 6, EXACT, dedup(events[u, : EVENTS - 6])))
    seq, length = spec.sequences[0].name, spec.attention_groups[0].length_input
    lists = {**lists, seq: events[:, -TAIL:], length: np.full((users, 1), TAIL, np.int32)}
    lists[USER_ID] = np.arange(first_user, first_user + users, dtype=np.int64)[:, None]
    lists[USER_SEQ] = np.full((users, 1), EVENTS, np.int64)
    rows = {**rows, **{n: np.repeat(lists[n], CANDIDATES, axis=0) for n in (seq, length, USER_ID, USER_SEQ)}}
    return rows, lists


def _step(spec, stored, requests):
    """The step over a store holding every key of ``requests`` and of items 1..49 (the states')."""
    seq, length = spec.sequences[0].name, spec.attention_groups[0].length_input
    plain = [{n: a for n, a in r.items() if n not in (USER_ID, USER_SEQ)} for r in requests]
    count = plain[0][seq].shape[0]
    probe = {
        **plain[0],
        seq: np.tile(np.arange(1, 50), (count, 1)),
        length: np.full((count, 1), 49, np.int32),
    }
    store = served_store(spec, batching.merge([*plain, probe])[0])
    return StatefulFeaturesToEmbeddings(spec, EmbeddingLookup(spec, store), UserHistories(spec, stored))


def _states(tmp_path, spec):
    return LocalUserStates(tmp_path / "states.sqlite", ttl_s=60, max_tokens=spec.user_state.tokens)


@pytest.mark.parametrize("form", [IDS_WIRE, BYTES_WIRE])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_a_list_with_users_gets_each_users_state_as_its_rows_do(padding, form, tmp_path):
    spec = _spec(padding)
    stored = _states(tmp_path, spec)
    rows, lists = _case(spec, USERS, 6, 50, stored, form)
    step = _step(spec, stored, [rows])
    expected = step(rows)
    assert np.abs(expected[HISTORY_LOG_WEIGHTS]).max() > 0.5  # the states merged: repeated items
    assert step.counts.outcomes[0] == USERS * CANDIDATES  # hits, one per row
    expanded = step.candidates(lists, expand=True)
    assert set(expanded) == set(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(expanded[name], array, err_msg=name)
    listed = step.candidates(lists)
    assert step.counts.outcomes[0] == USERS * CANDIDATES + 2 * USERS  # a list counts its users
    owners = np.repeat(np.arange(USERS), CANDIDATES)
    for name in (HISTORY_EMBEDDINGS, HISTORY_MASK, HISTORY_LOG_WEIGHTS):
        assert listed[name].shape[0] == USERS
        np.testing.assert_array_equal(listed[name][owners], expected[name], err_msg=name)
    embeddings = listed[CANDIDATE_PREFIX + "sparse_embeddings"]
    np.testing.assert_array_equal(
        embeddings.reshape(expected["sparse_embeddings"].shape), expected["sparse_embeddings"]
    )


def test_lists_with_and_without_users_in_one_batch_get_what_each_gets_alone(tmp_path):
    spec = _spec("right")
    stored = _states(tmp_path, spec)
    plain_rows, plain = user_rows(spec, 2, CANDIDATES, 11)
    made = [_case(spec, users, seed, first, stored) for users, seed, first in ((1, 12, 70), (2, 13, 80))]
    step = _step(spec, stored, [plain_rows, *(rows for rows, _ in made)])
    lists = [plain, *(one for _, one in made)]
    alone = [step.candidates(one) for one in lists]
    together = step.candidate_lists(lists)
    for got, expected in zip(together, alone, strict=True):
        assert set(got) == set(expected)
        for name, array in expected.items():
            np.testing.assert_array_equal(got[name], array, err_msg=name)
    assert not together[0][HISTORY_LOG_WEIGHTS].any()  # no user: today's list, zero weights
    assert together[1][HISTORY_LOG_WEIGHTS].any() and together[2][HISTORY_LOG_WEIGHTS].any()


def test_a_list_with_a_user_but_no_user_seq_is_refused_naming_it(tmp_path):
    spec = _spec("right")
    stored = _states(tmp_path, spec)
    rows, lists = _case(spec, 1, 3, 90, stored)
    del lists[USER_SEQ]
    with pytest.raises(InvalidInput, match=USER_SEQ):
        _step(spec, stored, [rows]).candidates(lists)


def test_the_step_keeps_the_refresher_out_while_it_serves_rows_and_lists(tmp_path):
    spec = _spec("right")
    stored = _states(tmp_path, spec)
    rows, lists = _case(spec, 2, 5, 60, stored)
    step = _step(spec, stored, [rows])
    refresher = step.users.refresher
    seen, lookup = [], step.lookup.lookup
    step.lookup.lookup = lambda *args, **kwargs: seen.append(refresher.busy) or lookup(*args, **kwargs)
    step(rows)
    step.candidates(lists)
    step.candidate_lists([lists])
    assert seen == [True, True, True] and not refresher.busy
    step.users.close()
