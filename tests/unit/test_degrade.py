"""Value-aware degradation: the ``[degrade]`` section, request values, and the controller's choices."""

from __future__ import annotations

import numpy as np
import pytest
import tomllib

from recserve.access.observe import panels
from recserve.backends.steps.degrade import LevelCounts, LevelInputs, newest, pad_list
from recserve.backends.steps.degrade_control import HEADROOM, LAMBDA_FLOOR, WINDOW_S, DegradeController
from recserve.backends.steps.queue_wait import StepCounts, expected_wait_ms, served_per_s, step_counts
from recserve.build.configs import all_configs
from recserve.core.names import STEPS
from recserve.core.sections.base import SpecError
from recserve.core.sections.degrade import (
    DEGRADE_LEVEL,
    FULL,
    REFUSED,
    REQUESTED_CANDIDATES,
    VALUE_HEADER,
    DegradeLevel,
    DegradeSection,
)
from recserve.core.spec.parse import parse_spec, spec_path
from recserve.errors import InvalidParameter
from recserve.perf.lab.degrade import shed_spec
from recserve.perf.lab.degrade_costs import alone
from recserve.perf.lab.degrade_report import clicks, level_quality, phase_figures, windows
from recserve.perf.lab.degrade_traffic import SERVED, Sent

DEGRADE = {
    "enabled": True,
    "tiers": {"low": 0.2, "standard": 1.0, "premium": 5.0},
    "default": "standard",
    "levels": [
        {"name": "trimmed", "cost": 0.4, "quality": 0.97, "max_candidates": 64, "history_length": 32},
        {"name": "minimal", "cost": 0.15, "quality": 0.85, "max_candidates": 16, "history_length": 8},
    ],
    "target_queue_ms": 5.0,
}


def ctr_doc(**sections) -> dict:
    with open(spec_path("ctr"), "rb") as fh:
        doc = tomllib.load(fh)
    doc.update(sections)
    return doc


def section(**changes) -> DegradeSection:
    return parse_spec(ctr_doc(degrade={**DEGRADE, **changes})).degrade


def test_without_the_section_nothing_is_degraded_and_the_served_spec_is_unchanged(spec):
    assert not spec.degrade.enabled and "degrade" not in spec.to_json()
    assert DegradeController(spec.degrade).level(0.0) == 0


def served_tensors(spec) -> dict[str, set[str]]:
    """Each config's inputs, outputs and step mappings, by model (the spec parameter left out)."""
    out = {}
    for name, config in all_configs(spec).items():
        names = {f"in:{i.name}" for i in config.input} | {f"out:{o.name}" for o in config.output}
        for step in config.ensemble_scheduling.step:
            names |= {f"{step.model_name}:{k}<-{v}" for k, v in step.input_map.items()}
            names |= {f"{step.model_name}:{k}->{v}" for k, v in step.output_map.items()}
        out[name] = names
    return out


def test_the_section_adds_the_level_output_and_a_lists_requested_candidates_and_nothing_when_off(spec):
    plain = served_tensors(spec)
    assert served_tensors(parse_spec(ctr_doc(degrade={**DEGRADE, "enabled": False}))) == plain
    on = served_tensors(parse_spec(ctr_doc(degrade=DEGRADE)))
    added = {name: on[name] - plain[name] for name in on}
    level = {f"out:{DEGRADE_LEVEL}", f"embedding_lookup:{DEGRADE_LEVEL}->{DEGRADE_LEVEL}"}
    assert added == {
        "embedding_lookup": {f"out:{DEGRADE_LEVEL}"},
        "dense": {f"in:{REQUESTED_CANDIDATES}"},
        "ctr": level,
        "ctr_candidates": level | {f"dense:{REQUESTED_CANDIDATES}<-target_item"},
    }
    assert all(not plain[name] - on[name] for name in on)


def test_a_priority_value_gives_the_python_steps_two_levels_and_the_requests_worth_most_the_first():
    configs = all_configs(parse_spec(ctr_doc(degrade={**DEGRADE, "priority_value": 3.0})))
    for step in STEPS:
        batching = configs[step].dynamic_batching
        assert (batching.priority_levels, batching.default_priority_level) == (2, 2)
    assert all_configs(parse_spec(ctr_doc(degrade=DEGRADE)))["dense"].dynamic_batching.priority_levels == 0
    degrade = section(priority_value=3.0)
    assert [degrade.priority_of(v) for v in ("premium", 3.0, "standard", None, "gold")] == [1, 1, 2, 2, 0]
    assert section().priority_of("premium") == 0


