"""The queue-stall comparison's bookkeeping (the measurement runs in tests/integration/test_bench.py)."""

import pytest

from recserve.perf.lab.queue_stall import SERVED, format_report, run_queue_stall, summarize


def _round(index, name, stalled, rows_per_s=100.0, p99_ms=20.0):
    return {
        "round": index,
        "configuration": name,
        "rows_per_s": rows_per_s,
        "p50_ms": 10.0,
        "p99_ms": p99_ms,
        "max_ms": 600.0 if stalled else 40.0,
        "stalled": stalled,
        "failures": 0,
    }


def test_totals_count_rounds_with_a_stall_and_take_medians():
    rounds = [
        _round(0, SERVED, 0, 100.0, 20.0),
        _round(0, "throughput_first", 3, 80.0, 510.0),
        _round(1, "throughput_first", 0, 90.0, 30.0),
        _round(1, SERVED, 0, 110.0, 22.0),
        _round(2, "throughput_first", 1, 70.0, 505.0),
        _round(2, SERVED, 0, 120.0, 24.0),
    ]
    summary = summarize(rounds, (SERVED, "throughput_first"))
    served, profile = summary["configurations"][SERVED], summary["configurations"]["throughput_first"]
    assert (served["rounds"], served["rounds_with_a_stall"], served["stalled_requests"]) == (3, 0, 0)
    assert (profile["rounds"], profile["rounds_with_a_stall"], profile["stalled_requests"]) == (3, 2, 4)
    assert (served["median_rows_per_s"], profile["median_p99_ms"]) == (110.0, 505.0)
    report = format_report(summary)
    assert "throughput_first   2 of 3 rounds stalled (4 requests)" in report
    assert len(report.splitlines()) == 1 + len(rounds) + 1 + 2


def test_an_unknown_profile_is_refused_before_any_server_starts(spec, tmp_path):
    with pytest.raises(ValueError, match=r"unknown queue policy\(s\) \['nope'\]"):
        run_queue_stall(spec, tmp_path / "nothing", ("nope",), 16, 1.0, 1, tmp_path)
