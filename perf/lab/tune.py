"""``recserve lab tune``: sweep the step scheduling with perf_analyzer under a p99 target, keep the best.

The sweep is coordinate-wise, one restart of tritonserver per trial plan (each alone on the
machine): first ``max_queue_delay_microseconds``, then ``preferred_batch_size`` at the best delay,
then the instance count of each step in turn. Each plan is measured at a ladder of concurrencies
per client batch size; its capacity at a batch size is the highest rows/s whose p99 meets the
target (the same rule ``recserve bench`` reads its ratios by), and it scores the geometric mean of
its capacities (0, out, when a batch size meets the target at no concurrency). The ``confirm``
best plans are then measured a second time and judged on both measurements (mean rows/s, worst
p99), so that one lucky window on a shared machine does not decide. The best plan is written back
into the spec's ``[serving]`` section and its configs are regenerated.
"""

from __future__ import annotations

import logging
import math
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from recserve.build import configs
from recserve.build.configs import ServingPlan
from recserve.core.names import STEPS
from recserve.core.spec.model import ModelSpec
from recserve.perf.bench.analyzer import LOOSE_STABILITY, measure_point
from recserve.perf.bench.input_data import write_input_data
from recserve.server import Ports, TritonServer

LOGGER = logging.getLogger(__name__)

DEFAULT_WORKLOADS = ((1, 4), (1, 8), (1, 16), (64, 1), (64, 2), (64, 4))
# 0: a batch is whatever waits when the instance frees up (no wait at low load; docs/performance.md)
DEFAULT_DELAYS = (0, 100, 500, 1000, 2000, 4000)
DEFAULT_INSTANCES = (1, 2)


@dataclass(frozen=True)
class Trial:
    """One plan measured at every workload ``(client batch, concurrency)``."""

    plan: ServingPlan
    workloads: tuple[tuple[int, int], ...]
    rows_per_s: tuple[float, ...]
    p99_ms: tuple[float, ...]

    def capacity(self, p99_target_ms: float) -> dict[int, float]:
        """Per client batch size: the highest rows/s among its concurrencies whose p99 meets the target."""
        best: dict[int, float] = {}
        for (batch, _), rows, p99 in zip(self.workloads, self.rows_per_s, self.p99_ms, strict=True):
            best[batch] = max(best.get(batch, 0.0), rows if p99 <= p99_target_ms else 0.0)
        return best

    def score(self, p99_target_ms: float) -> float:
        """Geometric mean over client batch sizes of :meth:`capacity`; 0 when one has none."""
        values = list(self.capacity(p99_target_ms).values())
        if not values or min(values) <= 0:
            return 0.0
        return math.exp(sum(math.log(v) for v in values) / len(values))


def combine(first: Trial, second: Trial) -> Trial:
    """Two measurements of one plan as one: mean rows/s, worst p99 (noise does not flatter a plan)."""
    return Trial(
        first.plan,
        first.workloads,
        tuple((a + b) / 2 for a, b in zip(first.rows_per_s, second.rows_per_s, strict=True)),
        tuple(max(a, b) for a, b in zip(first.p99_ms, second.p99_ms, strict=True)),
    )


def best_trial(trials: Sequence[Trial], p99_target_ms: float) -> Trial | None:
    """The best-scoring trial that meets the target at every workload (None if none does)."""
    scored = [t for t in trials if t.score(p99_target_ms) > 0]
    return max(scored, key=lambda t: t.score(p99_target_ms), default=None)


def admission_cap(trial: Trial, p99_target_ms: float, share: float = 0.9) -> int:
    """The access layer's in-flight cap per replica (``[access] max_requests``) for a tuned plan.

    Per client batch size, the knee is the fewest requests in flight whose rows/s reach ``share`` of
    that batch size's capacity within the target: past it, more in flight only queues. The cap is
    the largest knee, so that no measured workload is held under ``share`` of its capacity. A batch
    size with no point within the target does not count; with none at all, the cap is 1.
    """
    knees = []
    for batch, best in trial.capacity(p99_target_ms).items():
        if best > 0:
            knees.append(
                min(
                    concurrency
                    for (b, concurrency), rows, p99 in zip(
                        trial.workloads, trial.rows_per_s, trial.p99_ms, strict=True
                    )
                    if b == batch and p99 <= p99_target_ms and rows >= share * best
                )
            )
    return max(knees, default=1)


