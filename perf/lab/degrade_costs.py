"""``recserve lab degrade --costs``: what each level of ``[degrade]`` really costs, measured.

A level's ``cost`` in the spec is a fraction of the full level's compute, and the controller trusts
it. Here each level is served alone (a variant whose only level is that one, never refusing, lambda
held past every value, so every request is served at it) and its closed-loop capacity measured on
the same pinned core as the full level's: a level's cost is the full capacity over its own (a level
answered in the caller's order: its model beside the ensemble, called directly). The
refusal is measured the same way (``refused``: every request refused at the first step, the rate
at which the server answers them): what ``refuse_cost`` should say.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from recserve.build.configs import write_variant
from recserve.build.progress import Progress
from recserve.build.repository import add_small_dense, version_dir
from recserve.core.names import DENSE
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import parse_spec, small_dense_spec
from recserve.perf.bench.candidates import closed_loop_rate
from recserve.perf.lab.degrade_traffic import ListPool
from recserve.perf.lab.overload import Cores, pinned
from recserve.server import Ports, TritonServer

#: Lambda for a level served alone: past every value, so the level (never the full one) serves all.
ALONE_LAMBDA = 1e12


def shed_spec(spec: ModelSpec) -> ModelSpec:
    """The spec as shedding alone serves it: ``[degrade]`` off (the baseline, whatever the spec says)."""
    if not spec.degrade.enabled:
        return spec
    return parse_spec({**spec.source, "degrade": {**spec.source["degrade"], "enabled": False}})


def with_small_dense(spec: ModelSpec, repository: Path, target: Path, progress: Progress) -> Path:
    """``repository`` with ``spec``'s ``[degrade.small_dense]`` network distilled beside its own.

    A variant of ``repository`` serving it as built (``[degrade]`` off), whose dense version folder
    is a copy (the built repository is not changed); ``repository`` itself where ``spec`` has no such
    level.
    """
    if small_dense_spec(spec) is None:
        return repository
    write_variant(shed_spec(spec), repository, target)
    dense = version_dir(target, DENSE, spec)
    dense.unlink()
    shutil.copytree(version_dir(repository, DENSE, spec).resolve(), dense)
    add_small_dense(spec, target, progress)
    return target


def alone(spec: ModelSpec, index: int) -> ModelSpec:
    """``spec`` serving every request at its ``[degrade]`` level ``index`` (0: the first cheaper one)."""
    level = dataclasses.asdict(spec.degrade.levels[index])
    section = {**spec.source["degrade"], "levels": [level], "refuse": False, "fixed_lambda": ALONE_LAMBDA}
    return parse_spec({**spec.source, "degrade": section})


def refusing(spec: ModelSpec) -> ModelSpec:
    """``spec`` refusing every request at its first step (lambda past every value, ``full_value`` off)."""
    section = {**spec.source["degrade"], "refuse": True, "fixed_lambda": ALONE_LAMBDA, "full_value": 0.0}
    return parse_spec({**spec.source, "degrade": section})


def measure_costs(
    spec: ModelSpec, repository: Path, workdir: Path, pool: ListPool, seconds: float, cores: Cores
) -> dict[str, dict[str, float]]:
    """Per level (``full`` first, ``refused`` last): lists per second and the cost against full.

    Closed loop, 8 lists in flight; for ``refused``, the lists answered (each with its refusal).

    ``spec`` has ``[degrade]`` enabled (its own source section).
    """
    model = spec.candidates_model
    assert model is not None
    variants = {"full": (repository, model)}
    for i, level in enumerate(spec.degrade.levels):
        root = workdir / f"level-{level.name}"
        if level.caller_order:  # answered beside the ensemble: its model, called as the door calls it
            variants[level.name] = (write_variant(spec, repository, root), spec.caller_order_models[model])
        else:
            variants[level.name] = (write_variant(alone(spec, i), repository, root), model)
    variants["refused"] = (write_variant(refusing(spec), repository, workdir / "level-refused"), model)
    rates = {}
    for name, (root, called) in variants.items():
        log = workdir / f"level-{name}.log"
        with (
            TritonServer(root, Ports.free(), log_path=log, cpus=cores.server) as server,
            pinned(cores.client),
        ):
            measured = closed_loop_rate(server.grpc_url, called, pool.requests[0], 1, 8, seconds)
        rates[name] = measured["failures_per_s" if name == "refused" else "rows_per_s"]
    return {
        name: {
            "lists_per_s": round(rate, 1),
            "cost": round(rates["full"] / rate, 3) if rate > 0 else float("inf"),
        }
        for name, rate in rates.items()
    }