def test_the_section_names_levels_tiers_and_the_default():
    degrade = section()
    assert degrade.level_names == (FULL, "trimmed", "minimal", REFUSED)
    assert degrade.levels[0] == DegradeLevel("trimmed", 0.4, 0.97, 64, 32)
    assert degrade.default_value == 1.0 and section(default="premium").default_value == 5.0
    assert section(refuse=False).level_names == (FULL, "trimmed", "minimal")


def test_a_request_value_is_a_tier_or_a_number_and_anything_else_is_refused_naming_the_parameter():
    degrade = section()
    assert degrade.value_from({VALUE_HEADER: "premium"}) == 5.0
    assert degrade.value_from({VALUE_HEADER: "2.5"}) == 2.5 and degrade.value_from({VALUE_HEADER: 3}) == 3.0
    assert degrade.value_from({}) == 1.0 and degrade.value_from({VALUE_HEADER: ""}) == 1.0
    for bad in ("gold", "-1", "nan", "inf", True, [1]):
        with pytest.raises(InvalidParameter, match=f"parameter '{VALUE_HEADER}'.*one of the tiers low"):
            degrade.value_from({VALUE_HEADER: bad})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"default": "gold"}, "default 'gold'"),
        ({"levels": [{"name": "full", "cost": 0.5, "quality": 0.9}]}, "distinct names"),
        (
            {
                "levels": [
                    {"name": "a", "cost": 0.5, "quality": 0.9},
                    {"name": "b", "cost": 0.6, "quality": 0.8},
                ]
            },
            "costs less",
        ),
        ({"levels": [{"name": "a", "cost": 0.5, "quality": 0.9, "history_length": 33}]}, "sequence buckets"),
        ({"levels": [], "refuse": False}, "nothing cheaper"),
        ({"target_queue_ms": 0.0}, "must be > 0"),
        ({"tiers": {"low": -1.0}}, "value >= 0"),
        ({"capacity": -5.0}, "capacity lies in"),
    ],
)
def test_a_section_out_of_range_is_refused_with_what_is_wrong(changes, message):
    with pytest.raises(SpecError, match=message):
        section(**changes)


def test_an_unknown_key_is_refused():
    with pytest.raises(SpecError, match="unknown key 'levles'"):
        parse_spec(ctr_doc(degrade={**DEGRADE, "levles": []}))


def run(controller: DegradeController, waits: list[float]) -> list[float]:
    return [controller.update(w) for w in waits]


def test_lambda_rises_under_load_and_falls_back_to_zero_after():
    controller = DegradeController(section())
    assert run(controller, [0.0, 1.0, 4.0]) == [0.0, 0.0, 0.0]  # at or under the target: nothing
    rising = run(controller, [20.0] * 8)
    assert rising[0] >= LAMBDA_FLOOR and all(b > a for a, b in zip(rising, rising[1:], strict=False))
    falling = run(controller, [0.0] * 40)
    assert all(b <= a for a, b in zip(falling, falling[1:], strict=False)) and falling[-1] == 0.0
    assert controller.update(None) == 0.0  # no request measured: no load


def test_the_lowest_values_are_degraded_first_and_refused_last():
    controller = DegradeController(section(fixed_lambda=0.0))
    values = [0.01, 0.1, 0.5, 1.0, 5.0, 50.0]
    assert controller.levels(values) == [0] * 6  # normal load: everything in full
    for lam in (0.001, 0.01, 0.1, 1.0, 10.0, 100.0):
        controller._lambda = lam
        levels = controller.levels(values)
        assert levels == sorted(levels, reverse=True)  # a higher value is never served worse
    controller._lambda = 0.01
    assert controller.levels(values)[-3:] == [0, 0, 0] and controller.level(0.01) > 0
    controller._lambda = 1.0
    refused = controller.refused_level
    assert controller.level(0.01) == refused and controller.level(50.0) == 0
    # degraded before refused: as lambda grows a value passes every cheaper level on its way out
    seen = []
    for lam in np.geomspace(1e-3, 1e3, 200):
        controller._lambda = float(lam)
        seen.append(controller.level(0.5))
    assert sorted(set(seen)) == [0, 1, 2, 3] and seen == sorted(seen)


