"""``recserve lab degrade``: a spike over measured capacity, shed-only and with degradation, side by side.

Traffic is candidate lists (generated rows with click labels) whose values follow a lognormal
distribution (a few requests are worth most). The caller orders each list by its prior (the lab's
stand-in: the full-compute logit plus unit normal noise), so a level's cap keeps its head. Two
servers of the same built repository run one after the other, each pinned to the same cores (the
load generator on the others):

* ``shed``: today's shedding, the ``latency_first`` queue policy (a request that could not start
  the first step within its budget is refused, whatever it was worth), with ``[degrade]`` off even
  where the spec and its repository have it on;
* ``degrade``: the repository served with the spec's ``[degrade]`` (the lab's levels where the spec
  has none): each request at the level its value pays for, lambda following the queue wait.

Capacity (lists per second) is measured closed-loop on the shed server; then each server gets the
same open-loop schedule: normal load (half of capacity), a 2x spike, normal, a 4x spike, normal.
Per policy and phase the report gives the served p99 over the first normal phase's, the shares of
value served in full, degraded and refused, the value-weighted quality retained against full compute
(:mod:`recserve.perf.lab.degrade_report`), the top value decile's share degraded and refused, and
lambda over time (``--plot FILE``: a PNG of lambda, the p99 and the levels per quarter second), and
with ``--costs`` what each level really costs. With ``--access`` both servers stand behind the access
layer (:func:`serving`), so that the degrade server has the value door in front of it.
Figures depend on the machine's other load: a single run is provisional.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from recserve.access import AccessLayer, ProxyPorts
from recserve.build.configs import write_variant
from recserve.core.names import PROBABILITY
from recserve.core.sections.serving import AccessSection
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import parse_spec
from recserve.perf.bench.candidates import closed_loop_rate
from recserve.perf.harness.traffic import infer_inputs
from recserve.perf.lab.degrade_costs import measure_costs, shed_spec, with_small_dense
from recserve.perf.lab.degrade_report import PhaseFigures, level_quality, phase_figures, table, windows
from recserve.perf.lab.degrade_traffic import SERVED, LabShape, ListPool, send_phases
from recserve.perf.lab.overload import Cores, pinned
from recserve.server import Ports, TritonServer

#: The ``[degrade]`` the lab serves where the spec has none (lambda's loop read ten times a second).
#: Costs and qualities measured (docs/design/degrade.md): each level served alone against full
#: (``--costs``: 32 candidates and items 0.67-0.86, 8 and 8 0.53-0.68, the same with the smaller
#: network 0.61, the caller's order beside the ensemble 0.12-0.16; a refusal at the first step
#: 0.10-0.19, left undeclared: declared, the 4x spike's p99 was two to three times as long); the
#: caller's prior is good, so its first 8 candidates hold most of the clicks (``level_quality``: the
#: 8-candidate levels and the caller's order 0.98-0.99). The smaller network alone (all
#: candidates) costs about as much as full here, so it is not a level of the lab's.
#: ``full_value``: the top value decile (lognormal(0, 1)'s 90th percentile is 3.6) is always served
#: in full.
LAB_DEGRADE = {
    "enabled": True,
    "levels": [
        {"name": "trimmed", "cost": 0.8, "quality": 0.99, "max_candidates": 32, "history_length": 32},
        {"name": "minimal", "cost": 0.64, "quality": 0.97, "max_candidates": 8, "history_length": 8},
        {
            "name": "lean",
            "cost": 0.6,
            "quality": 0.96,
            "max_candidates": 8,
            "history_length": 8,
            "small_dense": True,
        },
        # sent beside the ensemble by the access layer's door (--access); the steps never choose it
        {"name": "order", "cost": 0.16, "quality": 0.95, "caller_order": True},
    ],
    "small_dense": {"bottom_mlp": [16], "top_mlp": [32], "attention_heads": 1},
    "full_value": 3.5,
    "target_queue_ms": 15.0,
    "interval_s": 0.05,
    "gain": 0.5,
    "max_lambda": 4.0,
    # no priority_value: on tritonserver 2.51 priority levels stall the batcher (docs/design/degrade.md)
}
SHED_QUEUE = "latency_first"
#: Runs at most of a measurement a stalled queue spoiled (the shed server's queue timeouts): a
#: closed-loop capacity run where most lists were refused, or a schedule whose normal phase served none.
CAPACITY_TRIES = 3
#: Closed-loop readings of the capacity, the largest kept: with one reading it moved from 555 to 747
#: lists/s between runs (2026-12-06), a slow reading making a run's "2x" less of an overload.
CAPACITY_READINGS = 3
#: The access layer's admission cap per server in the lab (``--access``): out of the way of both policies.
ACCESS_CAP = 4096
LOGGER = logging.getLogger(__name__)
#: The caller's prior: its order is the full-compute logit plus normal noise of this deviation.
PRIOR_NOISE = 1.0


def degrade_spec(spec: ModelSpec, overrides: dict | None = None) -> ModelSpec:
    """The spec with ``[degrade]`` on: its own section where enabled, else the lab's; ``overrides`` on top."""
    section = spec.source["degrade"] if spec.degrade.enabled else LAB_DEGRADE
    return parse_spec({**spec.source, "degrade": {**section, **(overrides or {})}})


