"""``recserve bench-loop --quick``: the loop and a frozen copy served side by side on a drifting stream.

Real tritonservers, ``recserve join`` and ``recserve learn`` as processes, each killed with SIGKILL
mid-run and started again: the summary has its keys, every row sent reached the log, every example
owed was emitted once and trained, the log scored again gives the served scores, and the loop
published at least one version. The AUC gain is a benchmark figure, not asserted here.
"""

import json
import subprocess
import sys

from recserve.perf.bench.loop.figures import KEYS


def test_the_quick_loop_bench_writes_its_keys_and_loses_no_record_across_kills(repository, tmp_path):
    written = tmp_path / "out" / "loop.json"
    result = subprocess.run(
        [sys.executable, "-m", "recserve.cli", "bench-loop", "--quick", "--repository", str(repository),
         "--output", str(tmp_path / "results"), "--json", str(written)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(written.read_text())
    runs = list((tmp_path / "results").glob("loop-*/summary.json"))
    assert len(runs) == 1 and json.loads(runs[0].read_text()) == summary
    assert tuple(summary)[: len(KEYS)] == KEYS
    assert summary["log_records_lost"] == 0 and summary["log_rows_sent"] > 0
    assert summary["skew_rows_rescored"] > 0 and summary["skew_max_abs"] <= 1e-6
    assert summary["loop_published_versions"] >= 1
    assert summary["exits"] == {"joiner": 0, "learner": 0}  # both ran to the end
    assert [kill["process"] for kill in summary["loop_kills"]] == ["joiner", "learner"]
    assert summary["loop_examples_owed"] > 0 and summary["loop_examples_lost"] == 0
    assert summary["loop_examples_duplicated"] == 0
    assert len(summary["auc_by_round"]) == 6
    assert (written.parent / "loop_auc.png").stat().st_size > 0
    assert "loop_auc_gain" in result.stdout