def test_the_top_decile_is_untouched_at_moderate_load():
    values = np.random.default_rng(4).lognormal(0.0, 1.0, 2_000)
    controller = DegradeController(section())
    while True:  # raise lambda by measured overload until a fifth of the traffic is degraded
        controller.update(15.0)
        levels = np.asarray(controller.levels(values.tolist()))
        if (levels > 0).mean() >= 0.2:
            break
    top = values >= np.quantile(values, 0.9)
    assert (levels[top] == 0).all()
    assert (levels[~top] == 0).mean() < 0.9 and (levels == controller.refused_level).mean() < 0.05


def test_lambda_is_held_while_the_queue_drains_and_never_passes_its_ceiling():
    controller = DegradeController(section(max_lambda=0.01))
    run(controller, [40.0, 40.0])
    held = controller.lam
    assert run(controller, [30.0, 20.0]) == [held, held]  # over the target, but falling: held
    assert run(controller, [25.0] * 20)[-1] == 0.01  # rising again up to max_lambda, not past it


def test_the_door_raises_lambda_at_the_first_batches_of_a_spike_and_drops_it_with_the_arrivals():
    """Synthetic clock: a capacity of 100 full-cost requests/s; 50/s arrive, then 800/s, then 50/s."""
    controller = DegradeController(section(max_lambda=50.0))
    values = np.random.default_rng(5).lognormal(0.0, 1.0, 400).tolist()
    assert controller.arrived(0.0, values[:40]) == 0.0  # capacity not measured yet: nothing
    controller.capacity(100.0, busy=True)
    now = 1.0
    for v in values[:10]:  # normal load: one every 20 ms, half the capacity
        now += 0.02
        assert controller.arrived(now, [v]) == 0.0 and controller.lam == 0.0
    floors = []
    for i in range(10):  # a spike: 8 every 10 ms, eight times the capacity
        now += 0.01
        floors.append(controller.arrived(now, values[8 * i : 8 * i + 8]))
    assert floors[0] > 0.0  # the first batch of the spike already raises the floor
    window = np.asarray(values[32:80])  # the spike's last 50 ms
    levels = np.asarray(controller.levels(window.tolist()))
    assert np.asarray(controller.costs)[levels].sum() <= 0.9 * 100.0 * WINDOW_S  # it fits the headroom
    order = np.argsort(window)
    assert (np.diff(levels[order]) <= 0).all()  # the lowest values pay first
    now += 0.2  # the spike is over: the next batch is alone in its window
    assert controller.arrived(now, values[:1]) == 0.0 and controller.lam == 0.0


def test_a_capacity_known_in_advance_holds_the_first_spike_from_its_first_batch():
    values = np.random.default_rng(7).lognormal(0.0, 1.0, 64).tolist()
    learning, known = (
        DegradeController(section(max_lambda=50.0)),
        DegradeController(section(max_lambda=50.0, capacity=100.0)),
    )
    assert learning.arrived(1.0, values) == 0.0  # no backlog seen yet: the door does not know the ceiling
    assert known.capacity_per_s == 100.0 and known.arrived(1.0, values) > 0.0
    levels = np.asarray(known.levels(values))
    assert np.asarray(known.costs)[levels].sum() <= 0.9 * 100.0 * WINDOW_S
    mean_cost = known._passed_cost / known._passed
    known.capacity(150.0, busy=True)  # and it learns on from the steps' counters
    assert known.capacity_per_s == pytest.approx(100.0 + 0.5 * (150.0 * mean_cost - 100.0))


def test_less_headroom_lets_a_spike_cost_less_of_the_capacity():
    values = np.random.default_rng(6).lognormal(0.0, 1.0, 64).tolist()
    spent = {}
    for headroom in (0.9, 0.5):
        controller = DegradeController(section(max_lambda=50.0, headroom=headroom))
        controller.capacity(100.0, busy=True)
        controller.arrived(1.0, values)  # 64 in one window: 13 times the capacity
        levels = np.asarray(controller.levels(values))
        spent[headroom] = np.asarray(controller.costs)[levels].sum()
        assert spent[headroom] <= headroom * 100.0 * WINDOW_S
    assert spent[0.5] < spent[0.9]
    with pytest.raises(SpecError, match="headroom"):
        section(headroom=0.0)


