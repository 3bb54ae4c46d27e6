"""All of the L3 Redis Cluster down under traffic: no failed inference, readiness as documented.

Latency is measured by ``recserve lab redis-outage`` (a benchmark), not asserted here.
"""

from recserve.perf.lab.redis_outage import BACK, COMING_BACK, DOWN, GOING_DOWN, UP, run_outage


def test_all_redis_down_fails_no_inference_and_the_model_stays_ready(spec, repository, tmp_path):
    report = run_outage(
        spec, repository, tmp_path, requests=60, rounds=1, batch_size=8, deadline_ms=200.0, warmup=10
    )
    assert [p.kind for p in report.phases] == [UP, GOING_DOWN, DOWN, COMING_BACK, BACK]
    assert report.failed == 0 and report.problems == [], report.table()
    up, down, back = (report.of(kind)[0] for kind in (UP, DOWN, BACK))
    assert all(p.ready for p in report.phases)  # READY throughout: L3 keys get defaults while it is down
    assert up.all_rows_found > 0  # L3 served before the outage (not necessarily every call: deadlines)
    assert (down.store_healthy, down.breaker_open) == (0.0, 1.0)
    assert back.all_rows_found > 0  # L3 serves again once it is back (run_outage waited for healthy 1)
