"""The online merge in the lookup step: states into history keys, today's rows untouched, outcomes."""

import numpy as np
import pytest

from recserve.backends.features.hashing import keys_for, table_salt
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.steps.keyed_states import KeyedState
from recserve.backends.steps.stateful_lookup import UserStateCounts
from recserve.backends.steps.user_history import RowStates, UserHistories
from recserve.backends.store.user_state.builder import UserStateBuilder
from recserve.backends.store.user_state.groups import Budget
from recserve.backends.store.user_state.index import EXPIRED, FRESH, REFRESH, StateCache
from recserve.backends.store.user_state.rebuilds import FileRebuilds, RebuildQueue
from recserve.backends.store.user_state.state import EXACT, UserState
from recserve.backends.store.user_state.states import LocalUserStates, StateFetch
from recserve.backends.store.user_state.tokens import dedup
from recserve.build.step_tensors import request_inputs, step_io
from recserve.core.contract import dense_net_inputs, left_padded_inputs, sequence_inputs
from recserve.core.names import (
    EMBEDDING_LOOKUP,
    HISTORY_KEYS,
    HISTORY_LOG_WEIGHTS,
    HISTORY_MASK,
    USER_ID,
    USER_SEQ,
)
from recserve.core.spec.parse import parse_spec
from recserve.errors import InvalidInput
from tests.unit.helpers import USER_TAIL, ctr_spec_document, user_rows, user_state_spec

TAIL = USER_TAIL
SPEC = user_state_spec()


def _rows(rows, seed, users, newest, tail_items):
    return user_rows(SPEC, rows, seed, users, newest, tail_items)


def _histories(tmp_path, rebuilds=None):
    states = LocalUserStates(tmp_path / "states.sqlite", ttl_s=60, max_tokens=SPEC.user_state.tokens)
    return UserHistories(SPEC, states, rebuilds), states


def test_without_the_section_nothing_changes_in_the_contract_or_the_wire():
    plain = parse_spec(ctr_spec_document())
    assert HISTORY_LOG_WEIGHTS not in dense_net_inputs(plain) + sequence_inputs(plain)
    assert USER_ID not in {t.name for t in request_inputs(plain)}
    assert dense_net_inputs(SPEC) == (*dense_net_inputs(plain), HISTORY_LOG_WEIGHTS)
    assert HISTORY_LOG_WEIGHTS in sequence_inputs(SPEC) and HISTORY_LOG_WEIGHTS not in left_padded_inputs(
        SPEC
    )
    wire = {t.name: t for t in step_io(SPEC)[EMBEDDING_LOOKUP][0]}
    assert wire[USER_ID].optional and wire[USER_SEQ].optional and wire[USER_ID].dtype == "INT64"


def test_rows_without_a_user_keep_todays_keys_with_zero_log_weights(tmp_path):
    histories, _ = _histories(tmp_path)
    wire = _rows(3, 1, None, None, [[5, 6, 5], [], [7]])
    today = FeatureTransform(SPEC).transform(wire)
    features = FeatureTransform(SPEC).transform(wire)
    rows = histories.apply(wire, features)
    assert np.array_equal(features[HISTORY_KEYS], today[HISTORY_KEYS])
    assert np.array_equal(features[HISTORY_MASK], today[HISTORY_MASK])
    assert not features[HISTORY_LOG_WEIGHTS].any() and features[HISTORY_LOG_WEIGHTS].shape == (3, 8)
    assert list(rows.outcomes) == ["", "", ""]


def test_a_hit_serves_the_state_merged_with_the_tail_and_a_miss_serves_its_tail_as_today(tmp_path):
    rebuilds = RebuildQueue(FileRebuilds(tmp_path / "events.jsonl.rebuild"), flush_s=3600)
    histories, states = _histories(tmp_path, rebuilds)
    rng = np.random.default_rng(3)
    events = rng.integers(1, 60, 600)  # user 11's events 1..600; the state holds 1..590
    states.put(11, UserState(590, EXACT, dedup(events[:590])))
    tails = [events[-TAIL:], [4, 4, 9]]  # user 11's tail overlaps the state by 6 events; user 12 has none
    wire = _rows(2, 2, [11, 12], [600, 3], tails)
    today = FeatureTransform(SPEC).transform(wire)
    features = FeatureTransform(SPEC).transform(wire)
    rows = histories.apply(wire, features)
    assert list(rows.outcomes) == ["hit", "miss"] and rows.state_seq.tolist() == [590, -1]
    assert rows.lag_events.tolist() == [10, -1] and list(rows.modes) == [EXACT, ""]
    full = dedup(events)
    n = len(full)
    width = features[HISTORY_KEYS].shape[1]
    assert width == SPEC.sequence_bucket(n)
    salt = table_salt(SPEC.hashing.namespace, SPEC.sequences[0].table)
    assert np.array_equal(features[HISTORY_KEYS][0, :n], keys_for(full.items.astype(np.uint64), salt))
    assert np.array_equal(features[HISTORY_MASK][0], (np.arange(width) < n).astype(np.float32))
    assert np.allclose(features[HISTORY_LOG_WEIGHTS][0, :n], np.log(full.counts))
    assert not features[HISTORY_LOG_WEIGHTS][0, n:].any() and not features[HISTORY_LOG_WEIGHTS][1].any()
    # the miss: today's keys and mask (padded with today's padding key), zero weights
    old = today[HISTORY_KEYS].shape[1]
    assert np.array_equal(features[HISTORY_KEYS][1, :old], today[HISTORY_KEYS][1])
    assert (features[HISTORY_KEYS][1, old:] == today[HISTORY_KEYS][1, -1]).all()
    assert np.array_equal(features[HISTORY_MASK][1, :old], today[HISTORY_MASK][1])
    assert rebuilds.flush() == 1 and FileRebuilds(tmp_path / "events.jsonl.rebuild").take().tolist() == [12]


