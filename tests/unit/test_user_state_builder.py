"""The builder: exact while the items fit, grouped beyond; the event log; debounce, replays, lag."""

import json
import time

import numpy as np
import pytest

from recserve.backends.store.user_state.builder import Regrouping, UserStateBuilder, key_drift
from recserve.backends.store.user_state.events import Events, FileEventLog, append_events
from recserve.backends.store.user_state.groups import Budget, build_state, group_tokens
from recserve.backends.store.user_state.state import CLUSTERED, EXACT, UserState
from recserve.backends.store.user_state.states import FOUND, LocalUserStates
from recserve.backends.store.user_state.tokens import Tokens, dedup

RNG = np.random.default_rng(0)
SPACE = RNG.normal(0, 1, (5000, 4))


def key_space(items):
    return SPACE[items]


def test_a_user_whose_distinct_items_fit_is_exact():
    events = RNG.integers(1, 100, 4096)
    built = build_state(events, 4096, Budget(tokens=120, exact_tokens=100, radius=0.5), key_space, (3, 4))
    assert built.state.mode == EXACT and built.state.tokens.equals(dedup(events))
    assert (built.state.table_version, built.state.dense_version) == (3, 4)


def test_beyond_the_budget_the_newest_items_stay_exact_and_the_rest_are_grouped():
    events = RNG.integers(1, 3000, 4096)
    budget = Budget(tokens=192, exact_tokens=160, radius=1.0)
    built = build_state(events, 4096, budget, key_space)
    tokens, full = built.state.tokens, dedup(events)
    assert built.state.mode == CLUSTERED and len(tokens) == 192
    assert tokens.events == 4096  # every event is counted once
    assert tokens.equals(Tokens(np.concatenate([tokens.items[:32], full.items[-160:]]), tokens.counts))
    assert np.array_equal(tokens.counts[32:], full.counts[-160:])
    assert built.grouped_items == len(full) - 160
    assert set(tokens.items[:32].tolist()) <= set(full.items[:-160].tolist())


def test_items_within_the_radius_of_a_leader_join_it():
    space = np.array([[0.0], [0.1], [5.0], [5.2], [9.0]])
    tokens = Tokens(np.arange(5), np.array([1, 4, 2, 1, 1]))
    groups, over = group_tokens(tokens, groups=2, radius=0.5, key_space=lambda items: space[items])
    assert groups.items.tolist() == [1, 2]  # the most frequent ungrouped item leads each group
    assert groups.counts.tolist() == [5, 4]  # item 4 is over the radius of both: joins the nearest
    assert over == 1


def test_the_file_log_reads_whole_lines_from_where_it_stopped_and_skips_bad_ones(tmp_path):
    path = tmp_path / "events.jsonl"
    log = FileEventLog(path)
    assert len(log.read()) == 0
    append_events(path, Events.of([(1, 1, 10, 5.0), (2, 1, 11, 5.0)]))
    with path.open("a") as fh:
        fh.write('{"user": 1, "seq": 0, "item": 3, "ts": 1}\n')  # seq starts at 1
        fh.write("[1, 2]\nnot json\n")
        fh.write(json.dumps({"user": 1, "seq": 2, "item": -4, "ts": 1}) + "\n")
        fh.write('{"user": 1, "seq": 2, "item": 12, "ts": 6.0}\n{"user": 1, "se')  # being written
    assert log.read().rows() == [(1, 1, 10, 5.0), (2, 1, 11, 5.0), (1, 2, 12, 6.0)]
    assert log.refused == 4
    with path.open("a") as fh:
        fh.write('q": 3, "item": 13, "ts": 7.0}\n')
    assert log.read().rows() == [(1, 3, 13, 7.0)]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_builder_debounces_per_user_skips_replays_and_measures_the_lag(tmp_path):
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=600, max_tokens=8)
    clock = Clock()
    builder = UserStateBuilder(
        states, Budget(8, 6, 0.5), key_space, 100, debounce_s=0.2, clock=clock, wall=lambda: clock.now
    )
    builder.ingest(Events.of([(7, 1, 10, 99.5), (7, 2, 11, 99.9), (8, 1, 10, 100.0)]))
    assert builder.flush() == 0  # within the debounce
    clock.now += 0.1
    builder.ingest(Events.of([(7, 3, 10, 100.1), (7, 2, 11, 100.1)]))  # the last one a replay
    clock.now += 0.15
    assert builder.flush() == 2
    state = states.fetch(np.array([7])).states[0]
    assert state.seq == 3 and state.tokens.equals(dedup(np.array([10, 11, 10])))
    assert builder.report.replayed == 1 and builder.report.rebuilds == 2
    np.testing.assert_allclose(sorted(builder.report.lags_s), [0.15, 0.25, 0.35, 0.75])
    assert builder.flush(force=True) == 0