def full_scores(url: str, spec: ModelSpec, pool: ListPool, tries: int = 3) -> list[np.ndarray]:
    """Each list's scores at full compute, one request at a time on an idle server.

    A request the shed server's queue policy refuses (a stall of a shared machine can keep it past
    the policy's 5 ms) is sent again, up to ``tries`` times.
    """
    model = spec.candidates_model
    assert model is not None
    scores = []
    with grpcclient.InferenceServerClient(url) as client:
        for request in pool.requests:
            for attempt in range(tries):
                try:
                    result = client.infer(model, infer_inputs(grpcclient, request))
                    break
                except InferenceServerException as exc:
                    if exc.status() != "StatusCode.UNAVAILABLE" or attempt == tries - 1:
                        raise
                    time.sleep(0.05)
            scores.append(result.as_numpy(PROBABILITY).reshape(-1))
    return scores


class LambdaTimeline:
    """Lambda, the load, the capacity and the access layer's door's lambda, read every ``every_s``."""

    def __init__(self, metrics_url: str, every_s: float = 0.25) -> None:
        self.url, self.every_s = metrics_url, every_s
        # (t, lambda, load, capacity lists/s, the largest lambda the access layer's door set lately)
        self.points: list[tuple[float, float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        origin = time.monotonic()
        while not self._stop.wait(self.every_s):
            try:
                text = urllib.request.urlopen(self.url, timeout=1).read().decode()  # noqa: S310 (loopback)
            except OSError:
                continue
            named = r"^recserve_degrade_(lambda|load|capacity|door_lambda)\S* ([0-9.eE+-]+)$"
            found = dict(re.findall(named, text, re.MULTILINE))
            if found:
                point = (
                    time.monotonic() - origin,
                    float(found.get("lambda", 0)),
                    float(found.get("load", 0)),
                    float(found.get("capacity", 0)),
                    float(found.get("door_lambda", 0)),
                )
                self.points.append(tuple(round(x, 4) for x in point))  # type: ignore[arg-type]

    def __enter__(self) -> LambdaTimeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@contextmanager
def serving(
    repository: Path, workdir: Path, name: str, config_name: str | None, cores: Cores, access: bool
) -> Iterator[tuple[str, TritonServer]]:
    """The gRPC address requests go to, and the tritonserver behind it.

    ``access``: behind the access layer (Envoy pinned to the load generator's cores, its admission cap
    out of the way: the policies are compared, not the cap), with the value door where the served
    spec's ``[degrade]`` has one; else the server itself.
    """
    if not access:
        log = workdir / f"{name}.log"
        with TritonServer(
            repository, Ports.free(), log_path=log, config_name=config_name, cpus=cores.server
        ) as server:
            yield server.grpc_url, server
        return
    section = AccessSection(max_requests=ACCESS_CAP, weights={"stable": 100})
    layer = AccessLayer(
        section,
        {"stable": repository},
        workdir / f"{name}-access",
        ports=ProxyPorts.free(),
        config_name=config_name,
        server_cpus=cores.server,
        proxy_cpus=cores.client,
    )
    with layer:
        yield layer.grpc_url, layer.servers["stable"][0]


def run_policy(
    url: str,
    spec: ModelSpec,
    pool: ListPool,
    full: list[np.ndarray],
    schedule: list[tuple[str, float, float]],
    values: np.ndarray,
    cores: Cores,
) -> tuple[list[PhaseFigures], list[list[float | None]], dict[str, dict]]:
    """One server through the schedule.

    A run whose first (normal) phase served no list is run again, up to :data:`CAPACITY_TRIES`
    times: the shed server's queue policy can stall through a whole phase on a shared machine,
    refusing every list, and then the phases have no normal latency to be compared with.

    Returns the figures of each phase, the windows over time and each level's measured quality.
    """
    phases = [(r, s) for _, r, s in schedule]
    for _ in range(CAPACITY_TRIES):
        with pinned(cores.client):
            sent = send_phases(url, spec, pool, phases, values, spec.degrade.enabled)
        if any(o.phase == 0 and o.result == SERVED for o in sent):
            break
        LOGGER.warning("the normal phase served no list (a stalled queue); the schedule is run again")
        time.sleep(1.0)
    top_value = float(np.quantile(values, 0.9))
    by_phase = [[o for o in sent if o.phase == i] for i in range(len(schedule))]
    normal = phase_figures("normal", schedule[0][1], by_phase[0], full, pool.labels, float("nan"), top_value)
    figures = [
        phase_figures(name, rate, outcomes, full, pool.labels, normal.served_p99_ms, top_value)
        for (name, rate, _), outcomes in zip(schedule, by_phase, strict=True)
    ]
    names = spec.degrade.level_names if spec.degrade.enabled else ("full",)
    quality = {names[level]: kept for level, kept in level_quality(sent, full, pool.labels).items()}
    return figures, windows(sent), quality


def run_degrade_lab(
    spec: ModelSpec,
    repository: Path,
    workdir: Path,
    shape: LabShape,
    seed: int = 47,
    costs: bool = False,
    overrides: dict | None = None,
    access: bool = False,
) -> tuple[dict[str, list[PhaseFigures]], dict]:
    """Both policies through the same schedule; each one's figures per phase, and the JSON summary.

    ``costs``: also measure what each level costs (:mod:`recserve.perf.lab.degrade_costs`);
    ``overrides``: ``[degrade]`` keys set on the degrade server's section (``--headroom``); its
    ``capacity`` is the one measured here unless they set it (0: learned, ``--learned-capacity``);
    ``access``: both servers behind the access layer (:func:`serving`).
    """
    cores = Cores.split()
    pool = ListPool.generate(spec, shape.lists, shape.candidates, shape.length, seed)
    values = np.random.default_rng(seed).lognormal(0.0, 1.0, 20_000)
    policies: dict[str, list[PhaseFigures]] = {}
    series: dict[str, list[list[float | None]]] = {}
    queue = SHED_QUEUE if SHED_QUEUE in spec.serving.queue_policies else None
    shed = shed_spec(spec)
    shedding = repository if shed is spec else write_variant(shed, repository, workdir / "shed")
    with serving(shedding, workdir, "shed", queue, cores, access) as (url, _):
        pool, full = pool.ordered(shed, full_scores(url, shed, pool), PRIOR_NOISE, seed)
        with pinned(cores.client):
            assert shed.candidates_model is not None
            readings: list[float] = []
            for _ in range(CAPACITY_READINGS + CAPACITY_TRIES - 1):
                measured = closed_loop_rate(
                    url, shed.candidates_model, pool.requests[0], 1, 8, shape.capacity_s
                )
                if measured["failures"] <= measured["requests"]:
                    readings.append(measured["rows_per_s"])
                    if len(readings) == CAPACITY_READINGS:
                        break
                    continue
                # a reading where most lists were refused is not a capacity
                LOGGER.warning(
                    "capacity run: %d lists refused, %d served; measured again",
                    measured["failures"],
                    measured["requests"],
                )
                time.sleep(1.0)
        capacity = max(readings, default=measured["rows_per_s"])
        schedule = shape.phases(capacity)
        policies["shed"], series["shed"], _ = run_policy(url, shed, pool, full, schedule, values, cores)
    # the door knows the capacity the lab measured from the first batch, as a spec measured in advance
    served = degrade_spec(spec, {"capacity": capacity, **(overrides or {})})
    repository = with_small_dense(served, repository, workdir / "distilled", LOGGER.info)
    level_costs = measure_costs(served, repository, workdir, pool, shape.capacity_s, cores) if costs else None
    variant = write_variant(served, repository, workdir / "degrade")
    with serving(variant, workdir, "degrade", None, cores, access) as (url, server):
        full_scores(url, served, pool)  # warmed up as the shed server was, one at a time
        with LambdaTimeline(f"http://127.0.0.1:{server.ports.metrics}/metrics") as timeline:
            policies["degrade"], series["degrade"], quality = run_policy(
                url, served, pool, full, schedule, values, cores
            )
    summary = summarise(policies, capacity, shape, cores, timeline.points)
    summary["access"] = access
    summary["level_quality"] = quality
    if level_costs is not None:
        summary["level_costs"] = level_costs
    return policies, {**summary, "windows": series}


def summarise(
    policies: dict[str, list[PhaseFigures]],
    capacity: float,
    shape: LabShape,
    cores: Cores,
    timeline: list[tuple[float, float, float, float, float]],
) -> dict:
    """The JSON summary: the headline figures at 2x and 4x, then every phase of each policy."""
    phase = {p: {f.name: f for f in figures} for p, figures in policies.items()}
    out: dict = {}
    for spike in ("2x", "4x"):
        suffix = "" if spike == "2x" else "_4x"
        for p in ("degrade", "shed"):
            f = phase[p][f"spike_{spike}"]
            out[f"{p}_p99_ratio{suffix}"] = round(f.p99_ratio, 3)
            out[f"{p}_value_retained{suffix}"] = round(f.value_retained, 3)
            out[f"{p}_top_decile_degraded_or_refused{suffix}"] = round(
                f.top_decile_degraded + f.top_decile_refused, 3
            )
    normal = phase["degrade"]["normal"]
    out["degrade_normal_degraded_share"] = round(normal.value_degraded + normal.value_refused, 4)
    out["failed"] = sum(f.failed for figures in policies.values() for f in figures)
    out.update(
        capacity_lists_per_s=round(capacity, 1),
        shape=shape.__dict__,
        top_k=8,
        values="lognormal(0, 1)",
        cores=cores.describe(),
        load_average=[round(x, 2) for x in os.getloadavg()],
        phases={p: [f.summary() for f in figures] for p, figures in policies.items()},
        lambda_timeline=[list(point) for point in timeline],
    )
    return out


def degrade_command(
    spec: ModelSpec,
    repository: Path,
    quick: bool,
    json_path: Path | None = None,
    plot_path: Path | None = None,
    workdir: Path | None = None,
    costs: bool = False,
    overrides: dict | None = None,
    access: bool = False,
) -> int:
    """``recserve lab degrade``: prints the table and the headline figures; the JSON summary, the plot.

    ``workdir``: where the servers' logs and the variant repository stay (None: a temporary folder).
    """
    shape = LabShape.quick() if quick else LabShape()
    with tempfile.TemporaryDirectory(prefix="recserve-degrade-") as scratch:
        folder = Path(scratch) if workdir is None else workdir
        folder.mkdir(parents=True, exist_ok=True)
        policies, summary = run_degrade_lab(
            spec, repository, folder, shape, costs=costs, overrides=overrides, access=access
        )
    print(table(policies))
    shown = {k: v for k, v in summary.items() if k not in ("phases", "lambda_timeline", "shape", "windows")}
    print(json.dumps(shown))
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
    if plot_path is not None:
        from recserve.perf.lab.degrade_plot import plot

        print(f"plot: {plot(summary, plot_path)}")
    return 0 if summary["failed"] == 0 else 1