def test_a_history_padded_on_the_left_gets_its_merged_tokens_at_its_last_positions(tmp_path):
    spec = user_state_spec("left")
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=60, max_tokens=96)
    events = np.random.default_rng(8).integers(1, 40, 300)
    states.put(4, UserState(295, EXACT, dedup(events[:295])))
    wire = _rows(2, 9, [4, 5], [300, 2], [events[-TAIL:], [6, 7]])
    features = FeatureTransform(spec).transform(wire)
    rows = UserHistories(spec, states).apply(wire, features)
    assert list(rows.outcomes) == ["hit", "miss"]
    full, width = dedup(events), features[HISTORY_KEYS].shape[1]
    salt = table_salt(spec.hashing.namespace, spec.sequences[0].table)
    n = len(full)
    assert np.array_equal(
        features[HISTORY_KEYS][0, width - n :], keys_for(full.items.astype(np.uint64), salt)
    )
    assert np.array_equal(features[HISTORY_MASK][0], (np.arange(width) >= width - n).astype(np.float32))
    assert np.allclose(features[HISTORY_LOG_WEIGHTS][0, width - n :], np.log(full.counts))
    tail_keys = keys_for(np.array([6, 7], np.uint64), salt)
    assert np.array_equal(features[HISTORY_KEYS][1, -2:], tail_keys) and features[HISTORY_MASK][1].sum() == 2


def test_a_gap_serves_state_and_tail_and_asks_for_a_rebuild(tmp_path):
    rebuilds = RebuildQueue(FileRebuilds(tmp_path / "r"), flush_s=3600)
    histories, states = _histories(tmp_path, rebuilds)
    states.put(5, UserState(100, EXACT, dedup(np.arange(1, 11))))
    wire = _rows(1, 3, [5], [200], [[3, 3, 50]])
    features = FeatureTransform(SPEC).transform(wire)
    rows = histories.apply(wire, features)
    assert list(rows.outcomes) == ["gap"] and rows.lag_events.tolist() == [100]
    assert features[HISTORY_MASK][0].sum() == 11  # 1..10 and 50
    assert rebuilds.flush() == 1


def test_a_failing_store_serves_the_tail_alone_counted_as_error_without_a_rebuild(tmp_path):
    class Failing:
        def fetch(self, users, known=()):
            return StateFetch([None] * users.size, ["error"] * users.size)

    rebuilds = RebuildQueue(FileRebuilds(tmp_path / "r"), flush_s=3600)
    histories = UserHistories(SPEC, Failing(), rebuilds)
    wire = _rows(2, 4, [1, 1], [5, 9], [[1, 2], [3]])
    features = FeatureTransform(SPEC).transform(wire)
    today = FeatureTransform(SPEC).transform(wire)
    rows = histories.apply(wire, features)
    assert list(rows.outcomes) == ["error", "error"] and rebuilds.flush() == 0
    assert np.array_equal(features[HISTORY_KEYS], today[HISTORY_KEYS])
    counts = UserStateCounts()
    counts.record(rows)
    totals = {s.labels: s.value for s in counts.samples() if s.name == "recserve_user_state_total"}
    assert totals[(("outcome", "error"),)] == 2 and totals[(("outcome", "hit"),)] == 0


def test_a_users_state_is_fetched_once_per_batch_and_then_cached_while_it_leaves_no_gap(tmp_path):
    histories, states = _histories(tmp_path)
    states.put(7, UserState(50, EXACT, dedup(np.arange(1, 51))))
    fetched = []
    fetch = histories.states.fetch
    histories.states.fetch = lambda users, known=(): fetched.append(users.tolist()) or fetch(users, known)
    for newest in (51, 52, 53):  # tails of 2 events: 53 needs event 51, which the state lacks
        wire = _rows(2, 5, [7, 7], [newest, newest], [[1, 2], [3, 4]])
        histories.apply(wire, FeatureTransform(SPEC).transform(wire))
    assert fetched == [[7], [7]]  # the second request used the cache; the third fetched again


