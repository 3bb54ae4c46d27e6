"""User states in a loopback Redis Cluster: compare-on-sequence writes, TTL, delete, untrusted values."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from recserve.backends.store.redis_tier import redis_keys
from recserve.backends.store.user_state.state import CLUSTERED, EXACT, UserState
from recserve.backends.store.user_state.states import (
    ABSENT,
    BAD_VALUE,
    ERROR,
    FOUND,
    STATE_PREFIX,
    RedisUserStates,
    open_user_states,
)
from recserve.backends.store.user_state.tokens import dedup
from recserve.core.sections.user_state import UserStateSection
from recserve.perf.harness.redis_cluster import RedisCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RedisCluster(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture
def states(cluster, tmp_path):
    section = UserStateSection(enabled=True, store="redis", ttl_s=30.0, deadline_ms=500.0)
    opened = open_user_states(section, cluster.store_section(), tmp_path)
    assert isinstance(opened, RedisUserStates)
    yield opened
    opened.close()


def _state(seq, mode=EXACT):
    return UserState(seq, mode, dedup(np.array([seq % 7 + 1, 9, 9, 11])), 1, 1)


def test_an_older_build_never_replaces_a_newer_one_across_the_cluster(states):
    users = np.arange(1000, 1064)  # spread over the slot groups, so over every master
    for user in users.tolist():
        assert states.put(user, _state(50))
        assert not states.put(user, _state(49))
    assert states.put(1000, _state(50, CLUSTERED))  # the same events regrouped
    assert states.put(1001, _state(10**12))
    fetched = states.fetch(np.concatenate([users, [5]]))
    assert fetched.outcomes == [FOUND] * users.size + [ABSENT]
    assert [s.seq for s in fetched.states[:3]] == [50, 10**12, 50]
    assert fetched.states[0].mode == CLUSTERED


def test_a_state_carries_its_ttl_and_delete_erases_it(states, cluster):
    states.put(77, _state(3))
    key = redis_keys(np.array([77]), STATE_PREFIX)[0]
    assert 0 < states.client.pttl(key) <= 30_000
    assert states.delete(77) and not states.delete(77)
    assert states.fetch(np.array([77])).outcomes == [ABSENT]


def test_a_value_that_is_not_a_state_costs_its_own_user_alone(states):
    states.put(301, _state(3))
    states.put(302, _state(3))
    keys = redis_keys(np.array([302, 303]), STATE_PREFIX)
    states.client.set(keys[0], b"RSU1" + b"9" * 20 + b"junk")
    states.client.hset(keys[1], "a", "b")  # another type: MGET answers nil
    fetched = states.fetch(np.array([301, 302, 303]))
    assert fetched.outcomes == [FOUND, BAD_VALUE, ABSENT]
    assert not states.put(302, _state(4))  # the junk's digits still claim a newer seq: kept, reported


def test_with_the_cluster_down_every_user_is_an_error_and_nothing_raises(tmp_path):
    with RedisCluster(tmp_path / "redis") as cluster:
        section = UserStateSection(enabled=True, store="redis", deadline_ms=200.0)
        states = open_user_states(section, cluster.store_section(breaker_failures=1), tmp_path)
        assert states.put(1, _state(2))
        cluster.kill_all()
        assert states.fetch(np.array([1, 2])).outcomes == [ERROR, ERROR]
        assert states.fetch(np.array([1])).outcomes == [ERROR]  # the breaker is open: no call
        cluster.restart()
        deadline = time.monotonic() + 30
        while states.fetch(np.array([1])).outcomes != [ABSENT]:  # the nodes came back empty
            assert time.monotonic() < deadline, "the user states never served again"
            time.sleep(0.01)


class Held:
    """The cluster's client, but a read of ``held``'s key waits until ``release`` is set."""

    def __init__(self, client, held: bytes) -> None:
        self.client, self.held, self.release = client, held, threading.Event()

    def __getattr__(self, name):
        return getattr(self.client, name)

    def mget_nonatomic(self, keys):
        if self.held in keys:
            self.release.wait(10)
        return self.client.mget_nonatomic(keys)


def test_a_read_stuck_on_one_thread_fails_that_threads_next_reads_only(states):
    assert states.put(1, _state(2))
    held = Held(states.client, redis_keys(np.array([666]), STATE_PREFIX)[0])
    shared = RedisUserStates(held, 30.0, 64, 0.2, states.breaker)
    with ThreadPoolExecutor(max_workers=1) as refresher:  # one thread of its own, as the step's refresher
        assert refresher.submit(shared.fetch, np.array([666])).result().outcomes == [ERROR]  # still in flight
        assert shared.fetch(np.array([1])).outcomes == [FOUND]  # this thread's reads are not held back
        assert refresher.submit(shared.fetch, np.array([1])).result().outcomes == [ERROR]  # that thread's are
        held.release.set()
    shared.close()
