import pytest
import tomllib

from recserve.build.configs import ServingPlan
from recserve.core.names import STEPS
from recserve.core.spec.parse import load_spec, parse_spec, spec_path
from recserve.perf.lab import tune

LADDER = ((1, 4), (1, 16), (64, 1), (64, 4))


def test_capacity_is_the_best_rate_within_the_target_per_batch_size():
    trial = tune.Trial(ServingPlan(500), LADDER, (100.0, 300.0, 400.0, 900.0), (10.0, 70.0, 20.0, 45.0))
    assert trial.capacity(50) == {1: 100.0, 64: 900.0}
    assert trial.score(50) == pytest.approx(300.0)
    assert trial.capacity(15) == {1: 100.0, 64: 0.0} and trial.score(15) == 0.0


def test_the_admission_cap_is_the_largest_knee_within_the_target():
    ladder = ((1, 2), (1, 4), (1, 8), (1, 16), (64, 1), (64, 2), (64, 4))
    rows = (200.0, 380.0, 420.0, 430.0, 900.0, 1000.0, 1010.0)
    p99 = (5.0, 8.0, 15.0, 60.0, 20.0, 30.0, 45.0)
    trial = tune.Trial(ServingPlan(500), ladder, rows, p99)
    # batch 1: capacity 420 (16 in flight breaks the target), 90 % of it first at 4 in flight;
    # batch 64: capacity 1010, 90 % at 2
    assert tune.admission_cap(trial, 50.0) == 4
    assert tune.admission_cap(trial, 50.0, share=0.99) == 8
    assert tune.admission_cap(trial, 10.0) == 4  # batch 64 never meets 10 ms: only batch 1 counts
    assert tune.admission_cap(tune.Trial(ServingPlan(500), ((1, 4),), (10.0,), (99.0,)), 50.0) == 1


def test_best_trial_prefers_throughput_within_the_target():
    fast_but_slow_tail = tune.Trial(ServingPlan(4000), ((1, 16),), (900.0,), (80.0,))
    good = tune.Trial(ServingPlan(1000), ((1, 16),), (700.0,), (30.0,))
    worse = tune.Trial(ServingPlan(100), ((1, 16),), (500.0,), (20.0,))
    assert tune.best_trial([fast_but_slow_tail, good, worse], 50).plan == good.plan
    assert tune.best_trial([fast_but_slow_tail], 50) is None


def test_sweep_walks_delay_then_preferred_then_instances():
    spec = load_spec()
    seen = []

    def measure(plan):  # a made-up response surface: 2000 us, preferred 32, two lookup instances win
        seen.append(plan)
        rows = 1000.0
        rows *= 2 if plan.max_queue_delay_microseconds == 2000 else 1
        rows *= 1.5 if plan.preferred_batch_sizes == (32,) else 1
        rows *= 1.2 if plan.instances["embedding_lookup"] == 2 else 1
        p99 = 100.0 if plan.instances["dense"] == 2 else 20.0  # two dense instances break the target
        return tune.Trial(plan, ((1, 16),), (rows,), (p99,))

    best, trials = tune.sweep(spec, measure, 50.0, delays=(500, 2000), instance_counts=(1, 2), confirm=2)
    assert best.plan == ServingPlan(2000, (32,), {**{s: 1 for s in STEPS}, "embedding_lookup": 2})
    explored = seen[:-2]
    assert len(explored) == len(set(map(repr, explored)))  # no plan explored twice
    assert seen[-2:] == [best.plan, *[p for p in seen[-2:] if p != best.plan]]  # the finalists, best first
    assert len(trials) == len(seen)


def test_combine_is_conservative():
    plan = ServingPlan(500)
    two = ((1, 4), (1, 8))
    merged = tune.combine(
        tune.Trial(plan, two, (100.0, 10.0), (5.0, 70.0)), tune.Trial(plan, two, (300.0, 30.0), (9.0, 20.0))
    )
    assert merged.rows_per_s == (200.0, 20.0) and merged.p99_ms == (9.0, 70.0)


def test_write_back_keeps_comments_and_round_trips(tmp_path):
    target = tmp_path / "ctr.toml"
    original = spec_path("ctr").read_text()
    target.write_text(original)
    plan = ServingPlan(1500, (32, 64), {"embedding_lookup": 2, "dense": 1})
    tune.write_back(target, plan)
    text = target.read_text()
    document = tomllib.loads(text)
    assert document["serving"]["max_queue_delay_microseconds"] == 1500
    assert document["serving"]["preferred_batch_size"] == [32, 64]
    assert document["serving"]["instances"] == {"embedding_lookup": 2, "dense": 1}
    spec = parse_spec(document)
    assert ServingPlan.from_spec(spec) == plan
    # everything outside [serving] is untouched, comments included
    assert [line for line in text.splitlines() if line.startswith("#")] == [
        line for line in original.splitlines() if line.startswith("#")
    ]
    assert document["model"] == tomllib.loads(original)["model"]
    tune.write_back(target, plan)  # idempotent: the added key is now edited in place
    assert target.read_text() == text


def test_write_back_adds_the_cap_in_an_access_table(tmp_path):
    target = tmp_path / "ctr.toml"
    target.write_text(spec_path("ctr").read_text())
    plan = ServingPlan(1500, (32,), {"embedding_lookup": 1, "dense": 1})
    tune.write_back(target, plan, max_requests=6)
    assert parse_spec(tomllib.loads(target.read_text())).access.max_requests == 6
    text = target.read_text()
    tune.write_back(target, plan, max_requests=3)  # now edited in place
    assert target.read_text() == text.replace("max_requests = 6", "max_requests = 3")
    tune.write_back(target, plan)  # no cap: [access] left as it is
    assert tomllib.loads(target.read_text())["access"] == {"max_requests": 3}


def test_write_back_refuses_a_plan_without_batching(tmp_path):
    target = tmp_path / "ctr.toml"
    target.write_text(spec_path("ctr").read_text())
    with pytest.raises(ValueError, match="dynamic batching"):
        tune.write_back(target, ServingPlan.naive())
