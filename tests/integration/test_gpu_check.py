"""The GPU check's dry run end to end: the kit fits one call, resolves for cp312 from itself alone
(no index), and the summary lists every step with the GPU ones skipped for a reason.

The dry run downloads the kit's wheels on its first run (then reuses ``.gpu-kit``).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recserve.perf.gpu_check.common import KIT, LIMIT_BYTES
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
        if step.gpu:
            assert steps[step.name]["status"] == "skipped"
            assert "no GPU" in steps[step.name]["detail"]
        else:
            assert steps[step.name]["status"] == "ok", steps[step.name]["detail"]
    assert (out / "logs.tar.gz").is_file()


def test_a_kit_with_a_wheel_removed_fails_the_checks(dry_run, tmp_path):
    kit = ROOT / KIT
    wheels = unpack_kit(kit, tmp_path)
    assert check_files(kit, wheels) == []
    removed = next(wheels.glob("protobuf-*.whl"))
    removed.unlink()
    assert any("protobuf" in problem for problem in check_files(kit, wheels))
    problems, _ = check_resolution(wheels, tmp_path / "scratch")
    assert problems and "do not resolve from the kit" in problems[0]