def _run_over(builder, batches):
    """``builder.run`` over ``batches`` of events, then two empty reads (the log read to its end)."""
    reads = [*batches, Events.of([]), Events.of([])]
    return builder.run(lambda: reads.pop(0) if reads else Events.of([]), stop=lambda: not reads, poll_s=0)


def test_a_stored_state_beyond_the_users_newest_event_in_the_log_is_replaced_once_the_log_is_read(
    tmp_path,
):
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=600, max_tokens=8)
    states.put(1, UserState(2**62, EXACT, dedup(np.array([666]))))  # no such event in the log
    states.put(2, UserState(5, EXACT, dedup(np.array([1, 2, 3, 4, 5]))))  # built before a restart
    builder = UserStateBuilder(states, Budget(8, 6, 0.5), key_space, 100, debounce_s=0.0)
    report = _run_over(
        builder,
        [
            Events.of([(1, 1, 7, 0.0), (2, 1, 1, 0.0), (2, 2, 2, 0.0)]),  # refused: older than stored
            Events.of([(2, s, s, 0.0) for s in range(3, 6)]),  # user 2's log reaches its state
        ],
    )
    fetched = states.fetch(np.array([1, 2])).states
    assert fetched[0].seq == 1 and fetched[0].tokens.items.tolist() == [7]
    assert fetched[1].seq == 5 and report.foreign_states == 1 and report.refused_writes == 2


def test_a_new_key_space_regroups_the_clustered_users_only(tmp_path):
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=600, max_tokens=8)
    builder = UserStateBuilder(states, Budget(8, 6, 0.5), key_space, 100, debounce_s=0.0)
    builder.ingest(Events.of([(1, s, s, 0.0) for s in range(1, 30)] + [(2, 1, 5, 0.0)]))
    builder.flush()
    assert builder.report.modes == {CLUSTERED: 1, EXACT: 1}
    assert builder.set_versions((2, 1)) == 1
    builder.flush()
    fetched = states.fetch(np.array([1, 2]))
    assert fetched.outcomes == [FOUND, FOUND] and fetched.states[0].table_version == 2


def test_the_command_builds_states_from_a_file_log_in_the_repositorys_key_space(tiny_repository, tmp_path):
    from recserve.commands.main import main

    now = time.time()
    rows = [(1, s, int(i), now) for s, i in enumerate(RNG.integers(1, 40, 300), 1)]
    rows += [(2, s, s, now) for s in range(1, 400)]  # 399 distinct items: over the 192 tokens
    append_events(tmp_path / "user_events.jsonl", Events.of(rows))
    report = tmp_path / "report.json"
    argv = ["--spec", "tiny", "user-state", "run", "--repository", str(tiny_repository)]
    assert main([*argv, "--folder", str(tmp_path), "--drain", "--json", str(report)]) == 0
    summary = json.loads(report.read_text())
    assert summary["events"] == 699 and summary["rebuilds"] == 2
    assert summary["modes"] == {EXACT: 1, CLUSTERED: 1} and summary["lag_p99_s"] > 0
    fetched = LocalUserStates(tmp_path / "user_states.sqlite", 60, 192).fetch(np.array([1, 2]))
    exact, clustered = fetched.states
    assert exact.tokens.equals(dedup(np.array([r[2] for r in rows[:300]])))
    assert clustered.mode == CLUSTERED and clustered.tokens.events == 399
    assert 160 < len(clustered.tokens) <= 192  # the newest 160 exact; items with one row share a group
    assert np.array_equal(clustered.tokens.items[-160:], np.arange(240, 400))
    assert main(["--spec", "tiny", "user-state", "delete", "--user", "2", "--folder", str(tmp_path)]) == 0