def test_the_capacity_is_learned_from_busy_readings_only():
    controller = DegradeController(section())
    controller.capacity(50.0, busy=False)
    assert controller.capacity_per_s == float("inf")  # idle readings say nothing of the ceiling
    for _ in range(3):
        controller.level(0.5)  # three let through in full: mean cost 1
    controller.capacity(200.0, busy=True)
    assert controller.capacity_per_s == 200.0
    controller.floor = 10.0  # most now served cheaper (the door's floor): the same rate is less compute
    for v in (0.1, 0.2, 100.0):
        controller.level(v)
    mean_cost = controller._passed_cost / controller._passed
    assert mean_cost < 1.0
    controller.capacity(200.0, busy=True)
    assert controller.capacity_per_s == pytest.approx(200.0 + 0.5 * (200.0 * mean_cost - 200.0))
    controller.capacity(900.0, busy=False)  # served more without a backlog: that fits, with headroom
    assert controller.capacity_per_s == pytest.approx(900.0 / HEADROOM)


def test_a_fixed_lambda_ignores_the_load():
    controller = DegradeController(section(fixed_lambda=0.5))
    assert run(controller, [100.0, 0.0]) == [0.5, 0.5] and controller.load == 0.0


METRICS = """# TYPE nv_inference_request_success counter
nv_inference_request_success{model="dense",version="1"} 300
nv_inference_request_success{model="embedding_lookup",version="1"} 310
nv_inference_request_failure{model="embedding_lookup",reason="REJECTED",version="1"} 10
nv_inference_request_success{model="ctr",version="1"} 999
nv_inference_queue_duration_us{model="dense",version="1"} 5000
nv_inference_pending_request_count{model="dense",version="1"} 12
nv_inference_pending_request_count{model="embedding_lookup",version="1"} 0
"""


def test_the_expected_wait_is_the_backlog_over_the_rate_each_step_drains_it():
    after = step_counts(METRICS, STEPS)
    assert after["embedding_lookup"] == StepCounts(320.0, 0.0, 0.0)
    assert after["dense"] == StepCounts(300.0, 5000.0, 12.0)
    before = {"dense": StepCounts(200.0), "embedding_lookup": StepCounts(200.0)}
    assert expected_wait_ms(before, after, 0.5) == pytest.approx(12 / 200 * 1e3)  # 200 finished/s
    assert expected_wait_ms(after, after, 0.5) == pytest.approx(500.0)  # none finished: the interval
    idle = {step: StepCounts(5.0) for step in STEPS}
    assert expected_wait_ms(idle, idle, 0.5) is None
    assert served_per_s(before, after, 0.5) == pytest.approx(200.0)  # the slower step: dense


def test_a_level_keeps_each_rows_newest_items_and_a_lists_first_candidates():
    sequence = np.array([[1, 2, 3, 4, 0, 0], [5, 6, 0, 0, 0, 0], [7, 8, 9, 10, 11, 12]], np.int64)
    lengths = np.array([[4], [2], [6]], np.int32)
    kept, kept_lengths = newest(sequence, lengths, 3)
    assert kept.tolist() == [[2, 3, 4], [5, 6, 0], [10, 11, 12]] and kept_lengths.tolist() == [[3], [2], [3]]
    assert newest(sequence, lengths, 8)[0] is sequence
    spec = parse_spec(ctr_doc(degrade=DEGRADE))
    arrays = {
        "history_items": np.tile(np.arange(1, 41), (1, 1)),
        "history_items__length": np.array([[40]], np.int32),
        "candidate_target_item": np.arange(100).reshape(1, 100, 1),
        "categorical__ids": np.zeros((1, 26), np.int64),
    }
    changed = LevelInputs(spec).changed(2, arrays)  # minimal: 16 candidates, 8 items
    assert changed["history_items"].tolist() == [list(range(33, 41))]
    assert changed["candidate_target_item"].shape == (1, 16, 1) and set(changed) == {
        "history_items",
        "history_items__length",
        "candidate_target_item",
    }
    assert LevelInputs(spec).changed(0, arrays) == {} == LevelInputs(spec).changed(3, arrays)


