"""``recserve lab hops``: the served ensemble against the cheapest ensemble of its shape.

Every Python-backend hop costs cross-process wake-ups and tensor copies whatever it computes. To
know that floor, one tritonserver serves, next to the real ensemble, **echo** ensembles: steps with
the same inputs and outputs (names, dtypes, shapes, bytes) and the same dynamic batching, whose
``model.py`` (:mod:`recserve.perf.bench.echo_model`) returns zeros without computing anything. Three echo
topologies are measured: the served one (``embedding_lookup`` → ``dense``), the same with the
dense network's inputs packed into one tensor instead of one tensor each, and the previous
three-step one (``feature_transform`` → ``embedding_lookup`` → ``dense``, keys
crossing a hop), so the report says what the floor of each shape is, what packing saves, and how
close the served ensemble is to its own floor.

Batch-1 requests, one in flight, closed loop, from one gRPC client; the systems take turns request
by request (a system measured after another would pay for what the other left running), for
``rounds`` rounds, and each figure is the median over the rounds. The in-process p50 (the same
pipeline called directly, ONNX Runtime buckets) is measured in the same run, with the server idle.
``hop_floor_ratio`` = (served p50 − in-process p50) / echo p50 of the served topology: 1.0 means
the server adds exactly the floor of its shape to the computation.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2 as mc

from recserve.build import configs, step_tensors
from recserve.build.synthetic import generate
from recserve.core.names import (
    DENSE,
    DENSE_NORMALIZED,
    EMBEDDING_LOOKUP,
    EMBEDDING_VERSION,
    HISTORY_EMBEDDINGS,
    HISTORY_KEYS,
    HISTORY_MASK,
    SPARSE_EMBEDDINGS,
    SPARSE_KEYS,
    STEPS,
    TARGET_EMBEDDING,
    TARGET_KEY,
)
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import WireTensor
from recserve.perf.harness.inprocess import measure_inprocess
from recserve.perf.harness.process_cpu import cpu_per_request
from recserve.perf.harness.stats import StepTimes, difference, snapshot
from recserve.perf.harness.traffic import closed_loop, interleaved
from recserve.server import Ports, TritonServer

ECHO_ADAPTER = "echo_model.py"
#: Requests in flight at which ``--cpu-seconds`` measures each process's CPU per request.
CPU_CONCURRENCY = (1, 16)
#: The echo ensemble whose steps pass the dense network's inputs packed into one FP32 tensor.
PACKED, PACKED_TENSOR = "echo_2_hops_packed", "packed"


@dataclass(frozen=True)
class EchoStep:
    """One step of an echo topology: its name, tensors, and the input its variable axis follows."""

    name: str
    inputs: tuple[WireTensor, ...]
    outputs: tuple[WireTensor, ...]
    width_from: str
    # a ``[-1]`` output packing several tensors is ``fixed + per_position × width`` wide
    packed: tuple[int, int] = (0, 1)


def topologies(spec: ModelSpec) -> dict[str, list[EchoStep]]:
    """The served two-step shape, the same with the dense inputs packed, and the earlier three steps.

    The three-step shape passed keys between the feature transform and the lookup.
    """
    io = step_tensors.step_io(spec)
    t = step_tensors.intermediate_tensors(spec)
    _, sequence = spec.attention("bench-hops")
    served = [
        EchoStep(EMBEDDING_LOOKUP, *io[EMBEDDING_LOOKUP], sequence.name),
        EchoStep(DENSE, *io[DENSE], HISTORY_MASK),
    ]
    keys = (
        WireTensor(SPARSE_KEYS, "INT64", (len(spec.slot_dims),)),
        WireTensor(TARGET_KEY, "INT64", (1,)),
        WireTensor(HISTORY_KEYS, "INT64", (-1,), ragged=True),
    )
    vectors = tuple(t[n] for n in (SPARSE_EMBEDDINGS, TARGET_EMBEDDING, HISTORY_EMBEDDINGS))
    three = [
        EchoStep(
            "feature_transform",
            step_tensors.request_inputs(spec),
            (t[DENSE_NORMALIZED], *keys, t[HISTORY_MASK]),
            sequence.name,
        ),
        EchoStep(EMBEDDING_LOOKUP, keys, (*vectors, t[EMBEDDING_VERSION]), HISTORY_KEYS),
        EchoStep(DENSE, *io[DENSE], HISTORY_MASK),
    ]
    return {"echo_2_hops": served, "echo_3_hops": three, PACKED: packed_topology(spec)}


def packed_topology(spec: ModelSpec) -> list[EchoStep]:
    """The served shape with the FP32 tensors between the steps packed into one ``[-1]`` tensor.

    The same bytes travel, each request's positions at its sequence bucket, so the width is
    ``fixed + per_position × bucket``: what packing would save at the floor.
    """
    io = step_tensors.step_io(spec)
    lookup_inputs, lookup_outputs = io[EMBEDDING_LOOKUP]
    dense_inputs, dense_outputs = io[DENSE]
    packed = WireTensor(PACKED_TENSOR, "FP32", (-1,), ragged=True)
    inner = {t.name for t in dense_inputs}
    _, sequence = spec.attention("bench-hops")
    return [
        EchoStep(
            EMBEDDING_LOOKUP,
            lookup_inputs,
            (packed, *(t for t in lookup_outputs if t.name not in inner)),
            sequence.name,
            packed_widths(dense_inputs),
        ),
        EchoStep(DENSE, (packed,), dense_outputs, PACKED_TENSOR),
    ]


def packed_widths(tensors: tuple[WireTensor, ...]) -> tuple[int, int]:
    """Values per row of ``tensors`` packed into one: ``(fixed, per sequence position)``."""
    fixed = sum(math.prod(t.dims) for t in tensors if -1 not in t.dims)
    per_position = sum(math.prod(t.dims[1:]) for t in tensors if t.dims[:1] == (-1,))
    return fixed, per_position


def ensemble_outputs(steps: list[EchoStep]) -> list[WireTensor]:
    """The step outputs that no later step consumes: what the ensemble returns (as the served one)."""
    return [
        out
        for i, step in enumerate(steps)
        for out in step.outputs
        if not any(out.name in {x.name for x in later.inputs} for later in steps[i + 1 :])
    ]


def echo_configs(spec: ModelSpec, name: str, steps: list[EchoStep]) -> dict[str, mc.ModelConfig]:
    """The configs of one echo ensemble ``name`` and its steps (``<name>_<step>``), batched as served."""
    plan = configs.ServingPlan.from_spec(spec)
    result = {}
    for step in steps:
        config = mc.ModelConfig(
            name=f"{name}_{step.name}",
            backend="python",
            max_batch_size=spec.model.max_batch_size,
            input=[step_tensors.model_input(x) for x in step.inputs],
            output=[step_tensors.model_output(x) for x in step.outputs],
            instance_group=[mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)],
        )
        config.dynamic_batching.max_queue_delay_microseconds = plan.max_queue_delay_microseconds or 0
        config.dynamic_batching.preferred_batch_size.extend(plan.preferred_batch_sizes)
        config.parameters["width_from"].string_value = step.width_from
        config.parameters["width_buckets"].string_value = ",".join(
            str(b) for b in spec.serving.sequence_buckets
        )
        config.parameters["packed"].string_value = ",".join(str(n) for n in step.packed)
        result[config.name] = config
    result[name] = mc.ModelConfig(
        name=name,
        platform="ensemble",
        max_batch_size=spec.model.max_batch_size,
        input=[step_tensors.model_input(x) for x in step_tensors.request_inputs(spec)],  # both wire forms
        output=[step_tensors.model_output(x) for x in ensemble_outputs(steps)],
        ensemble_scheduling=mc.ModelEnsembling(
            step=[
                mc.ModelEnsembling.Step(
                    model_name=f"{name}_{step.name}",
                    model_version=-1,
                    input_map={x.name: x.name for x in step.inputs},
                    output_map={x.name: x.name for x in step.outputs},
                )
                for step in steps
            ]
        ),
    )
    return result


def write_hops_repository(spec: ModelSpec, source: Path, target: Path) -> dict[str, tuple[str, ...]]:
    """The served models of ``source`` (linked, not copied) plus the echo ensembles.

    Returns:
        Every ensemble to measure, with the names of its steps.
    """
    configs.write_variant(spec, source, target)
    adapter = resources.files("recserve.perf.bench").joinpath(ECHO_ADAPTER).read_text()
    systems: dict[str, tuple[str, ...]] = {spec.name: STEPS}
    for name, steps in topologies(spec).items():
        for model, config in echo_configs(spec, name, steps).items():
            (target / model / "1").mkdir(parents=True)
            (target / model / "config.pbtxt").write_text(configs.render(config))
            if config.backend == "python":
                (target / model / "1" / "model.py").write_text(adapter)
        systems[name] = tuple(f"{name}_{step.name}" for step in steps)
    return systems


@dataclass(frozen=True)
class Latency:
    """One system's latencies over one round, and where its requests spent their time in the server."""

    system: str
    p50_ms: float
    p99_ms: float
    steps: list[StepTimes]