def test_a_new_key_space_regroups_only_once_the_clustered_items_keys_moved_enough(tmp_path):
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=600, max_tokens=8)
    scale = [1.0]

    def space(items):
        return SPACE[items] * scale[0]

    builder = UserStateBuilder(states, Budget(8, 6, 0.5), space, 100, debounce_s=0.0, versions=(1, 1))
    builder.ingest(Events.of([(1, s, s, 0.0) for s in range(1, 30)] + [(2, 1, 5, 0.0)]))
    builder.flush()
    regrouping = Regrouping(space, limit=0.05)
    assert regrouping.check(builder, (1, 1)) is None
    assert regrouping.items.tolist() == list(range(1, 30))  # the clustered user's items only
    scale[0] = 1.01
    assert regrouping.check(builder, (2, 1)) == pytest.approx(0.01)
    assert builder.flush() == 0 and builder.versions == (2, 1)  # new states use it; none regrouped
    scale[0] = 1.07  # small steps add up: measured against the last grouping
    assert regrouping.check(builder, (2, 2)) == pytest.approx(0.07)
    assert builder.flush() == 1
    assert states.fetch(np.array([1])).states[0].dense_version == 2
    assert regrouping.check(builder, (2, 3)) == pytest.approx(0.0)  # the new reference


def test_key_drift_is_the_median_relative_move_and_unknown_without_a_reference():
    before = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    assert key_drift(before, before * 1.1) == pytest.approx(0.1)
    assert key_drift(np.zeros((0, 0)), before) == float("inf")


def test_the_key_space_takes_the_newest_dense_version_with_a_key_projection_of_its_shape(tmp_path):
    from safetensors.numpy import save_file

    from recserve.backends.steps.user_state_keys import KEY_BIAS, KEY_WEIGHT, WEIGHTS_FILE, RepositoryKeySpace

    def write(version, weight):
        (tmp_path / "dense" / str(version)).mkdir(parents=True)
        save_file({KEY_WEIGHT: weight, KEY_BIAS: np.zeros(weight.shape[0], np.float32)},
                  str(tmp_path / "dense" / str(version) / WEIGHTS_FILE))  # fmt: skip

    write(2, np.full((4, 3), 2.0, np.float32))
    write(3, np.ones((5, 3), np.float32))  # another network: passed over
    (tmp_path / "dense" / "4").mkdir()  # being written: no weights yet
    space = RepositoryKeySpace(None, "item", np.uint64(1), np.ones((4, 3), np.float32), np.zeros(4), 1)
    assert space.newer_dense(tmp_path) and space.dense_version == 2 and space.weight[0, 0] == 2.0
    assert not space.newer_dense(tmp_path)


def test_events_with_attributes_build_tuple_tokens_and_string_users_read_as_their_keys(tmp_path):
    """Aligned sequences: an event's category travels with it, and the same item in two categories
    is two tokens; a string user is its ``user_key``; an event without its attribute is refused."""
    from recserve.core.user_state_wire import user_key

    path = tmp_path / "events.jsonl"
    lines = [
        {"user": "u-1", "seq": 1, "item": 5, "ts": 0.0, "cate": 2},
        {"user": "u-1", "seq": 2, "item": 5, "ts": 0.0, "cate": 3},
        {"user": "u-1", "seq": 3, "item": 5, "ts": 0.0, "cate": 2},
        {"user": "u-1", "seq": 4, "item": 6, "ts": 0.0},  # no category: refused
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    log = FileEventLog(path, attributes=("cate",))
    events = log.read()
    assert log.refused == 1 and events.users.tolist() == [user_key("u-1")] * 3
    states = LocalUserStates(tmp_path / "s.sqlite", ttl_s=60, max_tokens=8, attributes=1)
    builder = UserStateBuilder(states, Budget(8, 4, 0.5), lambda ids: ids[:, None] * 1.0, 100, 0.0)
    builder.ingest(events)
    builder.flush(force=True)
    (state,) = states.fetch(np.array([user_key("u-1")])).states
    assert state is not None and state.tokens.items.tolist() == [5, 5]  # (5, 3) then (5, 2), by last use
    assert state.attribute_array[:, 0].tolist() == [3, 2] and state.tokens.counts.tolist() == [1, 2]
    append_events(tmp_path / "again.jsonl", events, ("cate",))  # written back as they were read
    assert FileEventLog(tmp_path / "again.jsonl", attributes=("cate",)).read().attributes.tolist() == [
        [2],
        [3],
        [2],
    ]
