"""``recserve lab versions``: today's served path against another checkout's, in one run, from one client.

A ratio that moved may have moved with its yardstick; the served figures themselves settle it. Two
servers run side by side on free loopback ports: another checkout's, started with the command line
given (``--other-serve``, ports appended; its own environment, so its steps load its own code), and
today's on ``--repository``. Each server's spec is read from the server, and each gets its request
pool from it (``generate(spec, 64, seed=5)``, kept to the inputs its ensemble declares). Then, round
after round, the servers take turns:

- batch 1, one in flight: request by request, each turn starting one server further on (as
  :func:`recserve.perf.harness.traffic.interleaved` does for the models of one server); p50, p99;
- each load of ``--loads`` (``BATCHxIN_FLIGHT``; by default 1x16 and 64x4): perf_analyzer windows,
  the servers alternating window by window; rows/s, p50, p99.

Triton's statistics give each step's queue and compute µs per request; every figure is the median
over the rounds. ``--ids`` also measures today's server with the id form of the same rows (what the
bench's perf_analyzer sends); its batch-1 step times are then the server's over both forms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from recserve.build.synthetic import generate
from recserve.clients.served_spec import served_spec
from recserve.core.names import BYTES_WIRE, EMBEDDING_LOOKUP, IDS_WIRE
from recserve.core.spec.model import ModelSpec
from recserve.perf.bench.analyzer import measure_point
from recserve.perf.bench.input_data import input_data
from recserve.perf.harness.stats import Snapshot, difference, snapshot
from recserve.perf.harness.traffic import infer_inputs
from recserve.server import LOOPBACK, Ports, TritonServer

LOGGER = logging.getLogger(__name__)

#: rows in each request pool (batch-1 requests cycle through them; one batch-64 warm-up request)
POOL_ROWS = 64
#: an input of an ensemble: (datatype, dims, optional)
Declared = tuple[str, tuple[int, ...], bool]


class OtherServer(TritonServer):
    """Another checkout's server: ``command`` with the three ports appended; its process group stopped."""

    def __init__(self, command: list[str], ports: Ports, log_path: Path) -> None:
        super().__init__(Path(), ports, log_path)
        self.command, self.new_group = command, True

    def start(self, timeout_s: float = 180.0) -> OtherServer:
        """Start ``command`` and wait until the server is ready (see :meth:`TritonServer.is_ready`)."""
        http, grpc, metrics = (str(p) for p in (self.ports.http, self.ports.grpc, self.ports.metrics))
        self.spawn([*self.command, "--http-port", http, "--grpc-port", grpc, "--metrics-port", metrics])
        self.wait_ready(timeout_s)
        return self


@dataclass(frozen=True)
class Target:
    """One system measured: a server's ensemble in one wire form, with its own requests."""

    label: str
    grpc_url: str
    http_url: str
    spec: ModelSpec
    inputs: dict[str, Declared]
    models: tuple[str, ...]  # the ensemble, then its steps
    singles: list[dict[str, np.ndarray]]
    full: dict[str, np.ndarray]  # all the pool's rows in one request
    data: Path  # perf_analyzer's input data

    @property
    def model(self) -> str:
        """The ensemble measured."""
        return self.models[0]


def declared_inputs(config: dict[str, Any]) -> dict[str, Declared]:
    """The inputs of a model config as JSON (``get_model_config(..., as_json=True)["config"]``)."""
    declared = {}
    for tensor in config.get("input", []):
        dims = tuple(int(d) for d in tensor.get("dims", ()))
        declared[tensor["name"]] = (
            tensor["data_type"].removeprefix("TYPE_"),
            dims,
            bool(tensor.get("optional")),
        )
    return declared


def keep_declared(wire: dict[str, Any], inputs: dict[str, Declared]) -> dict[str, Any]:
    """The tensors of ``wire`` that the ensemble declares.

    Raises:
        ValueError: a required input of the ensemble is not in ``wire``.
    """
    missing = [name for name, (_, _, optional) in inputs.items() if not optional and name not in wire]
    if missing:
        raise ValueError(f"the requests lack the ensemble's required inputs {missing}")
    return {name: value for name, value in wire.items() if name in inputs}


