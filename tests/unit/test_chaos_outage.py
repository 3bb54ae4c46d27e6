"""What one kill cost the clients of ``recserve lab chaos``: requests failed and seconds to served again."""

from __future__ import annotations

from recserve.perf.lab.chaos_load import Outage, outage


def test_served_again_is_the_first_answer_after_the_last_failure():
    records = [(9.0, False), (10.2, True), (10.4, False), (10.9, False), (11.0, True), (11.5, True)]
    assert outage(records, killed_at=10.0, until=12.0) == Outage(2, 1.0, 5)  # 9.0: before the kill


def test_nothing_failed_is_served_again_at_once_and_still_failing_is_never():
    assert outage([(10.5, True), (11.0, True)], 10.0, 12.0) == Outage(0, 0.0, 2)
    assert outage([(10.5, True), (11.0, False)], 10.0, 12.0) == Outage(1, None, 2)
    assert outage([], 10.0, 12.0) == Outage(0, 0.0, 0)
