import json
import math

import pytest

from recserve.perf.bench import report
from recserve.perf.bench.report import Point


def point(system, generator, protocol, batch, conc, rows, p99, shm="none", failures=0):
    return Point(system, generator, protocol, batch, conc, rows, p99 / 2, p99 * 0.9, p99, shm, failures)


GRPC = (report.PERF_ANALYZER, "grpc")
HTTP = (report.HTTP_LOADGEN, "http")


def sample_points():
    return [
        point(report.INPROCESS, report.DIRECT, "none", 64, 1, 10_000, 5),
        point(report.INPROCESS, report.DIRECT, "none", 256, 1, 12_000, 60),  # over the bound: not the bound
        point(report.TUNED, *GRPC, 64, 4, 8_000, 30),
        point(report.TUNED, *GRPC, 64, 16, 9_500, 80),  # over the bound
        point(report.TUNED, *GRPC, 1, 16, 1_500, 20),
        point(report.NAIVE, *GRPC, 1, 16, 500, 40),
        point(report.TUNED, *HTTP, 64, 4, 6_000, 25),
        point(report.TUNED, *HTTP, 64, 16, 7_000, 45),
        point(report.TORCHSERVE, *HTTP, 64, 4, 2_000, 50),
        point(report.TORCHSERVE, *HTTP, 64, 16, 2_400, 120),
    ]


def test_best_under_respects_the_p99_bound_and_failures():
    points = [
        point(report.TUNED, *GRPC, 64, 1, 100, 10),
        point(report.TUNED, *GRPC, 64, 2, 300, 50),  # on the bound counts
        point(report.TUNED, *GRPC, 64, 4, 900, 51),
        point(report.TUNED, *GRPC, 64, 8, 800, 10, failures=1),
        point(report.TUNED, *GRPC, 64, 16, 1000, math.nan),
    ]
    assert report.best_under(points, 50.0).concurrency == 2
    assert report.best_under(points[2:], 50.0) is None


def test_summary_ratios_come_from_the_right_points():
    summary = report.summarize(sample_points())
    assert summary["ensemble_vs_inprocess"] == pytest.approx(8_000 / 10_000)
    assert summary["dynamic_batching_gain"] == pytest.approx(3.0)
    assert summary["dynamic_batching_p99_ratio"] == pytest.approx(0.5)
    assert summary["vs_torchserve_throughput"] == pytest.approx(7_000 / 2_000)
    # Triton's p99 at TorchServe's best point (batch 64, 4 in flight)
    assert summary["vs_torchserve_p99"] == pytest.approx(25 / 50)
    assert summary["targets"]["ensemble_vs_inprocess"]["met"] is True
    assert summary["targets"]["dynamic_batching_gain"]["met"] is True
    assert summary["points"]["torchserve_best"]["concurrency"] == 4
    json.dumps(summary)  # plain JSON


def test_monolith_ratio_takes_its_better_instance_count_under_the_bound():
    points = sample_points() + [
        point(f"{report.MONOLITH}-1", *GRPC, 64, 4, 5_000, 20),
        point(f"{report.MONOLITH}-2", *GRPC, 64, 4, 6_400, 40),
        point(f"{report.MONOLITH}-2", *GRPC, 64, 16, 9_000, 70),  # over the bound
    ]
    summary = report.summarize(points)
    assert summary["vs_monolith_throughput"] == pytest.approx(8_000 / 6_400)
    assert summary["vs_monolith_p99"] == pytest.approx(30 / 40)  # the ensemble at batch 64 x 4
    assert summary["points"]["monolith_best"]["configuration"] == "monolith-2 grpc perf_analyzer"
    assert summary["targets"]["vs_monolith_throughput"]["met"] is True
    assert "vs_monolith_p99" in report.describe_summary(summary)
    assert report.summarize(sample_points())["vs_monolith_throughput"] is None


def test_an_unstable_point_is_read_by_no_ratio():
    """A point perf_analyzer could not stabilise has no figures (NaN rows/s, infinite latencies)."""
    points = [p for p in sample_points() if not (p.system == report.TUNED and p.client_batch == 1)]
    points.append(Point(report.TUNED, *GRPC, 1, 16, math.nan, math.inf, math.inf, math.inf))
    summary = report.summarize(points)
    assert summary["dynamic_batching_gain"] is None and summary["dynamic_batching_p99_ratio"] is None
    assert summary["targets"]["dynamic_batching_gain"]["met"] is None
    assert summary["ensemble_vs_inprocess"] == pytest.approx(8_000 / 10_000)  # other ratios unaffected
    json.dumps(summary, allow_nan=False)