def run_hops(
    spec: ModelSpec,
    repository: Path,
    scratch: Path,
    requests: int = 300,
    rounds: int = 3,
    cpu_seconds: float = 0.0,
) -> dict[str, object]:
    """Measure the served ensemble, the echo ensembles and the in-process pipeline; the summary.

    With ``cpu_seconds``, also each process's CPU per request, served and echo, with 1 and 16
    requests in flight (:func:`recserve.perf.harness.process_cpu.cpu_per_request`).
    """
    systems = write_hops_repository(spec, repository, scratch / "repository")
    rows = generate(spec, 64, seed=5)
    pool = [rows.take(slice(i, i + 1)).to_wire(spec) for i in range(len(rows))]
    results: dict[str, list[Latency]] = {s: [] for s in systems}
    with TritonServer(scratch / "repository", Ports.free(), log_path=scratch / "server.log") as server:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            for system in systems:  # warm-up: first requests allocate and compile
                closed_loop(client, system, pool, 20)
            for _ in range(rounds):
                before = snapshot(server.http_url)
                latencies = interleaved(client, list(systems), pool, requests)
                after = snapshot(server.http_url)
                for system, models in systems.items():
                    p50, p99 = (float(v) for v in np.percentile(latencies[system], [50, 99]))
                    results[system].append(Latency(system, p50, p99, difference(before, after, models)))
        cpu = {
            system: {
                str(n): cpu_per_request(
                    server.grpc_url, scratch / "repository", system, pool, n, cpu_seconds, systems[system]
                )
                for n in CPU_CONCURRENCY
            }
            for system in (spec.name, "echo_2_hops")
            if cpu_seconds > 0
        }
    inprocess = [measure_inprocess(spec, repository, 1, seconds=2.0).p50_ms for _ in range(rounds)]
    return {**summarize(spec, results, inprocess), **({"cpu_per_request": cpu} if cpu else {})}