def test_a_list_cut_short_is_answered_for_every_candidate_with_the_fallback():
    scored = np.array([[0.5], [0.4], [0.3], [0.2]], np.float32)  # two users, two scored each
    padded = pad_list(scored, users=2, requested=3, fallback=0.01)
    assert padded.reshape(-1).tolist() == pytest.approx([0.5, 0.4, 0.01, 0.3, 0.2, 0.01])
    assert pad_list(scored, 2, 2, 0.0) is scored


def test_the_counts_declare_every_level_and_tier_at_zero():
    counts = LevelCounts(section())
    counts.count(1, counts.tier_of({VALUE_HEADER: "premium"}))
    for door in (0.0, 0.3, 0.2):  # the door's lambdas on the requests since the last publication
        counts.door(door)
    found = {(s.name, s.labels): s.value for s in counts.samples(0.5, 2.0, 300.0)}
    assert len(found) == 4 * 5 + 4 and found[("recserve_degrade_capacity", ())] == 300.0
    assert found[("recserve_degrade_requests_total", (("level", "trimmed"), ("tier", "premium")))] == 1
    assert counts.tier_of({VALUE_HEADER: "2.5"}) == 3 and counts.tier_of({}) == 4
    assert found[("recserve_degrade_lambda", ())] == 0.5 and found[("recserve_degrade_load", ())] == 2.0
    assert found[("recserve_degrade_door_lambda", ())] == 0.3  # the largest, then 0 until the next
    assert {s.name: s.value for s in counts.samples(0.5, 2.0)}["recserve_degrade_door_lambda"] == 0.0


def test_the_lab_weighs_the_clicks_served_by_value():
    labels = [np.array([1.0, 0.0, 0.0, 1.0])]
    full = [np.array([0.9, 0.1, 0.2, 0.8])]
    assert clicks(full[0], labels[0], k=2) == 2.0
    outcomes = [
        Sent(1, 0.0, 5.0, SERVED, 4.0, 0, 0, full[0]),
        Sent(1, 0.1, 9.0, SERVED, 1.0, 0, 1, np.array([0.9, 0.1, 0.0, 0.0])),  # capped at two
        Sent(1, 0.2, 1.0, REFUSED, 1.0, 0),
    ]
    figures = phase_figures("spike", 10.0, outcomes, full, labels, normal_p99_ms=5.0, top_value=4.0)
    assert figures.value_full == pytest.approx(4 / 6) and figures.value_degraded == pytest.approx(1 / 6)
    # clicks (top 8 of 4 = all): every served list keeps both clicks; the refused one none
    assert figures.value_retained == pytest.approx(5 / 6)
    assert figures.top_decile_degraded == 0.0 and figures.top_decile_refused == 0.0 and figures.refused == 1
    over_time = windows([*outcomes, Sent(1, 0.6, 1.0, REFUSED, 1.0, 0)], width_s=0.25)
    assert over_time == [[0.0, pytest.approx(8.96), 0.3333, 0.3333, 0.3333], [0.5, None, 0.0, 0.0, 1.0]]
    # per level served, the clicks kept (the top 8 of 4 is all of them, whatever the scores)
    assert level_quality(outcomes, full, labels) == {
        0: {"requests": 1, "quality": 1.0},
        1: {"requests": 1, "quality": 1.0},
    }
    label, reference = np.eye(10)[9], np.where(np.arange(10) == 9, 1.0, 0.5)  # the click ranked first
    missed = Sent(1, 0.0, 5.0, SERVED, 2.0, 0, 2, np.where(np.arange(10) == 9, 0.0, 0.5))  # ranked last
    assert level_quality([missed], [reference], [label]) == {2: {"requests": 1, "quality": 0.0}}


def test_the_dashboard_shows_the_levels_with_the_section_only(spec):
    titles = {panel.title for panel in panels(parse_spec(ctr_doc(degrade=DEGRADE)))} - {
        panel.title for panel in panels(spec)
    }
    assert titles == {"Degradation: requests by level and value tier, and lambda"}


