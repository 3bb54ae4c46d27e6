"""Watching the stack: a Prometheus scrape config and a Grafana dashboard, generated for a spec.

Prometheus scrapes every tritonserver's metrics port (Triton's ``nv_*`` series and recserve's
``recserve_*`` ones), Envoy's admin ``/stats/prometheus`` (``envoy_*``) and the canary
controller's ``/metrics`` (``recserve_access_*``). The dashboard's
panels read only those series; :func:`metric_names` lists the series a query names, so a test can
check each against what a running stack exports.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recserve.core.spec.model import ModelSpec

#: Files :func:`write` puts into its folder.
PROMETHEUS_FILE = "prometheus.yml"
DASHBOARD_FILE = "grafana-dashboard.json"
#: The rate window of every panel.
WINDOW = "1m"


@dataclass(frozen=True)
class Panel:
    """One time-series panel: a title, a unit (Grafana's) and its queries (PromQL, legend)."""

    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]


def panels(spec: ModelSpec) -> tuple[Panel, ...]:
    """The dashboard's panels for ``spec``'s ensemble and its steps.

    The L3 series only with Redis, the loop's only with ``[logging]``, the degradation's only with
    ``[degrade]``.
    """
    model = f'model="{spec.name}"'
    w = WINDOW
    keys = f"rate(recserve_embedding_keys_total[{w}])"
    per_step = f'model=~"{spec.name}|embedding_lookup|dense"'
    upstream_time = f"sum by (le) (rate(envoy_cluster_upstream_rq_time_bucket[{w}]))"
    redis = (  # exported only by stores with an L3
        (
            ("max(recserve_store_l3_breaker_open)", "L3 breaker open"),
            (f"sum by (reason) (rate(recserve_store_l3_errors_total[{w}]))", "L3 {{reason}}"),
        )
        if spec.store.redis_nodes
        else ()
    )
    loop = (  # the steps' log with [logging]; the joiner's and the learner's from their own endpoints
        (
            Panel(
                "Request log: records by outcome, and the writer's queue",
                "short",
                (
                    (f"sum by (outcome) (rate(recserve_log_records_total[{w}]))", "{{outcome}} /s"),
                    ("max(recserve_log_queue_depth)", "requests queued"),
                ),
            ),
            Panel(
                "Loop: examples joined and trained; versions published, refused, rolled back",
                "short",
                (
                    (f"sum(rate(recserve_join_examples_total[{w}]))", "joined /s"),
                    (f"sum(rate(recserve_learn_examples_total[{w}]))", "trained /s"),
                    (f"sum(increase(recserve_learn_published_versions_total[{w}]))", "published"),
                    (f"sum(increase(recserve_learn_refused_publishes_total[{w}]))", "refused"),
                    (f"sum(increase(recserve_learn_rollbacks_total[{w}]))", "rolled back"),
                ),
            ),
            Panel(
                "Loop: freshness, a label to the publish trained on it",
                "s",
                (
                    ('max(recserve_learn_freshness_seconds{quantile="0.99"})', "p99"),
                    ('max(recserve_learn_freshness_seconds{quantile="0.5"})', "p50"),
                ),
            ),
            Panel(
                "Loop: log loss, progressive and at the last publish check (learner against served)",
                "short",
                (
                    ("max(recserve_learn_progressive_log_loss)", "progressive"),
                    ("max by (scores) (recserve_learn_check_log_loss)", "{{scores}}"),
                ),
            ),
        )
        if spec.logging.enabled
        else ()
    )
    degrade = (  # exported only with [degrade]
        (
            Panel(
                "Degradation: requests by level and value tier, and lambda",
                "reqps",
                (
                    (
                        f"sum by (level, tier) (rate(recserve_degrade_requests_total[{w}]))",
                        "{{level}} {{tier}}",
                    ),
                    ("max(recserve_degrade_lambda)", "lambda"),
                    ("max(recserve_degrade_door_lambda)", "lambda at the door"),
                ),
            ),
        )
        if spec.degrade.enabled
        else ()
    )
    return (
        Panel(
            "Rows scored per second",
            "rowsps",
            ((f"sum(rate(nv_inference_count{{{model}}}[{w}]))", "rows/s"),),
        ),
        Panel(
            "Requests per second",
            "reqps",
            (
                (f"sum(rate(nv_inference_request_success{{{model}}}[{w}]))", "served"),
                (f"sum(rate(nv_inference_request_failure{{{model}}}[{w}]))", "failed"),
            ),
        ),
        Panel(
            "Requests the steps refused, by code (INVALID_ARG: the client's fault; others: the server's)",
            "reqps",
            ((f"sum by (code) (rate(recserve_request_errors_total[{w}]))", "{{code}}"),),
        ),
        Panel(
            "Latency through the proxy (p50, p99)",
            "ms",
            tuple(
                (
                    f"histogram_quantile({q}, {upstream_time})",
                    name,
                )
                for q, name in ((0.5, "p50"), (0.99, "p99"))
            ),
        ),
        Panel(
            "Mean time per step: queue and total",
            "µs",
            (
                (
                    f"sum by (model) (rate(nv_inference_queue_duration_us{{{per_step}}}[{w}]))"
                    f" / sum by (model) (rate(nv_inference_request_success{{{per_step}}}[{w}]))",
                    "{{model}} queue",
                ),
                (
                    f"sum by (model) (rate(nv_inference_request_duration_us{{{per_step}}}[{w}]))"
                    f" / sum by (model) (rate(nv_inference_request_success{{{per_step}}}[{w}]))",
                    "{{model}} total",
                ),
            ),
        ),
        Panel(
            "Embedding keys by tier (share)",
            "percentunit",
            ((f"sum by (tier) ({keys}) / ignoring(tier) group_left sum({keys})", "{{tier}}"),),
        ),
        Panel(
            "Embedding tables: version and update lag",
            "s",
            (
                ("max by (table) (recserve_table_update_lag_seconds)", "{{table}} lag"),
                ("max by (table) (recserve_table_version)", "{{table}} version"),
            ),
        ),
        Panel(
            "Dense shape buckets",
            "reqps",
            ((f"sum by (event) (rate(recserve_dense_bucket_requests_total[{w}]))", "{{event}}"),),
        ),
        Panel(
            "Shed at the proxy (over the in-flight cap)",
            "reqps",
            (
                (
                    f"sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_active_overflow[{w}]))",
                    "{{envoy_cluster_name}}",
                ),
            ),
        ),
        Panel(
            "Traffic per variant (the weights in effect; shadow copies too)",
            "reqps",
            (
                (
                    f"sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_total[{w}]))",
                    "{{envoy_cluster_name}}",
                ),
            ),
        ),
        Panel(
            "Served probability by dense version (mean)",
            "percentunit",
            (
                (
                    f"sum by (dense_version) (rate(recserve_served_probability_sum[{w}]))"
                    f" / sum by (dense_version) (rate(recserve_served_probability_count[{w}]))",
                    "version {{dense_version}}",
                ),
            ),
        ),
        Panel(
            "Canary: canary's share, stage and rollbacks",
            "short",
            (
                ("max(recserve_access_canary_percent)", "canary live %"),
                ("max(recserve_access_shadow_fraction) * 100", "mirrored %"),
                ("max(recserve_access_canary_stage)", "stage"),
                ("max(recserve_access_canary_rollbacks_total)", "rollbacks"),
            ),
        ),
        Panel("Store health", "short", (("min(recserve_store_healthy)", "healthy"), *redis)),
        *loop,
        *degrade,
    )