def test_the_hop_floor_ratio_comes_from_the_hops_summary():
    summary = report.summarize(sample_points(), hops={"hop_floor_ratio": 1.5})
    assert summary["targets"]["hop_floor_ratio"] == {"target": "<= 1.3", "value": 1.5, "met": False}
    assert report.summarize(sample_points())["hop_floor_ratio"] is None  # not measured in this run


def test_the_candidate_list_gain_comes_from_the_candidates_summary():
    summary = report.summarize(sample_points(), candidates={"candidate_list_gain": 3.4})
    assert summary["targets"]["candidate_list_gain"] == {"target": ">= 3.0", "value": 3.4, "met": True}
    assert report.summarize(sample_points())["candidate_list_gain"] is None


def test_missing_configurations_give_none_not_errors():
    points = [p for p in sample_points() if p.system != report.TORCHSERVE]
    summary = report.summarize(points)
    assert summary["vs_torchserve_throughput"] is None and summary["vs_torchserve_p99"] is None
    assert summary["targets"]["vs_torchserve_throughput"]["met"] is None
    assert "n/a" in report.describe_summary(summary)


def test_torchserve_never_within_the_bound_is_compared_at_its_best_rate_point():
    points = [p for p in sample_points() if p.system != report.TORCHSERVE] + [
        point(report.TORCHSERVE, *HTTP, 64, 4, 1_000, 90),
        point(report.TORCHSERVE, *HTTP, 64, 16, 1_400, 300),
    ]
    summary = report.summarize(points)
    assert summary["torchserve_within_p99_bound"] is False
    assert summary["vs_torchserve_throughput"] == pytest.approx(7_000 / 1_400)  # both at batch 64 x 16
    assert summary["vs_torchserve_p99"] == pytest.approx(45 / 300)
    assert report.summarize(sample_points())["torchserve_within_p99_bound"] is True


def test_missed_target_is_reported():
    points = [p for p in sample_points() if not (p.system == report.TUNED and p.client_batch == 1)]
    points.append(point(report.TUNED, *GRPC, 1, 16, 600, 20))
    summary = report.summarize(points)
    assert summary["dynamic_batching_gain"] == pytest.approx(1.2)
    assert summary["targets"]["dynamic_batching_gain"]["met"] is False
    assert "MISSED" in report.describe_summary(summary)


def test_overheads_compare_same_load_points():
    points = sample_points() + [
        point(report.TUNED, report.PERF_ANALYZER, "http", 64, 4, 6_000, 45),
        point(report.TUNED, report.PERF_ANALYZER, "grpc", 64, 4, 8_800, 27, shm="system"),
        point(report.TUNED, report.SDK, "grpc", 64, 1, 1_000, 10),
        point(report.TUNED, report.SDK, "grpc", 64, 1, 1_100, 8, shm="system"),
    ]
    overheads = report.overheads(points)
    assert overheads["sdk_system_shm_over_wire"] == [
        {
            "client_batch": 64,
            "concurrency": 1,
            "throughput_ratio": pytest.approx(1.1),
            "p50_ratio": pytest.approx(0.8),
            "p99_ratio": pytest.approx(0.8),
        }
    ]
    assert overheads["http_over_grpc"][0]["throughput_ratio"] == pytest.approx(0.75)
    assert overheads["system_shm_over_grpc"][0]["p99_ratio"] == pytest.approx(0.9)


def test_points_files_and_plots(tmp_path):
    points = sample_points()
    report.write_points(points, tmp_path)
    assert report.read_points(tmp_path) == points
    header = (tmp_path / "points.csv").read_text().splitlines()[0].split(",")
    assert header[:2] == ["configuration", "system"] and "p99_ms" in header
    assert len(json.loads((tmp_path / "points.json").read_text())) == len(points)
    plots = report.plot(points, tmp_path)
    assert (tmp_path / "latency_vs_throughput.png") in plots
    assert all(p.stat().st_size > 1000 for p in plots)
    assert "triton-tuned grpc perf_analyzer" in report.table(points)


def test_torchserve_handler_groups_requests_within_max_batch():
    from recserve.perf.peers.torchserve_handler import row_groups

    assert row_groups([64, 64, 64, 64, 64], 256) == [[0, 1, 2, 3], [4]]
    assert row_groups([1, 255, 1], 256) == [[0, 1], [2]]
    assert row_groups([256, 256], 256) == [[0], [1]]
    assert row_groups([], 256) == []


def test_concurrency_levels_follow_perf_analyzers_range_syntax():
    from recserve.perf.bench.analyzer import concurrency_levels

    assert concurrency_levels("1:2") == [1, 2]
    assert concurrency_levels("4") == [4]
    assert concurrency_levels("1:16:4") == [1, 5, 9, 13]