def preferred_choices(spec: ModelSpec) -> list[tuple[int, ...]]:
    """Preferred batch sizes worth trying: none, and each batch bucket of at least 8 rows below the max."""
    return [(), *((b,) for b in spec.serving.batch_buckets if 8 <= b < spec.model.max_batch_size)]


Measure = Callable[[ServingPlan], Trial]


def sweep(
    spec: ModelSpec,
    measure_plan: Measure,
    p99_target_ms: float,
    delays: Sequence[int] = DEFAULT_DELAYS,
    instance_counts: Sequence[int] = DEFAULT_INSTANCES,
    progress: Callable[[str], None] = LOGGER.info,
    confirm: int = 3,
) -> tuple[Trial | None, list[Trial]]:
    """Coordinate-wise search from the spec's plan, then the ``confirm`` best plans measured again.

    Returns the best confirmed trial (None when no plan met the target) and every trial.
    """
    trials: list[Trial] = []
    current = ServingPlan.from_spec(spec)

    def try_all(plans: Sequence[ServingPlan]) -> None:
        nonlocal current
        for plan in plans:
            if any(t.plan == plan for t in trials):
                continue
            trial = measure_plan(plan)
            trials.append(trial)
            progress(
                f"[tune] {plan}: rows/s {[round(r) for r in trial.rows_per_s]}, "
                f"p99 ms {[round(p, 1) for p in trial.p99_ms]}"
            )
        best = best_trial(trials, p99_target_ms)
        if best is not None:
            current = best.plan

    try_all([replace(current, max_queue_delay_microseconds=d) for d in delays])
    try_all([replace(current, preferred_batch_sizes=p) for p in preferred_choices(spec)])
    for step in STEPS:
        try_all([replace(current, instances={**current.instances, step: n}) for n in instance_counts])
    # a shared machine is noisy: measure the finalists again and decide on both measurements
    ranked = sorted(
        (t for t in trials if t.score(p99_target_ms) > 0), key=lambda t: t.score(p99_target_ms), reverse=True
    )
    finalists = ranked[:confirm]
    confirmed = []
    for trial in finalists:
        again = combine(trial, measure_plan(trial.plan))
        progress(
            f"[tune] confirmed {trial.plan}: rows/s {[round(r) for r in again.rows_per_s]}, "
            f"p99 ms {[round(p, 1) for p in again.p99_ms]}"
        )
        confirmed.append(again)
    return best_trial(confirmed, p99_target_ms), trials + confirmed


def perf_analyzer_measure(
    spec: ModelSpec,
    repository: Path,
    workdir: Path,
    workloads: Sequence[tuple[int, int]],
    measurement_ms: int,
) -> Measure:
    """A :data:`Measure` that serves each plan from a variant repository and runs perf_analyzer (gRPC)."""
    data = write_input_data(spec, workdir / "input_data.json")

    def run(plan: ServingPlan) -> Trial:
        variant = configs.write_variant(spec, repository, workdir / "variant", plan=plan)
        rows, p99 = [], []
        with TritonServer(variant, Ports.free(), log_path=workdir / "server.log") as server:
            for batch, concurrency in workloads:
                point = measure_point(
                    spec, server.grpc_url, "grpc", batch, concurrency, measurement_ms, data=data,
                    stability_percentage=LOOSE_STABILITY,
                )  # fmt: skip
                # a stalled point (no stable windows) meets no p99 target
                rows.append(point.rows_per_s if point else 0.0)
                p99.append(point.p99_us / 1e3 if point else math.inf)
        return Trial(plan, tuple(workloads), tuple(rows), tuple(p99))

    return run


