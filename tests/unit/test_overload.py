import pytest

from recserve.perf.lab.open_loop import SERVED, SHED, Outcome, phase_stats, recovery_s
from recserve.perf.lab.overload import Cores


def test_the_server_gets_one_core_and_the_load_generator_the_rest():
    cores = Cores.split({0, 1, 2})
    assert cores.server == {0} and cores.client == {1, 2}
    assert "cores [0]" in cores.describe() and "cores [1, 2]" in cores.describe()
    assert Cores.split({3}) == Cores(None, None)


def _outcomes(start_s, seconds, rate, result, latency_ms):
    return [
        Outcome(2, start_s + i / rate, start_s + i / rate, latency_ms, result)
        for i in range(int(seconds * rate))
    ]


def test_recovery_is_the_first_calm_window_after_the_spike():
    outcomes = _outcomes(10.0, 2.0, 100, SHED, 1.0) + _outcomes(12.0, 3.0, 100, SERVED, 5.0)
    assert recovery_s(sorted(outcomes, key=lambda o: o.sent_s), 10.0, normal_p99_ms=5.0) == pytest.approx(2.0)


def test_no_recovery_while_latency_stays_high():
    outcomes = _outcomes(10.0, 3.0, 100, SERVED, 50.0)
    assert recovery_s(outcomes, 10.0, normal_p99_ms=5.0) == float("inf")


def test_phase_stats_count_and_report_a_late_sender():
    outcomes = _outcomes(0.0, 1.0, 100, SERVED, 4.0) + [Outcome(0, 1.0, 1.05, 2.0, SHED)]
    stats = phase_stats("half", 100.0, outcomes)
    assert (stats.sent, stats.served, stats.shed, stats.failed) == (101, 100, 1, 0)
    assert stats.served_p99_ms == pytest.approx(4.0) and stats.shed_p99_ms == pytest.approx(2.0)
    assert stats.sender_late_p99_ms == pytest.approx(0.0, abs=1.0)
