"""``recserve bench-longseq --in-process``: where W2's time goes in the lookup step, in one process.

The served step (``embedding_lookup``) is built in process as an instance builds it: the bench
repository's store, the bench's users and their states in a local store, the step's cache of states.
It is then called with ``w0``'s requests (256-event rows, no user) and ``w2``'s (user id and a
64-event tail, every state cached), ``w2`` once more through a second step whose cache has
neither the compiled index nor the refresher (``w2_python``: every batch takes the Python path,
and a state past its time to live is read on the request path, as before them), and once more
through a third step whose refresher reads as soon as it is handed users, while the call that
handed them still runs (``w2_eager``: as before the refresher waited for the step's quiet
moments). The calls are interleaved one by one in a new order each cycle, one every ``1 / rate``
seconds: between two calls the process sleeps as a served instance waits between requests, so the
step meets the cold caches it meets there. Each call is timed in three parts: the feature
transform, the states' merge (with its counts), the lookup.

Per workload and part: the median over a round's calls, then the median over the rounds (and the
totals' 90th percentile, where the calls that read states on the request path show); the excess of
a ``w2`` workload over ``w0`` (their totals' difference) per round, then its median. For the
workloads with a refresher, the calls that handed it users (their states past their time to live)
apart: how many per round, and their totals' median, medians over the rounds.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recserve.backends.steps.lookup import EmbeddingLookup
from recserve.backends.steps.stateful_lookup import StatefulFeaturesToEmbeddings
from recserve.backends.steps.user_history import UserHistories
from recserve.backends.store.served import ServedStore
from recserve.backends.store.user_state.index import StateCache
from recserve.build.repository import version_dir
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.perf.bench.longseq import setup as setup
from recserve.perf.bench.longseq.bench import workload_wires
from recserve.perf.bench.longseq.error import FRESH_EVENTS
from recserve.perf.bench.longseq.load import mixed_order

LOGGER = logging.getLogger(__name__)

W0, W2, W2_PYTHON, W2_EAGER = "w0", "w2", "w2_python", "w2_eager"
PARTS = ("transform", "merge", "lookup", "total")
W2S = (W2, W2_PYTHON, W2_EAGER)


@dataclass(frozen=True)
class StepGrid:
    """How the step is called."""

    rate: float = 40.0  # calls per second, all workloads together
    calls: int = 400  # per workload and round
    rounds: int = 3
    rows: int = 16  # rows per request
    users: int = 256


def _timed(step: StatefulFeaturesToEmbeddings, inputs: dict[str, np.ndarray]) -> list[float]:
    """One call of the step, as ``step(inputs)`` runs it.

    Each part's seconds, the total, and 1 where the call handed users to the step's refresher.
    """
    refresher = step.users.refresher
    handed = refresher.queued if refresher is not None else 0
    with step.users.serving():
        start = time.perf_counter()
        features = step.transform.transform(inputs)
        transformed = time.perf_counter()
        step.merge_states(inputs, features)
        merged = time.perf_counter()
        step.lookup.lookup(features)
        done = time.perf_counter()
    refreshing = refresher is not None and refresher.queued != handed
    return [transformed - start, merged - transformed, done - merged, done - start, float(refreshing)]


def run_steps(
    base: ModelSpec,
    source: Path,
    output: Path,
    grid: StepGrid,
    progress: Callable[[str], None] = LOGGER.info,
    seed: int = 41,
) -> dict[str, Any]:
    """Time the step's parts for every workload; the figures as a summary (see the module docstring)."""
    spec = setup.longseq_spec(base)
    repository = setup.bench_repository(base, spec, source, output, progress)
    users = setup.bench_users(spec, grid.users, seed)
    wires = workload_wires(spec, users)
    requests = {
        name: [
            {k: v[i : i + grid.rows] for k, v in wires[name].items()} for i in range(0, grid.users, grid.rows)
        ]
        for name in (W0, W2)
    }
    requests[W2_PYTHON] = requests[W2_EAGER] = requests[W2]
    made = users.made
    rounds: list[dict[str, np.ndarray]] = []
    with tempfile.TemporaryDirectory(prefix="recserve-longseq-steps-") as tmp:
        states = setup.local_states(spec, Path(tmp))
        setup.write_states(spec, repository, made, states, FRESH_EVENTS)
        served = ServedStore.open(spec, version_dir(repository, EMBEDDING_LOOKUP, spec), start=False)
        steps: dict[str, StatefulFeaturesToEmbeddings] = {}
        try:
            lookup = EmbeddingLookup(spec, served.store)
            section = spec.user_state
            without_index: StateCache[Any] = StateCache(section.cache_users, section.cache_ttl_ms / 1000.0)
            steps = {
                W0: StatefulFeaturesToEmbeddings(spec, lookup, UserHistories(spec, states)),
                W2_PYTHON: StatefulFeaturesToEmbeddings(
                    spec, lookup, UserHistories(spec, states, cache=without_index, refresh=False)
                ),
                W2_EAGER: StatefulFeaturesToEmbeddings(spec, lookup, UserHistories(spec, states)),
            }
            eager = steps[W2_EAGER].users.refresher
            if eager is not None:  # reads at once, even while a call runs
                eager.quiet_s = eager.patience_s = 0.0
            steps[W2] = steps[W0]
            for name, step in steps.items():  # states cached, code warm
                for inputs in requests[name]:
                    step(inputs)
            for number in range(grid.rounds):
                progress(f"[bench-longseq --in-process] round {number + 1} of {grid.rounds}")
                rounds.append(_round(steps, requests, grid, seed=number))
        finally:
            for step in {id(s): s for s in steps.values()}.values():
                step.users.close()
            served.close()
    return _summary(rounds, grid)


