"""The naive peer of ``recserve bench``: the whole ``ctr`` path in one Python-backend model.

:func:`write_monolith_repository` writes a repository with a single model named like the ensemble
(same inputs, ``probability`` out), dynamically batched as the spec's steps are, so that the same
perf_analyzer input data drives both. It reads the tables and the dense model of a built repository
in place.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from recserve.build import configs, step_tensors
from recserve.core.names import PROBABILITY
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import WireTensor

ADAPTER = "monolith_model.py"


def monolith_config(spec: ModelSpec, repository: Path, instances: int) -> mc.ModelConfig:
    """One Python-backend model over ``repository``, with ``instances`` CPU instances."""
    plan = configs.ServingPlan.from_spec(spec)
    config = mc.ModelConfig(
        name=spec.name,
        backend="python",
        max_batch_size=spec.model.max_batch_size,
        input=[step_tensors.model_input(t) for t in step_tensors.request_inputs(spec)],  # both wire forms
        output=[step_tensors.model_output(WireTensor(PROBABILITY, "FP32", (1,)))],
        instance_group=[mc.ModelInstanceGroup(count=instances, kind=mc.ModelInstanceGroup.KIND_CPU)],
    )
    config.dynamic_batching.max_queue_delay_microseconds = plan.max_queue_delay_microseconds or 0
    config.dynamic_batching.preferred_batch_size.extend(plan.preferred_batch_sizes)
    config.parameters["spec"].string_value = spec.to_json()
    config.parameters["repository"].string_value = str(repository.resolve())
    return config


def write_monolith_repository(spec: ModelSpec, source: Path, target: Path, instances: int) -> Path:
    """``target/<name>/config.pbtxt`` and ``1/model.py``, serving the artifacts of ``source``."""
    version = target / spec.name / "1"
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.py").write_text(resources.files("recserve.perf.peers").joinpath(ADAPTER).read_text())
    config = monolith_config(spec, source, instances)
    (target / spec.name / "config.pbtxt").write_text(configs.render(config))
    return target