def _toml_value(value: int | Sequence[int]) -> str:
    return f"[{', '.join(str(v) for v in value)}]" if isinstance(value, (tuple, list)) else str(value)


def write_back(spec_file: Path, plan: ServingPlan, max_requests: int | None = None) -> None:
    """Write the plan into ``[serving]`` and ``[serving.instances]``, the cap into ``[access]``.

    ``max_requests`` None leaves ``[access]`` alone. Lines are edited in place (comments and layout
    are kept); a missing key is added at the end of its table, a missing ``[access]`` table at the
    end of the file. A plan without dynamic batching cannot be written (the spec always batches).
    """
    if plan.max_queue_delay_microseconds is None:
        raise ValueError("the spec always enables dynamic batching; this plan has none")
    wanted: dict[str, dict[str, int | Sequence[int]]] = {
        "serving": {
            "max_queue_delay_microseconds": plan.max_queue_delay_microseconds,
            "preferred_batch_size": tuple(plan.preferred_batch_sizes),
        },
        "serving.instances": dict(plan.instances),
        **({"access": {"max_requests": max_requests}} if max_requests is not None else {}),
    }
    lines = spec_file.read_text().splitlines()
    section, last_key_line, seen = None, {}, set()
    header = re.compile(r"^\s*\[+\s*([^\]]+?)\s*\]+")
    assignment = re.compile(r"^(\s*)([A-Za-z0-9_]+)(\s*=\s*)([^#]*?)(\s*#.*)?$")
    for i, line in enumerate(lines):
        if match := header.match(line):
            section = match.group(1)
            continue
        if section in wanted and (match := assignment.match(line)):
            key = match.group(2)
            last_key_line[section] = i
            if key in wanted[section]:
                indent, _, eq, _, comment = match.groups()
                lines[i] = f"{indent}{key}{eq}{_toml_value(wanted[section][key])}{comment or ''}"
                seen.add((section, key))
    inserts = []
    for section, values in wanted.items():
        missing = [f"{k} = {_toml_value(v)}" for k, v in values.items() if (section, k) not in seen]
        if section in last_key_line:
            inserts.append((last_key_line[section] + 1, missing))
        elif section == "access":  # optional in a spec: the table is added
            inserts.append((len(lines), ["", "[access]", *missing]))
        else:
            raise ValueError(f"{spec_file} has no [{section}] table")
    for at, new_lines in sorted(inserts, reverse=True):
        lines[at:at] = new_lines
    spec_file.write_text("\n".join(lines) + "\n")


def run_tune(
    spec: ModelSpec,
    spec_file: Path,
    repository: Path,
    p99_target_ms: float,
    workloads: Sequence[tuple[int, int]] = DEFAULT_WORKLOADS,
    measurement_ms: int = 2000,
    delays: Sequence[int] = DEFAULT_DELAYS,
    instance_counts: Sequence[int] = DEFAULT_INSTANCES,
    write: bool = True,
    progress: Callable[[str], None] = LOGGER.info,
) -> tuple[Trial | None, list[Trial]]:
    """Sweep; then (``write``) store the best plan and its cap in ``spec_file``, regenerate the configs.

    The cap is :func:`admission_cap`; the regenerated configs are ``repository``'s.
    """
    from recserve.core.spec.parse import load_spec

    with tempfile.TemporaryDirectory(prefix="recserve-tune-") as tmp:
        measure_plan = perf_analyzer_measure(spec, repository, Path(tmp), workloads, measurement_ms)
        best, trials = sweep(spec, measure_plan, p99_target_ms, delays, instance_counts, progress)
    if best is not None and write:
        cap = admission_cap(best, p99_target_ms)
        write_back(spec_file, best.plan, cap)
        configs.write_configs(load_spec(spec_file), repository)
        progress(
            f"[tune] wrote {best.plan} and [access] max_requests = {cap} to {spec_file}; "
            f"regenerated the configs in {repository}"
        )
    return best, trials