def _round(
    steps: dict[str, StatefulFeaturesToEmbeddings],
    requests: dict[str, list[dict[str, np.ndarray]]],
    grid: StepGrid,
    seed: int,
) -> dict[str, np.ndarray]:
    """Each workload's calls (``[calls, 5]``: see :func:`_timed`), interleaved at ``rate``."""
    times: dict[str, list[list[float]]] = {name: [] for name in steps}
    sent = dict.fromkeys(steps, 0)
    interval = 1.0 / grid.rate
    due = time.perf_counter()
    for name in mixed_order(list(steps), grid.calls, seed):
        due += interval
        time.sleep(max(0.0, due - time.perf_counter()))
        batch = requests[name][sent[name] % len(requests[name])]
        sent[name] += 1
        times[name].append(_timed(steps[name], batch))
    return {name: np.array(rows) for name, rows in times.items()}


def _summary(rounds: list[dict[str, np.ndarray]], grid: StepGrid) -> dict[str, Any]:
    medians = [{name: np.median(t[:, :4], axis=0) * 1e6 for name, t in r.items()} for r in rounds]
    parts = {
        name: {part: float(np.median([m[name][i] for m in medians])) for i, part in enumerate(PARTS)}
        for name in medians[0]
    }
    excess = {name: float(np.median([m[name][-1] - m[W0][-1] for m in medians])) for name in W2S}
    # the slow tenth of the calls: where a batch's users' states are read on the request path
    p90 = {name: float(np.median([np.percentile(r[name][:, 3], 90) * 1e6 for r in rounds])) for name in parts}
    refreshing = {name: _refreshing(rounds, name) for name in (W2, W2_EAGER)}
    return {
        "rate": grid.rate,
        "calls": grid.calls,
        "rounds": grid.rounds,
        "rows": grid.rows,
        "parts_us": parts,
        "total_p90_us": p90,
        "excess_us": excess,
        "excess_per_round_us": {name: [float(m[name][-1] - m[W0][-1]) for m in medians] for name in W2S},
        "refreshing": refreshing,
        "load_average": os.getloadavg()[0],
    }


def describe_steps(summary: dict[str, Any]) -> str:
    """The summary as a table: each part's median microseconds per workload, then the excesses."""
    names = list(summary["parts_us"])
    lines = [
        f"the lookup step in process, {summary['rows']} rows a call, {summary['rate']:g} calls/s, "
        f"{summary['calls']} calls per workload and round, median of {summary['rounds']} rounds (us):",
        f"{'part':<10}" + "".join(f"{name:>13}" for name in names),
    ]
    for part in PARTS:
        lines.append(f"{part:<10}" + "".join(f"{summary['parts_us'][n][part]:>13.0f}" for n in names))
    lines.append(f"{'total p90':<10}" + "".join(f"{summary['total_p90_us'][n]:>13.0f}" for n in names))
    lines += [
        f"{name} - w0: {summary['excess_us'][name]:.0f} us (rounds: "
        + ", ".join(f"{x:.0f}" for x in summary["excess_per_round_us"][name])
        + ")"
        for name in W2S
    ]
    for name, calls in summary["refreshing"].items():
        if calls["total_us"] is not None:
            lines.append(
                f"{name}, calls that handed users to the refresher: {calls['calls']:.0f} a round, "
                f"total {calls['total_us']:.0f} us (the others: {calls['others_us']:.0f} us)"
            )
    lines.append(f"load average {summary['load_average']:.2f}")
    return "\n".join(lines)


def _refreshing(rounds: list[dict[str, np.ndarray]], name: str) -> dict[str, float | None]:
    """``name``'s calls that handed users to its refresher, and the others: count and median totals."""
    calls = [r[name] for r in rounds]
    handed = [c[c[:, 4] == 1, 3] for c in calls]
    others = [c[c[:, 4] == 0, 3] for c in calls]
    totals = [float(np.median(h)) * 1e6 for h in handed if h.size]
    return {
        "calls": float(np.median([h.size for h in handed])),
        "total_us": float(np.median(totals)) if totals else None,
        "others_us": float(np.median([np.median(o) * 1e6 for o in others if o.size])),
    }