def test_a_level_served_alone_serves_every_value_at_it():
    lone = alone(parse_spec(ctr_doc(degrade=DEGRADE)), 1)
    assert lone.degrade.level_names == (FULL, "minimal") and lone.degrade.levels[0].max_candidates == 16
    assert DegradeController(lone.degrade).levels([0.0, 1.0, 1e6]) == [1, 1, 1]


def test_the_labs_shedding_baseline_serves_a_spec_with_the_section_without_it():
    on = parse_spec(ctr_doc(degrade=DEGRADE))
    shedding = shed_spec(on)
    assert not shedding.degrade.enabled and shedding.source["features"] == on.source["features"]
    assert served_tensors(shedding) == served_tensors(parse_spec(ctr_doc()))  # no level output, as built
    plain = parse_spec(ctr_doc())
    assert shed_spec(plain) is plain


def test_the_capacity_is_probed_upwards_while_the_door_holds_arrivals_back_without_a_backlog():
    controller = DegradeController(section(max_lambda=50.0))
    controller.capacity(100.0, busy=True)
    controller.arrived(0.0, [1.0] * 20)  # 400/s in the window against 100: held back
    controller.capacity(80.0, busy=False)  # no backlog formed
    assert controller.capacity_per_s == pytest.approx(110.0)
    controller.capacity(80.0, busy=False)  # the floor did not hold anything back since: left as it is
    assert controller.capacity_per_s == pytest.approx(110.0)


def test_a_value_of_at_least_full_value_is_always_served_in_full_and_counted_at_full_cost():
    controller = DegradeController(section(full_value=5.0, max_lambda=1000.0))
    controller._lambda = 1000.0
    assert controller.levels([0.1, 4.9, 5.0, 50.0]) == [3, 3, 0, 0]
    controller.capacity(100.0, busy=True)  # 100 full-cost requests/s: 4.5 in the door's window
    floor = controller.arrived(1.0, [10.0] * 4 + [0.5] * 40)
    assert floor > 0.0 and controller.levels([10.0, 0.5]) == [0, 3]  # the protected four fit alone


def test_a_refusal_that_still_costs_makes_degrading_the_better_choice_for_longer():
    free, costly = DegradeController(section()), DegradeController(section(refuse_cost=0.1))
    free._lambda = costly._lambda = 1.0
    # at v = 0.1, minimal (cost 0.15, quality 0.85) gains -0.065: under a free refusal (0), over -0.1
    assert free.level(0.1) == 3 and costly.level(0.1) == 2
    assert costly.costs[-1] == 0.1
    with pytest.raises(SpecError, match="refuse_cost must be >= 0 and under the cheapest level's cost"):
        section(refuse_cost=0.15)


def test_the_lab_runs_a_schedule_again_when_its_normal_phase_served_nothing(monkeypatch, spec):
    """A queue that stalled through the normal phase leaves the phases nothing to be compared with."""
    from recserve.perf.lab import degrade as lab
    from recserve.perf.lab.overload import Cores

    full, labels = [np.array([0.9, 0.1])], [np.array([1.0, 0.0])]
    stalled = [Sent(0, 0.0, 6.0, REFUSED, 1.0, 0), Sent(1, 1.0, 3.0, SERVED, 1.0, 0, 0, full[0])]
    served = [Sent(0, 0.0, 2.0, SERVED, 1.0, 0, 0, full[0]), Sent(1, 1.0, 3.0, SERVED, 1.0, 0, 0, full[0])]
    runs = iter([stalled, stalled, served])
    monkeypatch.setattr(lab, "send_phases", lambda *args: next(runs))
    monkeypatch.setattr(lab.time, "sleep", lambda s: None)
    schedule = [("normal", 1.0, 1.0), ("spike_2x", 2.0, 1.0)]
    pool = lab.ListPool([{}], labels)
    figures, _, _ = lab.run_policy("url", spec, pool, full, schedule, np.ones(4), Cores(None, None))
    assert [f.served for f in figures] == [1, 1] and figures[1].p99_ratio == pytest.approx(1.5)
    runs = iter([stalled] * lab.CAPACITY_TRIES)  # never served: the last run's figures, bounded
    figures, _, _ = lab.run_policy("url", spec, pool, full, schedule, np.ones(4), Cores(None, None))
    assert figures[0].served == 0
