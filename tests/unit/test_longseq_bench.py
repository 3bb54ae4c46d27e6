"""bench-longseq's pure parts: the bench-local spec, the workloads' requests, ratios and targets."""

import numpy as np
import pytest

from recserve.core.names import USER_ID, USER_SEQ
from recserve.core.spec.parse import load_spec
from recserve.perf.bench.longseq import bench as longseq
from recserve.perf.bench.longseq.load import Phase, Requests, mixed_order, round_order
from recserve.perf.bench.longseq.setup import LONG_EVENTS, bench_users, longseq_spec


@pytest.fixture(scope="module")
def spec():
    return longseq_spec(load_spec("ctr"))


def test_the_bench_spec_serves_states_and_a_4096_bucket_and_nothing_else_changes(spec):
    base = load_spec("ctr")
    assert spec.user_state.enabled and not base.user_state.enabled
    state_bucket = spec.user_state.tokens + spec.user_state.bucket_margin
    assert spec.serving.sequence_buckets == tuple(
        sorted({*base.serving.sequence_buckets, state_bucket, LONG_EVENTS})
    )
    assert spec.sequences[0].max_length == LONG_EVENTS
    assert spec.tables == base.tables and spec.serving.batch_buckets == base.serving.batch_buckets
    with pytest.raises(ValueError, match="no sequence"):
        longseq_spec(load_spec("avazu"))


def test_the_workloads_send_the_same_users_in_their_own_shapes(spec):
    users = bench_users(spec, 20, seed=3)
    assert (users.made.rows.lengths == LONG_EVENTS).all()
    wires = longseq.workload_wires(spec, users)
    history, length = spec.sequences[0].name, spec.attention_groups[0].length_input
    assert wires[longseq.W0][history].shape[1] == longseq.TODAY and USER_ID not in wires[longseq.W0]
    assert wires[longseq.W1][history].shape[1] == LONG_EVENTS
    assert (wires[longseq.W2][length][:, 0] == longseq.TAIL).all()
    assert (wires[longseq.W2][USER_SEQ][:, 0] == LONG_EVENTS).all()
    assert np.array_equal(wires[longseq.W2][history], users.made.rows.history[:, -longseq.TAIL :])
    missing = wires[longseq.W2_MISS][USER_ID][:, 0] >= users.unknown_first
    assert missing.sum() == 2 and missing[0] and missing[10]  # one row in ten
    requests = longseq._split(wires[longseq.W1], 4, spec.name)
    assert len(requests.messages) == 5 and requests.rows == 4
    assert (
        requests.request_bytes > 4 * LONG_EVENTS * 8 > longseq._split(wires[longseq.W2], 4, "x").request_bytes
    )


def test_ratios_are_medians_of_the_rounds_and_the_targets_read_the_control():
    grid = longseq.LongseqGrid(rows=2)

    def rounds(p99s, rates):
        return [{"p99_ms": p, "rows_per_s": r, "steps": []} for p, r in zip(p99s, rates, strict=True)]

    phases = {
        longseq.W0: rounds([10, 10, 10], [100, 100, 100]),
        longseq.W0_AA: rounds([11, 9, 12], [100, 99, 101]),
        longseq.W1: rounds([100, 90, 80], [50, 50, 50]),
        longseq.W2: rounds([10.5, 30, 11], [100, 98, 100]),
    }
    point = longseq._point_summary(5.0, grid, phases)
    assert point["longseq_p99_ratio"] == pytest.approx(1.1)
    assert point["longseq_aa_p99_ratio"] == pytest.approx(1.1)
    assert point["longseq_throughput_ratio"] == pytest.approx(1.0)
    assert point["naive_p99_ratio"] == pytest.approx(9.0)
    assert point["workloads"][longseq.W2]["p99_ms"] == pytest.approx(11)
    assert longseq._targets_met(point) is True
    assert longseq._targets_met({**point, "longseq_p99_ratio": 1.2}) is False
    assert longseq._targets_met({**point, "longseq_throughput_ratio": None}) is None


def test_a_phase_counts_rows_served_over_its_whole_span():
    phase = Phase(rate=10.0, seconds=1.0, rows=4, latencies_ms=[1.0] * 9, failed=1, sent=10, elapsed_s=2.0)
    figures = phase.figures()
    assert figures["rows_per_s"] == 18.0 and figures["offered_rows_per_s"] == 40.0 and figures["failed"] == 1
    assert Phase(rate=1.0, seconds=1.0, rows=1).figures()["p99_ms"] == np.inf
    with pytest.raises(ValueError, match="one number of rows"):
        Requests.of("m", [{"a": np.zeros((2, 1))}, {"a": np.zeros((3, 1))}])


@pytest.mark.parametrize("count", [1, 2, 6, 7])
def test_each_round_runs_every_workload_once_after_a_new_predecessor(count):
    names = [f"w{i}" for i in range(count)]
    rounds = [round_order(names, number) for number in range(5)]
    assert all(sorted(order) == names for order in rounds)
    if count == len(longseq.WORKLOADS):  # the bench's seven: five different predecessors each
        for name in names:
            before = [order[order.index(name) - 1] for order in rounds if order.index(name) > 0]
            assert len(set(before)) == len(before), (name, before)
        assert len({order[0] for order in rounds}) == len({order[-1] for order in rounds}) == 5


def test_a_mixed_stream_sends_each_workload_once_a_cycle_after_varying_ones():
    names = list(longseq.MIXED)
    order = mixed_order(names, 40, seed=5)
    assert len(order) == 40 * len(names)
    cycles = [order[i : i + len(names)] for i in range(0, len(order), len(names))]
    assert all(sorted(cycle) == sorted(names) for cycle in cycles)
    for name in names:  # no workload always follows the same one
        before = {order[i - 1] for i in range(1, len(order)) if order[i] == name}
        assert before >= set(names) - {name}, (name, before)  # itself too, across two cycles
    assert mixed_order(names, 40, seed=5) == order != mixed_order(names, 40, seed=6)


def test_a_mixed_workload_reports_the_steps_of_its_own_phase():
    grid = longseq.LongseqGrid(rows=2)
    rounds = [{"p99_ms": 5.0, "rows_per_s": 10.0, "steps": []}]
    phases = dict.fromkeys((longseq.W0, longseq.W0_AA, longseq.W1, longseq.W2), rounds)
    point = longseq._point_summary(5.0, grid, phases, {longseq.W0: ["own"]})
    assert (
        point["workloads"][longseq.W0]["steps"] == ["own"]
        and point["workloads"][longseq.W0_AA]["steps"] == []
    )


def test_a_round_sends_the_mixed_workloads_in_one_stream_unless_each_runs_alone():
    names = list(longseq.WORKLOADS)
    assert longseq.round_blocks(names, mixed=True) == [
        (longseq.W0, longseq.W0_AA, longseq.W2, longseq.W2_REDIS, longseq.W2_MISS),
        (longseq.W1,),
        (longseq.W2_BUILDER,),
    ]
    assert longseq.round_blocks(names, mixed=False) == [(name,) for name in names]
    without_redis = [n for n in names if n != longseq.W2_REDIS]
    assert longseq.round_blocks(without_redis, mixed=True)[0] == (
        longseq.W0,
        longseq.W0_AA,
        longseq.W2,
        longseq.W2_MISS,
    )