def dashboard(spec: ModelSpec) -> dict[str, Any]:
    """A Grafana dashboard (JSON model) of :func:`panels`, two panels a row, over a Prometheus source."""
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    items = []
    for index, panel in enumerate(panels(spec)):
        items.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": panel.title,
                "datasource": datasource,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "targets": [
                    {
                        "refId": chr(ord("A") + i),
                        "expr": expr,
                        "legendFormat": legend,
                        "datasource": datasource,
                    }
                    for i, (expr, legend) in enumerate(panel.queries)
                ],
            }
        )
    return {
        "title": f"recserve: {spec.name}",
        "uid": f"recserve-{spec.name}",
        "schemaVersion": 39,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
            ]
        },
        "panels": items,
    }


def prometheus_config(
    triton: Sequence[str],
    envoy: Sequence[str],
    interval_s: int = 5,
    canary: Sequence[str] = (),
    loop: Sequence[str] = (),
) -> str:
    """A Prometheus config (YAML) scraping tritonservers, Envoy's admin and the canary controller.

    Args:
        triton: ``host:port`` of each tritonserver's metrics endpoint.
        envoy: ``host:port`` of each Envoy admin interface (none: a stack without the proxy).
        interval_s: the scrape interval.
        canary: ``host:port`` of the canary controller's metrics (``recserve canary``).
        loop: ``host:port`` of the joiner's and the learner's metrics (``--metrics-port``).
    """
    lines = ["global:", f"  scrape_interval: {interval_s}s", "scrape_configs:"]
    jobs = (("tritonserver", "/metrics", triton), ("envoy", "/stats/prometheus", envoy))
    for job, path, targets in (
        *jobs,
        ("recserve_canary", "/metrics", canary),
        ("recserve_loop", "/metrics", loop),
    ):
        if targets:
            listed = ", ".join(json.dumps(t) for t in targets)
            lines += [
                f"  - job_name: {job}",
                f"    metrics_path: {path}",
                "    static_configs:",
                f"      - targets: [{listed}]",
            ]
    return "\n".join(lines) + "\n"


def write(
    folder: Path, spec: ModelSpec, triton: Sequence[str], envoy: Sequence[str], loop: Sequence[str] = ()
) -> list[Path]:
    """Write :data:`PROMETHEUS_FILE` and :data:`DASHBOARD_FILE` into ``folder``; their paths.

    ``loop``: ``host:port`` of ``recserve join`` and ``recserve learn`` metrics endpoints, scraped too.
    """
    folder.mkdir(parents=True, exist_ok=True)
    config, board = folder / PROMETHEUS_FILE, folder / DASHBOARD_FILE
    canary = [f"127.0.0.1:{spec.access.canary.metrics_port}"] if envoy else []  # beside the proxy
    config.write_text(prometheus_config(triton, envoy, canary=canary, loop=loop))
    board.write_text(json.dumps(dashboard(spec), indent=2) + "\n")
    return [config, board]


#: PromQL words that are not series: functions, aggregations and their modifiers.
_PROMQL_WORDS = frozenset(
    "sum min max avg count rate irate increase histogram_quantile by without on ignoring "
    "group_left group_right and or unless le".split()
)
_LABELS = re.compile(r"\{[^}]*\}")
_WORD = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The series a PromQL query reads (label matchers, label lists and functions left out)."""
    text = _LABELS.sub("", expr)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    return {w for w in _WORD.findall(text) if w not in _PROMQL_WORDS and not w[0].isdigit()}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: name, labels, value (comment lines left out)."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = dict(_LABEL.findall(match.group(2) or ""))
            yield match.group(1), labels, float(match.group(3))


def exported_names(text: str) -> set[str]:
    """Series names in a Prometheus text exposition (histogram buckets under their ``_bucket`` names)."""
    return {name for name, _, _ in parse_exposition(text)}
