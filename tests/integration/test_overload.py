"""Open-loop spike at 2x measured capacity: the excess is shed with UNAVAILABLE, nothing else fails,
and the server serves normally again soon after.

Latency ratios are printed, not asserted (a shared 2-core machine is too noisy for that); the
``recserve overload`` command reports them side by side in one run.
"""

from recserve.perf.overload import run_overload

from .private_server import private_server


def test_a_spike_above_capacity_is_shed_and_the_server_recovers(repository, spec, tmp_path):
    with private_server(repository, tmp_path, model_control="none") as server:
        report = run_overload(server.grpc_url, spec, rows=8, spike_factor=2.0, seconds=4.0, recovery_window_s=8.0)
    print(report.table())
    half, spike, after = report.phases
    assert not report.failures, report.failures
    assert all(phase.failed == 0 for phase in report.phases), report.table()
    assert spike.shed > 0, "nothing was shed at twice the capacity: is the queue policy in the configs?"
    assert spike.served > 0
    assert half.shed <= 0.01 * half.sent, report.table()
    assert report.recovery_s <= 10.0, report.table()