def test_a_state_cache_forgets_after_its_ttl_and_beyond_its_capacity():
    now = [0.0]
    cache = StateCache(capacity=2, ttl_s=1.0, clock=lambda: now[0])
    state = UserState(1, EXACT, dedup(np.array([1])))
    for user in (1, 2, 3):
        cache.put(user, state)
    assert cache.peek(1) == (None, EXPIRED) and cache.peek(3) == (state, FRESH)
    now[0] = 2.0
    assert cache.peek(3) == (state, REFRESH)
    now[0] = 2.01
    assert cache.peek(3) == (state, EXPIRED)
    cache.remove(3)
    assert cache.peek(3) == (None, EXPIRED)


@pytest.mark.parametrize(
    ("change", "name", "match"),
    [
        ({"length": TAIL + 1}, "history_length", f"at most \\[user_state\\] tail = {TAIL}"),
        ({"newest": 1}, USER_SEQ, "below its history's 2 events"),
        ({"drop": USER_SEQ}, USER_SEQ, "required but missing"),
    ],
)
def test_a_bad_user_input_is_refused_naming_it(tmp_path, change, name, match):
    histories, _ = _histories(tmp_path)
    length = change.get("length", 2)
    wire = _rows(1, 6, [3], [change.get("newest", 40)], [list(range(1, length + 1))])
    wire.pop(change.get("drop", ""), None)
    features = FeatureTransform(SPEC).transform(wire) if length <= 128 else None
    with pytest.raises(InvalidInput, match=match) as raised:
        histories.apply(wire, features)
    assert raised.value.input_name.startswith(name.split("_")[0])


def test_the_builder_rebuilds_the_users_the_servers_queue(tmp_path):
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=60, max_tokens=96)
    builder = UserStateBuilder(
        states, Budget(96, 64, 0.5), lambda items: np.zeros((len(items), 2)), 4096, 0.0
    )
    from recserve.backends.store.user_state.events import Events

    builder.ingest(Events.of([(1, 1, 5, 0.0), (1, 2, 6, 0.0)]))
    builder.flush()
    states.delete(1)  # the state expired, say
    assert builder.request_rebuilds(np.array([1, 99])) == 1
    builder.flush()
    assert states.fetch(np.array([1])).outcomes == ["found"]
    assert builder.report.rebuild_requests == 2 and builder.report.unknown_requests == 1


def test_explain_shows_each_rows_state_sequence_number_and_mode_first(tmp_path):
    from itertools import islice

    from recserve.backends.steps.explain import explain

    _, states = _histories(tmp_path)
    states.put(11, UserState(590, EXACT, dedup(np.arange(1, 41))))
    wire = _rows(2, 7, [11, 12], [600, 3], [list(range(30, 46)), [4, 4, 9]])
    records = list(islice(explain(SPEC, None, wire, user_states=states), 2))  # before any store lookup
    assert [r["feature"] for r in records] == ["user_state", "user_state"]
    first, second = (r["value"] for r in records)
    assert (first["seq"], first["mode"], first["outcome"], first["lag_events"]) == (590, EXACT, "hit", 10)
    assert first["tokens"] == 45 and records[0]["tier"] == "state"
    assert (second["seq"], second["mode"], second["outcome"], second["tokens"]) == (-1, "", "miss", 3)


def test_states_keyed_together_are_keyed_as_each_alone():
    from recserve.backends.store.user_state.state import CLUSTERED
    from recserve.backends.store.user_state.tokens import Tokens

    salt = table_salt("recserve", "items")
    states = [
        UserState(9, EXACT, dedup(np.array([4, 5, 4, 6]))),
        UserState(3, CLUSTERED, Tokens.empty()),
        UserState(70, EXACT, dedup(np.arange(1, 40))),
    ]
    together = KeyedState.many(states, [salt])
    for state, keyed in zip(states, together, strict=True):
        (alone,) = KeyedState.many([state], [salt])
        assert keyed.state is state and keyed.mode == alone.mode and keyed.keyed.seq == state.seq
        assert keyed.keyed.tokens.equals(alone.keyed.tokens)
        assert np.array_equal(keyed.keyed.tokens.items, keys_for(state.tokens.items.astype(np.uint64), salt))
        assert keyed.keyed.entry[2] == len(state.tokens)  # contiguous: the compiled merge takes it
    assert [k.mode for k in together] == [0, 1, 0]


