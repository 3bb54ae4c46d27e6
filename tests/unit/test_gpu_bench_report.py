"""The GPU bench's summary figures: the best served point within the p99 bound, its ratio to the bound."""

from recserve.perf.gpu_check.bench.report import FIGURES, bench_figures, bench_markdown
from recserve.perf.gpu_check.context import StepResult


def point(form, shape, candidates, concurrency, rate, p99, failures=0):
    return {
        "form": form,
        "shape": shape,
        "candidates": candidates,
        "concurrency": concurrency,
        "rows_per_s": rate,
        "p50_ms": p99 / 2,
        "p99_ms": p99,
        "failures": failures,
        "client_cpu": 0.3,
        "steps": [{"model": "dense", "queue_us": 100.0, "compute_us": 900.0}],
        "pcie_h2d_bytes_per_row": 40.0,
        "pcie_d2h_bytes_per_row": 4.0,
    }


def results(served_points):
    bound_point = {"users": 1, "candidates": 4096, "rows": 4096, "rows_per_s": 2_000_000.0}
    bound_point |= {"p50_ms": 1.0, "p99_ms": 2.0, "h2d_bytes_per_row": 250.0, "d2h_bytes_per_row": 4.0}
    return [
        StepResult(
            "bench-bound", 0, "ok", data={"rows_per_s": 2_000_000.0, "best": bound_point, "device": "cuda"}
        ),
        StepResult("bench-serve", 0, "ok", data={"parity": {"max_abs_diff": 1e-7, "ok": True}}),
        StepResult("bench-ids-lists", 0, "ok", data={"points": served_points}),
        StepResult(
            "bench-bytes", 0, "ok", data={"points": [point("bytes", "list", 1024, 1, 200_000.0, 4.0)]}
        ),
    ]


def test_the_served_figure_is_the_id_forms_best_point_within_10_ms_without_refusals():
    figures = bench_figures(
        results(
            [
                point("ids", "list", 4096, 2, 1_200_000.0, 9.5),
                point("ids", "list", 4096, 8, 1_900_000.0, 14.0),  # over the p99 bound
                point("ids", "list", 4096, 4, 1_600_000.0, 9.0, failures=3),  # refused some
                point("ids", "list", 1024, 1, 600_000.0, 4.5),
                point("ids", "list", 1024, 4, 700_000.0, 6.0),
                {"form": "ids", "shape": "list", "candidates": 8192, "concurrency": 1, "skipped": "too long"},
            ]
        )
    )
    assert set(figures) == set(FIGURES)
    assert figures["gpu_bound_rows_per_s"] == 2_000_000.0
    assert figures["gpu_served_rows_per_s"] == 1_200_000.0
    assert figures["gpu_served_vs_bound"] == 0.6
    assert figures["gpu_served_bytes_rows_per_s"] == 200_000.0
    assert (
        figures["gpu_ids_vs_bytes"] == 700_000.0 / 200_000.0
    )  # lists of 1,024, each form's best within 10 ms
    assert figures["gpu_bytes_per_row"] == {
        "bound_h2d": 250.0,
        "bound_d2h": 4.0,
        "served_pcie_h2d": 40.0,
        "served_pcie_d2h": 4.0,
    }
    assert figures["gpu_step_times"] == [{"model": "dense", "queue_us": 100.0, "compute_us": 900.0}]
    targets = {t["key"]: t for t in figures["gpu_targets"]}
    assert targets["lists_4096"]["measured"] == 1_200_000.0 and not targets["lists_4096"]["met"]
    assert targets["lists_1024"]["measured"] == 600_000.0 and targets["lists_1024"]["met"]  # p99 <= 5 ms
    assert targets["served_vs_bound"]["met"]


def test_nothing_measured_leaves_every_key_empty():
    figures = bench_figures(
        [StepResult("bench-bound", 0, "failed"), StepResult("bench-ids-lists", 0, "skipped")]
    )
    assert set(figures) == set(FIGURES)
    assert (
        figures["gpu_bound_rows_per_s"]
        is figures["gpu_served_rows_per_s"]
        is figures["gpu_served_vs_bound"]
        is None
    )
    assert not any(t["met"] for t in figures["gpu_targets"])
    assert bench_markdown([], figures) == []


def test_the_markdown_lists_measured_and_skipped_points():
    served = [point("ids", "list", 4096, 2, 1_200_000.0, 9.5)]
    served.append(
        {"form": "ids", "shape": "list", "candidates": 8192, "concurrency": 1, "skipped": "too long"}
    )
    steps = results(served)
    text = "\n".join(bench_markdown(steps, bench_figures(steps)))
    assert "| ids | list | 4096 | 2 | 1,200,000 |" in text
    assert "| ids | list | 8192 | 1 | skipped: too long |" in text
    assert "dense 0.10 / 0.90" in text