def input_differences(
    first: dict[str, Declared], second: dict[str, Declared], names: tuple[str, str]
) -> list[str]:
    """How two ensembles' inputs differ, one line each (none: the same names, types, shapes)."""

    def shown(declared: Declared) -> str:
        dtype, dims, optional = declared
        return f"{dtype}{list(dims)}{' optional' if optional else ''}"

    lines = [f"{name} only in {names[0]}" for name in first if name not in second]
    lines += [f"{name} only in {names[1]}" for name in second if name not in first]
    lines += [
        f"{name} {shown(first[name])} in {names[0]}, {shown(second[name])} in {names[1]}"
        for name in first
        if name in second and first[name] != second[name]
    ]
    return lines


def target(label: str, ports: Ports, form: str, scratch: Path) -> Target:
    """Read the served spec and ensemble, build the requests from that spec."""
    grpc_url, http_url = f"{LOOPBACK}:{ports.grpc}", f"{LOOPBACK}:{ports.http}"
    spec = served_spec(grpc_url, model=EMBEDDING_LOOKUP)
    with grpcclient.InferenceServerClient(grpc_url) as client:
        config = client.get_model_config(spec.name, as_json=True)["config"]
    inputs = declared_inputs(config)
    steps = tuple(step["model_name"] for step in config["ensemble_scheduling"]["step"])
    rows = generate(spec, POOL_ROWS, seed=5)
    singles = [
        keep_declared(rows.take(slice(i, i + 1)).to_wire(spec, form), inputs) for i in range(POOL_ROWS)
    ]
    document = input_data(spec, form=form)
    document["data"] = [keep_declared(entry, inputs) for entry in document["data"]]
    data = scratch / f"{label}-input-data.json"
    data.write_text(json.dumps(document))
    full = keep_declared(rows.to_wire(spec, form), inputs)
    return Target(label, grpc_url, http_url, spec, inputs, (spec.name, *steps), singles, full, data)


def same_requests(first: Target, second: Target) -> bool:
    """True when both targets send the very same tensors."""
    return all(
        a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        for a, b in zip(first.singles, second.singles, strict=True)
    )


def accumulate(total: Snapshot, before: Snapshot, after: Snapshot) -> None:
    """Add the counters' growth between two snapshots to ``total``."""
    for model, counters in after.items():
        entry = total.setdefault(model, dict.fromkeys(counters, 0))
        for key, value in counters.items():
            entry[key] += value - before.get(model, {}).get(key, 0)