def _median(values: list[float]) -> float:
    return float(np.median(values))


def summarize(
    spec: ModelSpec, results: dict[str, list[Latency]], inprocess: list[float]
) -> dict[str, object]:
    """Medians over the rounds, per-step queue and compute, and the ratios."""
    table: dict[str, dict[str, Any]] = {}
    for system, rounds in results.items():
        step_names = [s.model for s in rounds[0].steps]
        table[system] = {
            "p50_ms": _median([r.p50_ms for r in rounds]),
            "p99_ms": _median([r.p99_ms for r in rounds]),
            "steps": {
                name: {
                    "queue_ms": _median(
                        [s.queue_us / 1e3 for r in rounds for s in r.steps if s.model == name]
                    ),
                    "compute_ms": _median(
                        [s.compute_us / 1e3 for r in rounds for s in r.steps if s.model == name]
                    ),
                }
                for name in step_names
            },
        }
    served, floor = float(table[spec.name]["p50_ms"]), float(table["echo_2_hops"]["p50_ms"])
    inprocess_p50 = _median(inprocess)
    return {
        "systems": table,
        "inprocess_p50_ms": inprocess_p50,
        "hop_floor_ratio": (served - inprocess_p50) / floor,
        "third_hop_floor_ms": float(table["echo_3_hops"]["p50_ms"]) - floor,
        "packing_saving_ms": floor - float(table[PACKED]["p50_ms"]),
        "rounds": len(next(iter(results.values()))),
    }


def format_report(summary: dict[str, object]) -> str:
    """The summary as a table, then the ratios."""
    lines = [f"{'system':<20}{'p50 ms':>8}{'p99 ms':>8}   per step: queue / compute ms"]
    systems = summary["systems"]
    assert isinstance(systems, dict)
    for system, row in systems.items():
        steps = ", ".join(
            f"{name.removeprefix(system + '_')} {s['queue_ms']:.2f} / {s['compute_ms']:.2f}"
            for name, s in row["steps"].items()
        )
        lines.append(f"{system:<20}{row['p50_ms']:>8.2f}{row['p99_ms']:>8.2f}   {steps}")
    lines.append(f"{'in process':<20}{summary['inprocess_p50_ms']:>8.2f}")
    lines.append(
        f"hop_floor_ratio {summary['hop_floor_ratio']:.2f} (target <= 1.3); "
        f"the third hop of the earlier shape cost {summary['third_hop_floor_ms']:.2f} ms at the floor; "
        f"packing the tensors between the steps into one would save {summary['packing_saving_ms']:.2f} ms "
        "at the floor"
    )
    cpu = summary.get("cpu_per_request")
    if isinstance(cpu, dict):
        lines.append("CPU µs per request by process (requests in flight: requests/s; tritonserver, steps)")
        for system, by_concurrency in cpu.items():
            for n, figures in by_concurrency.items():
                spent = ", ".join(
                    f"{name.removeprefix(system + '_')} {us:.0f}" for name, us in figures["cpu_us"].items()
                )
                lines.append(f"  {system:<18}{n:>3}: {figures['requests_per_s']:7.0f}/s; {spent}")
    return "\n".join(lines)


def hops_command(
    spec: ModelSpec,
    repository: Path,
    requests: int,
    rounds: int,
    output: Path | None,
    cpu_seconds: float = 0.0,
) -> int:
    """``recserve lab hops``: print the report; write the summary as JSON to ``output`` if given."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="recserve-hops-") as scratch:
        summary = run_hops(spec, repository, Path(scratch), requests, rounds, cpu_seconds)
    print(format_report(summary))
    if output is not None:
        output.write_text(json.dumps(summary, indent=2) + "\n")
    return 0
