"""The GPU check's runner: a step that fails with results keeps them; a watched command reports as it runs."""

import sys
import time

import pytest

from recserve.perf.gpu_check.context import Context, Failed, Step
from recserve.perf.gpu_check.steps import run_step


@pytest.fixture
def ctx(tmp_path):
    return Context(
        tmp_path,
        tmp_path / "kit",
        tmp_path / "work",
        tmp_path / "out",
        True,
        [],
        deadline=time.monotonic() + 60,
    )


def test_a_step_cut_short_keeps_what_it_measured(ctx):
    def body(_ctx):
        raise Failed("timed out after 9 s", {"points": [{"rows_per_s": 1.0}]})

    result = run_step(ctx, Step("bench-ids-lists", 0, 30, body, gpu=True, walks_dry=True))
    assert result.status == "failed" and result.detail == "timed out after 9 s"
    assert result.data == {"points": [{"rows_per_s": 1.0}]}


def test_a_gpu_step_that_walks_dry_runs_in_a_dry_run_and_the_others_are_skipped(ctx):
    def body(_ctx):
        return "measured", {"points": []}

    assert run_step(ctx, Step("bench-bound", 0, 30, body, gpu=True, walks_dry=True)).status == "ok"
    skipped = run_step(ctx, Step("serve-cuda", 2, 30, body, gpu=True))
    assert skipped.status == "skipped" and skipped.detail == "no GPU (dry run)"


def test_a_watched_command_reports_at_its_end_and_fails_with_its_output(ctx):
    ticks = []
    ctx.watch("ok", [sys.executable, "-c", "print('done')"], 30, lambda: ticks.append(1))
    assert ticks and "done" in (ctx.logs / "ok.log").read_text()
    with pytest.raises(RuntimeError, match=r"exit 3[\s\S]*refused"):
        ctx.watch(
            "bad", [sys.executable, "-c", "import sys; print('refused'); sys.exit(3)"], 30, lambda: None
        )
