"""perf_analyzer's outcomes as the sweeps read them (its runs themselves are integration tests)."""

import pytest

from recserve.core.spec.parse import load_spec
from recserve.perf.bench import analyzer


@pytest.mark.parametrize(
    ("message", "kept"),
    [
        (f"perf_analyzer exited with 2:\n{analyzer.UNSTABLE} for concurrency 16.", True),
        ("exited with 99", False),
    ],
)
def test_a_point_without_stable_windows_has_no_figures_other_errors_stop_the_sweep(
    monkeypatch, message, kept
):
    def unstable(*args, **kwargs):
        raise analyzer.PerfError(message)

    monkeypatch.setattr(analyzer, "measure", unstable)
    spec = load_spec("tiny")
    if kept:
        assert analyzer.measure_point(spec, "127.0.0.1:1", "grpc", 1, 16, 1000) is None
    else:
        with pytest.raises(analyzer.PerfError):
            analyzer.measure_point(spec, "127.0.0.1:1", "grpc", 1, 16, 1000)