def step_table(total: Snapshot, models: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per model of ``models``: queue and compute µs per request and requests per execution."""
    zeros = {model: dict.fromkeys(counters, 0) for model, counters in total.items()}
    return {
        s.model: {
            "queue_us": s.queue_us,
            "compute_us": s.compute_us,
            "per_execution": s.requests_per_execution,
        }
        for s in difference(zeros, total, models)
    }


def rotated(items: Sequence[Target], turn: int) -> list[Target]:
    """``items`` starting at ``turn`` (modulo their number)."""
    turn %= len(items)
    return [*items[turn:], *items[:turn]]


def batch1_round(targets: list[Target], count: int) -> dict[str, dict[str, Any]]:
    """``count`` batch-1 requests to each target, one in flight, the targets taking turns."""
    clients = {t.label: grpcclient.InferenceServerClient(t.grpc_url) for t in targets}
    inputs = {t.label: [infer_inputs(grpcclient, r) for r in t.singles] for t in targets}
    latencies = {t.label: np.empty(count) for t in targets}
    urls = {t.http_url for t in targets}
    before = {url: snapshot(url) for url in urls}
    for i in range(count):
        for t in rotated(targets, i):
            started = time.perf_counter()
            clients[t.label].infer(t.model, inputs[t.label][i % len(t.singles)])
            latencies[t.label][i] = time.perf_counter() - started
    after = {url: snapshot(url) for url in urls}
    for client in clients.values():
        client.close()
    result = {}
    for t in targets:
        total: Snapshot = {}
        accumulate(total, before[t.http_url], after[t.http_url])
        p50, p99 = (float(v) for v in np.percentile(latencies[t.label] * 1e3, [50, 99]))
        result[t.label] = {"p50_ms": p50, "p99_ms": p99, "steps": step_table(total, t.models)}
    return result


def load_round(
    targets: list[Target], batch: int, in_flight: int, windows: int, window_ms: int, offset: int
) -> dict[str, dict[str, Any]]:
    """perf_analyzer windows of ``batch`` x ``in_flight``, the targets alternating window by window."""
    points: dict[str, list[Any]] = {t.label: [] for t in targets}
    totals: dict[str, Snapshot] = {t.label: {} for t in targets}
    for window in range(windows):
        for t in rotated(targets, window + offset):
            before = snapshot(t.http_url)
            point = measure_point(
                t.spec, t.grpc_url, "grpc", batch, in_flight, window_ms, data=t.data, model=t.model
            )
            accumulate(totals[t.label], before, snapshot(t.http_url))
            if point is not None:  # no stable window: the server stalled for one
                points[t.label].append(point)
    return {
        t.label: {
            "rows_per_s": _median([p.rows_per_s for p in points[t.label]]),
            "p50_ms": _median([p.p50_us / 1e3 for p in points[t.label]]),
            "p99_ms": _median([p.p99_us / 1e3 for p in points[t.label]]),
            "steps": step_table(totals[t.label], t.models),
        }
        for t in targets
    }


def _median(values: Sequence[float]) -> float:
    return float(np.median(values)) if len(values) else float("nan")


def summarize(rounds: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Medians over rounds: ``{label: {measurement: {figure: median, "steps": {model: {...}}}}}``."""
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for label, measurements in rounds[0].items():
        summary[label] = {}
        for name, figures in measurements.items():
            each = [r[label][name] for r in rounds]
            entry: dict[str, Any] = {k: _median([e[k] for e in each]) for k in figures if k != "steps"}
            entry["steps"] = {
                model: {
                    k: _median([e["steps"][model][k] for e in each if model in e["steps"]]) for k in values
                }
                for model, values in figures["steps"].items()
            }
            summary[label][name] = entry
    return summary


def run_versions(
    other: list[str],
    repository: Path,
    scratch: Path,
    labels: tuple[str, str] = ("other", "today"),
    loads: Sequence[tuple[int, int]] = ((1, 16), (64, 4)),
    requests: int = 500,
    rounds: int = 3,
    windows: int = 3,
    window_ms: int = 1000,
    ids: bool = False,
) -> dict[str, Any]:
    """Start both servers, measure ``rounds`` rounds, return the summary."""
    with (  # today's ports chosen once the other server listens on its own
        OtherServer(other, Ports.free(), scratch / "other-server.log") as old,
        TritonServer(repository, Ports.free(), log_path=scratch / "today-server.log") as new,
    ):
        forms = [(labels[0], old.ports, BYTES_WIRE), (labels[1], new.ports, BYTES_WIRE)]
        forms += [(f"{labels[1]}-ids", new.ports, IDS_WIRE)] if ids else []
        targets = [target(label, ports, form, scratch) for label, ports, form in forms]
        for t in targets:  # warm-up: first requests allocate and compile
            with grpcclient.InferenceServerClient(t.grpc_url) as client:
                for request in (*t.singles[:20], t.full, t.full):
                    client.infer(t.model, infer_inputs(grpcclient, request))
        results = []
        for index in range(rounds):
            LOGGER.info("round %d of %d", index + 1, rounds)
            ordered = rotated(targets, index)
            figures = {label: {"1x1": one} for label, one in batch1_round(ordered, requests).items()}
            for batch, in_flight in loads:
                load = load_round(ordered, batch, in_flight, windows, window_ms, index)
                for label, one in load.items():
                    figures[label][f"{batch}x{in_flight}"] = one
            results.append({t.label: figures[t.label] for t in targets})
    return {
        "systems": summarize(results),
        "inputs": {t.label: {name: list(map(str, d)) for name, d in t.inputs.items()} for t in targets},
        "input_differences": input_differences(targets[0].inputs, targets[1].inputs, labels),
        "same_requests": same_requests(targets[0], targets[1]),
        "rounds": rounds,
        "settings": {
            "requests": requests,
            "windows": windows,
            "window_ms": window_ms,
            "other": shlex.join(other),
        },
    }


def format_report(summary: dict[str, Any]) -> str:
    """Each figure of each system side by side, the second over the first; then the steps."""
    systems: dict[str, dict[str, dict[str, Any]]] = summary["systems"]
    labels = list(systems)
    first, second = labels[0], labels[1]
    lines = [f"{'':<22}" + "".join(f"{label:>14}" for label in labels) + f"{second + '/' + first:>22}"]
    for name in systems[first]:
        for figure in ("p50_ms", "p99_ms", "rows_per_s"):
            if figure not in systems[first][name]:
                continue
            values = [systems[label][name][figure] for label in labels]
            lines.append(
                f"{name + ' ' + figure:<22}"
                + "".join(f"{v:>14.2f}" for v in values)
                + f"{values[1] / values[0]:>22.2f}"
            )
    lines.append("per step, queue / compute µs per request (requests per execution):")
    for name in systems[first]:
        for label in labels:
            steps = systems[label][name]["steps"]
            text = ", ".join(
                f"{model} {s['queue_us']:.0f} / {s['compute_us']:.0f} ({s['per_execution']:.1f})"
                for model, s in steps.items()
            )
            lines.append(f"  {name:<6} {label:<14} {text}")
    lines.append(f"the same requests to both: {summary['same_requests']}; the ensembles' inputs that differ:")
    lines += [f"  {line}" for line in summary["input_differences"] or ["none"]]
    if len(labels) > 2:
        lines.append(f"(1x1 steps of {second} and {labels[2]}: the one server's, over both forms)")
    return "\n".join(lines)


def parse_loads(text: str) -> tuple[tuple[int, int], ...]:
    """``1x16,64x4`` -> ``((1, 16), (64, 4))``."""
    return tuple((int(b), int(c)) for b, c in (item.split("x") for item in text.split(",") if item.strip()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``recserve lab versions``'s options."""
    parser.add_argument(
        "--other-serve",
        help="the other checkout's serve command line, ports left out (they are appended), e.g. "
        "'OTHER/.venv/bin/recserve serve --repository OTHER/model_repository'",
    )
    parser.add_argument("--other-label", default="other", help="its name in the report")
    parser.add_argument("--repository", type=Path, default=None, help="today's repository to serve")
    parser.add_argument("--requests", type=int, default=500, help="batch-1 requests per system and round")
    parser.add_argument("--loads", type=parse_loads, default=((1, 16), (64, 4)), help="BATCHxIN_FLIGHT,...")
    parser.add_argument("--windows", type=int, default=3, help="perf_analyzer runs per system, load, round")
    parser.add_argument("--window-ms", type=int, default=1000, help="perf_analyzer's measurement interval")
    parser.add_argument("--rounds", type=int, default=3, help="the systems take turns; medians over rounds")
    parser.add_argument("--ids", action="store_true", help="also today's server with the id form")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the servers' logs here")


def run_from_args(args: argparse.Namespace) -> int:
    """Measure, print the report, write ``--json``."""
    if not args.other_serve:
        print("error: --other-serve: the other checkout's serve command line is needed", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        scratch = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="recserve-ab-"))
        )
        scratch.mkdir(parents=True, exist_ok=True)
        summary = run_versions(
            shlex.split(args.other_serve),
            args.repository or Path("model_repository"),
            scratch,
            (args.other_label, "today"),
            args.loads,
            args.requests,
            args.rounds,
            args.windows,
            args.window_ms,
            args.ids,
        )
    print(format_report(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m recserve.perf.lab.versions_ab", description=__doc__)
    add_arguments(parser)
    raise SystemExit(run_from_args(parser.parse_args()))
