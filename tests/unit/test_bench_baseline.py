"""The regression guard: a baseline of three runs' ratios, and a run compared with it."""

import json

import pytest

from recserve.cli import main
from recserve.perf.bench.baseline import compare, make_baseline, read_baseline, report

RUNS = [
    {
        "hop_floor_ratio": 1.30,
        "ensemble_vs_inprocess": 0.70,
        "dynamic_batching_gain": 1.5,
        "p99_bound_ms": 50.0,
    },
    {"hop_floor_ratio": 1.40, "ensemble_vs_inprocess": 0.74, "dynamic_batching_gain": 1.6},
    {"hop_floor_ratio": 1.36, "ensemble_vs_inprocess": 0.72, "dynamic_batching_gain": 1.55},
]


def test_a_baseline_holds_each_ratios_median_and_spread_in_its_own_direction():
    baseline = make_baseline(RUNS, ["r1", "r2", "r3"])
    entry = baseline["ratios"]["hop_floor_ratio"]
    assert entry["median"] == 1.36 and entry["spread"] == pytest.approx(0.05) and entry["better"] == "lower"
    assert baseline["ratios"]["ensemble_vs_inprocess"]["better"] == "higher"
    assert "p99_bound_ms" not in baseline["ratios"]  # settings are no ratios
    with pytest.raises(ValueError, match="at least three runs"):
        make_baseline(RUNS[:2], ["r1", "r2"])


def test_only_a_ratio_worse_than_its_noise_is_a_regression():
    baseline = make_baseline(RUNS, ["r1", "r2", "r3"])
    assert compare(RUNS[1], baseline) == []  # any of its own runs passes
    within = {"hop_floor_ratio": 1.44, "ensemble_vs_inprocess": 0.68, "dynamic_batching_gain": 1.9}
    assert compare(within, baseline) == []
    worse = {"hop_floor_ratio": 1.60, "ensemble_vs_inprocess": 0.50, "dynamic_batching_gain": 1.55}
    assert [r.ratio for r in compare(worse, baseline)] == ["ensemble_vs_inprocess", "hop_floor_ratio"]
    assert compare({"dynamic_batching_gain": 1.55}, baseline) == []  # a ratio not measured is not compared
    text, passed = report(worse, baseline)
    assert not passed and "REGRESSION hop_floor_ratio: 1.600, baseline 1.360" in text


def test_the_bench_command_writes_a_baseline_and_compares_a_run_with_it(tmp_path, capsys):
    runs = []
    for i, summary in enumerate(RUNS):
        runs.append(tmp_path / f"run{i}")
        runs[-1].mkdir()
        (runs[-1] / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "baseline.json"
    assert main(["bench", "--make-baseline", *map(str, runs), "--baseline-file", str(out)]) == 0
    assert read_baseline(out)["runs"] == ["run0", "run1", "run2"]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a bench baseline"):
        read_baseline(tmp_path / "bad.json")
