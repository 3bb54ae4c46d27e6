"""``recserve bench-longseq --quick`` from a fresh output folder builds what it serves and writes its keys.

``--in-process`` then times the lookup step's parts on the bench repository it built.
"""

import json
import subprocess
import sys

KEYS = (
    "longseq_p99_ratio",
    "longseq_aa_p99_ratio",
    "longseq_throughput_ratio",
    "longseq_aa_throughput_ratio",
    "longseq_exact_max_abs",
)
WORKLOADS = {"w0", "w0_aa", "w1", "w2", "w2_redis", "w2_miss", "w2_builder"}


def test_the_quick_longseq_bench_writes_its_keys(repository, tmp_path):
    written = tmp_path / "longseq.json"
    result = subprocess.run(
        [sys.executable, "-m", "recserve.cli", "bench-longseq", "--quick", "--repository", str(repository),
         "--output", str(tmp_path / "results"), "--json", str(written)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(written.read_text())
    runs = list((tmp_path / "results").glob("longseq-*/summary.json"))
    assert len(runs) == 1 and json.loads(runs[0].read_text()).keys() == summary.keys()
    assert summary["run"]["folder"] == str(runs[0].parent) and summary["run"]["profile"] == "cpu"
    assert "ready" in (runs[0].parent / "local.log").read_text().lower()  # the server's log is kept
    for key in KEYS:
        assert key in summary, key
    assert "longseq_p99_ratio" in result.stdout
    point = summary["points"][0]
    assert set(point["workloads"]) in (WORKLOADS, WORKLOADS - {"w2_redis"})  # no Redis: a note says so
    for name, figures in point["workloads"].items():
        assert {"p50_ms", "p99_ms", "rows_per_s", "request_bytes", "steps"} <= set(figures)
        assert figures["sent"] == point["rate"] * summary["run"]["grid"]["seconds"], name  # mixed or alone
        assert figures["failed"] == 0 and 0.5 < figures["rows_per_s"] / point["offered_rows_per_s"] < 1.5, (
            name
        )
        lookup = {s["model"]: s for s in figures["steps"]}["embedding_lookup"]  # mixed: from its own phase
        assert lookup["requests"] > 0, name
    error = summary["clustered_error"]
    assert {"state_vs_full", "truncated_vs_full", "auc"} <= set(error)
    assert {"p50", "p99", "max"} == set(error["state_vs_full"])
    assert set(error["auc"]) == {"full", "state", "truncated"}
    _in_process(repository, tmp_path)


def _in_process(repository, tmp_path):
    """``--in-process`` on the bench repository just built: every part timed for every workload."""
    written = tmp_path / "steps.json"
    result = subprocess.run(
        [sys.executable, "-m", "recserve.cli", "bench-longseq", "--in-process", "--quick", "--repository",
         str(repository), "--output", str(tmp_path / "results"), "--json", str(written)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(written.read_text())
    assert set(summary["parts_us"]) == {"w0", "w2", "w2_python", "w2_eager"}
    for name, parts in summary["parts_us"].items():
        assert all(parts[p] > 0 for p in ("transform", "merge", "lookup")), name
        assert parts["total"] >= max(parts["transform"], parts["merge"], parts["lookup"]), name
        assert summary["total_p90_us"][name] >= parts["total"], name
    assert set(summary["excess_us"]) == {"w2", "w2_python", "w2_eager"}
    assert len(summary["excess_per_round_us"]["w2"]) == 2
    assert set(summary["refreshing"]) == {"w2", "w2_eager"}
    assert all(calls["others_us"] > 0 for calls in summary["refreshing"].values())
    assert "w2 - w0" in result.stdout