def test_the_counts_take_each_rows_outcome_mode_and_lag_and_leave_rows_without_a_user_out():
    counts = UserStateCounts()
    # hit (exact, lag 0), gap (clustered, lag 100), miss, a row without a user, hit (exact, lag 3)
    counts.record(
        RowStates(
            *(
                np.array(c)
                for c in ([0, 3, 1, -1, 0], [5, 9, -1, -1, 7], [0, 1, -1, -1, 0], [0, 100, -1, -1, 3])
            )
        )
    )
    counts.record(RowStates.without_users(4))
    samples = {(s.name, s.labels): s.value for s in counts.samples()}
    outcomes = {k[1][0][1]: v for k, v in samples.items() if k[0] == "recserve_user_state_total"}
    assert outcomes == {"hit": 2, "miss": 1, "stale": 0, "gap": 1, "error": 0}
    modes = {k[1][0][1]: v for k, v in samples.items() if k[0] == "recserve_user_state_mode_total"}
    assert modes == {"exact": 2, "clustered": 1}
    buckets = {k[1][0][1]: v for k, v in samples.items() if k[0] == "recserve_user_state_lag_events_bucket"}
    assert buckets["0"] == 1 and buckets["2"] == 1 and buckets["4"] == 2 and buckets["64"] == 2
    assert buckets["128"] == 3 and buckets["+Inf"] == 3
    assert samples[("recserve_user_state_lag_events_sum", ())] == 103.0
    assert samples[("recserve_user_state_lag_events_count", ())] == 3.0


def _aligned_spec():
    """The ctr spec with each behaviour's category aligned to its item, and ``[user_state]`` on."""
    doc = ctr_spec_document()
    doc["features"] += [
        {"name": "history_cates", "kind": "sequence", "table": "cate", "positions": "history_items"},
        {"name": "target_cate", "kind": "categorical", "value_type": "int64", "table": "cate",
         "attends": "history_cates"},
    ]  # fmt: skip
    doc["tables"]["cate"] = {"dim": doc["model"]["embedding_dim"], "cardinality": 100}
    doc["user_state"] = {"enabled": True, "tokens": 96, "exact_tokens": 64, "tail": USER_TAIL}
    return parse_spec(doc)


def test_aligned_sequences_merge_as_item_and_attribute_tuples(tmp_path):
    """A token is an (item, category) tuple: the same item in another category is another token."""
    from recserve.backends.store.user_state.groups import build_state

    spec = _aligned_spec()
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=60, max_tokens=96, attributes=1)
    rng = np.random.default_rng(4)
    items, cates = rng.integers(1, 30, 300), rng.integers(0, 3, 300)
    budget = Budget(96, 64, 0.5)
    built = build_state(
        items[:290], 290, budget, lambda ids: ids[:, None] * 1.0, attributes=cates[:290, None]
    )
    states.put(5, built.state)
    wire = user_rows(spec, 2, 6, [5, 6], [300, 3], [items[-TAIL:], [3, 3, 8]])
    wire["history_cates"] = np.zeros_like(wire["history_items"])
    wire["history_cates"][0, :TAIL] = cates[-TAIL:]
    wire["history_cates"][1, :3] = [1, 2, 1]
    features = FeatureTransform(spec).transform(wire)
    rows = UserHistories(spec, states).apply(wire, features)
    assert list(rows.outcomes) == ["hit", "miss"]
    everything = build_state(
        items, 300, budget, lambda ids: ids[:, None] * 1.0, attributes=cates[:, None]
    ).state
    n, width = len(everything.tokens), features[HISTORY_MASK].shape[1]
    assert n > len(np.unique(items))  # some item in two categories: two tokens
    keys = features[HISTORY_KEYS]
    salts = [table_salt(spec.hashing.namespace, t) for t in ("item", "cate")]
    assert np.array_equal(keys[0, :n], keys_for(everything.tokens.items.astype(np.uint64), salts[0]))
    assert np.array_equal(
        keys[0, width : width + n], keys_for(everything.attribute_array[:, 0].astype(np.uint64), salts[1])
    )
    assert np.allclose(features[HISTORY_LOG_WEIGHTS][0, :n], np.log(everything.tokens.counts))
    # the miss keeps its tail as sent, in both sequences
    assert np.array_equal(keys[1, :3], keys_for(np.array([3, 3, 8], np.uint64), salts[0]))
    assert np.array_equal(keys[1, width : width + 3], keys_for(np.array([1, 2, 1], np.uint64), salts[1]))
    assert features[HISTORY_MASK][1].sum() == 3
    # a stored state without the attribute columns this spec keeps is a stale value, not an error
    plain = LocalUserStates(tmp_path / "s.sqlite", ttl_s=60, max_tokens=96)
    assert plain.fetch(np.array([5])).outcomes == ["bad_value"]
