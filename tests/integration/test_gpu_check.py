"""The GPU check's dry run end to end: the kit fits one call, resolves for cp312 from itself alone
(no index), the bench walks all of its steps on the CPU (tiny sizes) and its summary carries the
bench's keys, and the other GPU steps are skipped for a reason.

The dry run downloads the kit's wheels on its first run (then reuses ``.gpu-kit``).
"""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from recserve.perf.gpu_check.bench.report import FIGURES
from recserve.perf.gpu_check.common import BENCH_DRY, BENCH_PART, KIT, LIMIT_BYTES, TARGETS
from recserve.perf.gpu_check.kit import check_files, check_resolution, unpack_kit
from recserve.perf.gpu_check.steps import STEPS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(
        [sys.executable, "-m", "recserve.perf.gpu_check", "dry-run", "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), out


def steps_of(summary):
    return {step["name"]: step for step in summary["steps"]}


def test_the_kit_fits_one_call(dry_run):
    summary, _ = dry_run
    assert summary["plan"]["carry"] == [KIT]
    assert summary["fits"] and summary["size"]["total"] <= LIMIT_BYTES == 64 * 2**20
    assert summary["size"]["working tree"] > 0 and summary["size"][f"{KIT}/wheels.tar.xz"] > 0


def test_every_requirement_resolves_from_the_kit_for_cp312(dry_run):
    summary, _ = dry_run
    install = steps_of(summary)["install"]
    assert install["status"] == "ok", install["detail"]
    resolved = set(install["data"]["resolved"])
    assert {"nvidia-pytriton==0.7.0", "tritonclient==2.50.0", "numpy==1.26.4"} <= resolved
    assert any(name.startswith("nvidia-cuda-runtime-cu12==") for name in resolved)
    built = install["data"]["built"]
    assert any(name.startswith("recserve-") for name in built)
    assert any(name.startswith("geventhttpclient-2.0.2") for name in built)


def test_the_summary_lists_every_step_and_skips_the_gpu_ones(dry_run):
    summary, out = dry_run
    steps = steps_of(summary)
    assert list(steps) == [step.name for step in STEPS]
    markdown = (out / "summary.md").read_text()
    for step in STEPS:
        assert f"| {step.name} |" in markdown
        if step.gpu and not step.walks_dry:
            assert steps[step.name]["status"] == "skipped"
            assert "no GPU" in steps[step.name]["detail"]
        else:
            assert steps[step.name]["status"] == "ok", steps[step.name]["detail"]
    with tarfile.open(out / "logs.tar.gz") as logs:
        assert "logs/longseq-local.log" in logs.getnames()  # part 5 keeps its servers' logs


def test_a_kit_with_a_wheel_removed_fails_the_checks(dry_run, tmp_path):
    kit = ROOT / KIT
    wheels = unpack_kit(kit, tmp_path)
    assert check_files(kit, wheels) == []
    removed = next(wheels.glob("protobuf-*.whl"))
    removed.unlink()
    assert any("protobuf" in problem for problem in check_files(kit, wheels))
    problems, _ = check_resolution(wheels, tmp_path / "scratch")
    assert problems and "do not resolve from the kit" in problems[0]


def test_the_bench_walks_every_step_on_the_cpu_and_reports_its_keys(dry_run):
    summary, out = dry_run
    steps = steps_of(summary)
    bench = [name for name, step in steps.items() if step["part"] == BENCH_PART]
    assert bench == [
        "bench-build",
        "bench-bound",
        "bench-serve",
        "bench-ids-lists",
        "bench-ids-rows",
        "bench-bytes",
    ]
    assert set(FIGURES) <= set(summary)
    bound = steps["bench-bound"]["data"]
    assert bound["device"] == "cpu" and bound["lookup"] == "DeviceTier" and bound["resident_tables"] > 0
    assert [(p["users"], p["candidates"]) for p in bound["points"]] == list(BENCH_DRY.bound)
    assert summary["gpu_bound_rows_per_s"] == max(p["rows_per_s"] for p in bound["points"]) > 0
    assert summary["gpu_parity"]["bound"]["max_abs_diff"] < 1e-5
    served = summary["gpu_parity"]["served"]
    assert (
        served["ok"]
        and served["list_ids_vs_bytes_max_abs_diff"] == served["rows_ids_vs_bytes_max_abs_diff"] == 0
    )
    measured = [p for name in bench[3:] for p in steps[name]["data"]["points"]]
    shapes = {(p["form"], p["shape"], p["candidates"], p["concurrency"]) for p in measured}
    lists = {("ids", "list", n, c) for n in BENCH_DRY.lists for c in BENCH_DRY.concurrency}
    rows = {("ids", "rows", BENCH_DRY.rows_batch, c) for c in BENCH_DRY.concurrency}
    assert lists | rows <= shapes and {p["form"] for p in measured} == {"ids", "bytes"}
    for point in measured:
        assert point["rows_per_s"] > 0 and point["failures"] == 0
        assert {s["model"] for s in point["steps"]} >= {"embedding_lookup", "dense"}
    # no point of these CPU runs need be within 10 ms; where one is, it is the id form's best such point
    best = summary["gpu_served_best"]
    if best is not None:
        assert best["form"] == "ids" and best["p99_ms"] <= 10.0
        assert summary["gpu_served_vs_bound"] == best["rows_per_s"] / summary["gpu_bound_rows_per_s"]
    assert [t["key"] for t in summary["gpu_targets"]] == [key for key, *_ in TARGETS] + ["served_vs_bound"]
    markdown = (out / "summary.md").read_text()
    assert "## The bench (cpu)" in markdown and "| ids | list |" in markdown
