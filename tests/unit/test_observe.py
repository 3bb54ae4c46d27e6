"""The Prometheus scrape config and the Grafana dashboard written for a spec."""

from __future__ import annotations

import dataclasses
import json

import pytest

from recserve.access import observe
from recserve.cli import main
from recserve.core.spec.parse import load_spec


def test_metric_names_are_the_series_a_query_reads():
    expr = (
        'sum by (tier) (rate(recserve_embedding_keys_total{table="C1"}[1m])) / ignoring(tier) group_left '
        "histogram_quantile(0.99, sum by (le) (rate(envoy_cluster_upstream_rq_time_bucket[5m])))"
    )
    assert observe.metric_names(expr) == {
        "recserve_embedding_keys_total",
        "envoy_cluster_upstream_rq_time_bucket",
    }
    exposition = '# HELP x y\nnv_inference_count{model="ctr",version="1"} 3\nrecserve_store_healthy 1\n'
    assert observe.exported_names(exposition) == {"nv_inference_count", "recserve_store_healthy"}


@pytest.mark.parametrize("name", ["ctr", "avazu"])
def test_the_dashboard_queries_the_spec_and_names_known_series(name, tmp_path):
    spec = load_spec(name)
    paths = observe.write(tmp_path, spec, ["127.0.0.1:8002"], ["127.0.0.1:9901"])
    board = json.loads(paths[1].read_text())
    assert board["uid"] == f"recserve-{name}" and len(board["panels"]) == len(observe.panels(spec))
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids)
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert any(f'model="{name}"' in e for e in exprs)
    names = set().union(*(observe.metric_names(e) for e in exprs))
    assert names and all(n.startswith(("nv_", "recserve_", "envoy_")) for n in names), names


def test_the_scrape_config_lists_every_target(tmp_path):
    yaml = pytest.importorskip("yaml")
    text = observe.prometheus_config(["127.0.0.1:8002", "127.0.0.1:18002"], ["127.0.0.1:9901"], interval_s=5)
    config = yaml.safe_load(text)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["tritonserver"]["static_configs"][0]["targets"] == ["127.0.0.1:8002", "127.0.0.1:18002"]
    assert (
        jobs["envoy"]["metrics_path"] == "/stats/prometheus" and config["global"]["scrape_interval"] == "5s"
    )
    assert "envoy" not in observe.prometheus_config(["127.0.0.1:8002"], [])


def test_the_observe_command_writes_both_files(tmp_path, capsys):
    assert main(["observe", "--output", str(tmp_path), "--triton", "127.0.0.1:8002"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / observe.PROMETHEUS_FILE), str(tmp_path / observe.DASHBOARD_FILE)]
    assert "127.0.0.1:9901" in (tmp_path / observe.PROMETHEUS_FILE).read_text()  # [access] admin_port


def test_with_logging_the_dashboard_shows_the_loop_from_series_the_log_the_joiner_and_the_learner_export(
    spec, tmp_path
):
    from recserve.backends.dense.network import CTRNet
    from recserve.backends.request_log.segments import ParquetSegments
    from recserve.backends.request_log.writer import RecordWriter
    from recserve.core.sections.logging import LoggingSection
    from recserve.loop.join import Join
    from recserve.loop.joiner import Joiner
    from recserve.loop.learner import Learner
    from recserve.loop.metrics import join_samples, learn_samples, text
    from recserve.loop.sources import FeedbackFiles, LogSegments
    from tests.store_tables import spec_store

    logged = dataclasses.replace(spec, logging=LoggingSection(enabled=True))
    loop_panels = [p for p in observe.panels(logged) if p not in observe.panels(spec)]
    assert len(loop_panels) == 4
    writer = RecordWriter(ParquetSegments(tmp_path / "log", 1 << 20, 60.0), capacity=4)
    joiner = Joiner(
        Join(10.0, 100.0), LogSegments(tmp_path / "log"), FeedbackFiles(tmp_path / "fb"), tmp_path, 1.0
    )
    learner = Learner(spec, spec_store(spec)[1], CTRNet(spec))
    exported = observe.exported_names(
        text([*writer.samples(), *join_samples(joiner), *learn_samples(learner)])
    )
    writer.close()
    for panel in loop_panels:
        for expr, _ in panel.queries:
            assert observe.metric_names(expr) <= exported, panel.title
    config = observe.prometheus_config(["127.0.0.1:8002"], [], loop=["127.0.0.1:9500"])
    assert "job_name: recserve_loop" in config and '"127.0.0.1:9500"' in config
