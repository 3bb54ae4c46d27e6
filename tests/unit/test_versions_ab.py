"""``recserve lab versions``: the pure parts (inputs compared, counters added, medians over rounds)."""

import pytest

from recserve.perf.lab.versions_ab import (
    accumulate,
    declared_inputs,
    input_differences,
    keep_declared,
    parse_loads,
    step_table,
    summarize,
)

OLD = {"dense": ("FP32", (13,), False), "categorical": ("BYTES", (26,), False)}
NEW = {
    "dense": ("FP32", (13,), True),
    "categorical": ("BYTES", (26,), False),
    "categorical__ids": ("INT64", (26,), True),
}


def test_the_inputs_are_read_from_the_config_json():
    config = {"input": [{"name": "dense", "data_type": "TYPE_FP32", "dims": ["13"], "optional": True}]}
    assert declared_inputs(config) == {"dense": ("FP32", (13,), True)}


def test_each_difference_of_two_ensembles_inputs_is_named():
    assert input_differences(OLD, NEW, ("old", "new")) == [
        "categorical__ids only in new",
        "dense FP32[13] in old, FP32[13] optional in new",
    ]
    assert input_differences(NEW, NEW, ("a", "b")) == []


def test_requests_keep_the_declared_inputs_and_need_the_required_ones():
    assert keep_declared({"dense": 1, "categorical": 2, "categorical__ids": 3}, OLD) == {
        "dense": 1,
        "categorical": 2,
    }
    with pytest.raises(ValueError, match="categorical"):
        keep_declared({"dense": 1}, OLD)
    assert keep_declared({"categorical": 2}, NEW) == {"categorical": 2}


def test_windows_add_up_into_means_per_request():
    def counters(requests, executions, queue_ns):
        zero = {f"{n}_ns": 0 for n in ("compute_input", "compute_infer", "compute_output")}
        return {
            "step": {
                "requests": requests,
                "failed": 0,
                "executions": executions,
                "queue_ns": queue_ns,
                **zero,
            }
        }

    total = {}
    accumulate(total, counters(10, 5, 1_000), counters(20, 10, 11_000))  # 10 requests, 10 µs queue in all
    accumulate(total, counters(100, 50, 0), counters(130, 55, 50_000))  # 30 requests, 50 µs
    (step,) = step_table(total, ("step", "absent")).items()
    assert step == ("step", {"queue_us": 1.5, "compute_us": 0.0, "per_execution": 4.0})


def test_figures_are_medians_over_the_rounds():
    def one(p50, queue):
        return {"x": {"1x1": {"p50_ms": p50, "steps": {"step": {"queue_us": queue}}}}}

    assert summarize([one(1.0, 10.0), one(3.0, 30.0), one(2.0, 99.0)]) == {
        "x": {"1x1": {"p50_ms": 2.0, "steps": {"step": {"queue_us": 30.0}}}}
    }


def test_loads_are_batch_by_in_flight():
    assert parse_loads("1x16, 64x4,") == ((1, 16), (64, 4))
