"""Generate every ``config.pbtxt`` of the repository from the spec, through protobuf.

Nothing here is written as text by hand: each config is a ``ModelConfig`` message rendered by
``text_format``, so a drift test can regenerate and compare bytes.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from recserve.backends import tensors
from recserve.spec import ModelSpec, WireTensor

FEATURE_TRANSFORM = "feature_transform"
EMBEDDING_LOOKUP = "embedding_lookup"
DENSE = "dense"
STEPS = (FEATURE_TRANSFORM, EMBEDDING_LOOKUP, DENSE)

_DTYPES = {
    "FP32": mc.TYPE_FP32,
    "INT64": mc.TYPE_INT64,
    "INT32": mc.TYPE_INT32,
    "BOOL": mc.TYPE_BOOL,
    "BYTES": mc.TYPE_STRING,
}


def intermediate_tensors(spec: ModelSpec) -> dict[str, WireTensor]:
    """Per-row shapes of the tensors passed between steps."""
    dim = spec.embedding_dim
    items = (
        WireTensor(tensors.DENSE_NORMALIZED, "FP32", (len(spec.dense.columns),)),
        WireTensor(tensors.SPARSE_KEYS, "INT64", (spec.num_sparse,)),
        WireTensor(tensors.TARGET_KEY, "INT64", (1,)),
        WireTensor(tensors.HISTORY_KEYS, "INT64", (-1,), ragged=True),
        WireTensor(tensors.HISTORY_MASK, "FP32", (-1,), ragged=True),
        WireTensor(tensors.SPARSE_EMBEDDINGS, "FP32", (spec.num_sparse, dim)),
        WireTensor(tensors.TARGET_EMBEDDING, "FP32", (dim,)),
        WireTensor(tensors.HISTORY_EMBEDDINGS, "FP32", (-1, dim), ragged=True),
        WireTensor(tensors.PROBABILITY, "FP32", (1,)),
    )
    return {t.name: t for t in items}


def step_io(spec: ModelSpec) -> dict[str, tuple[tuple[WireTensor, ...], tuple[WireTensor, ...]]]:
    """Inputs and outputs of each ensemble step."""
    t = intermediate_tensors(spec)
    return {
        FEATURE_TRANSFORM: (
            spec.wire_inputs(),
            tuple(t[n] for n in (tensors.DENSE_NORMALIZED, tensors.SPARSE_KEYS, tensors.TARGET_KEY, tensors.HISTORY_KEYS, tensors.HISTORY_MASK)),
        ),
        EMBEDDING_LOOKUP: (
            tuple(t[n] for n in (tensors.SPARSE_KEYS, tensors.TARGET_KEY, tensors.HISTORY_KEYS)),
            tuple(t[n] for n in (tensors.SPARSE_EMBEDDINGS, tensors.TARGET_EMBEDDING, tensors.HISTORY_EMBEDDINGS)),
        ),
        DENSE: (tuple(t[n] for n in tensors.DENSE_NET_INPUTS), (t[tensors.PROBABILITY],)),
    }


def _input(t: WireTensor) -> mc.ModelInput:
    return mc.ModelInput(name=t.name, data_type=_DTYPES[t.dtype], dims=list(t.dims), allow_ragged_batch=t.ragged)


def _output(t: WireTensor) -> mc.ModelOutput:
    return mc.ModelOutput(name=t.name, data_type=_DTYPES[t.dtype], dims=list(t.dims))


def step_config(spec: ModelSpec, step: str) -> mc.ModelConfig:
    """Config of one Python-backend step: dynamic batching, CPU instances, the spec as parameter."""
    inputs, outputs = step_io(spec)[step]
    config = mc.ModelConfig(
        name=step,
        backend="python",
        max_batch_size=spec.max_batch_size,
        input=[_input(t) for t in inputs],
        output=[_output(t) for t in outputs],
        instance_group=[mc.ModelInstanceGroup(count=spec.instances[step], kind=mc.ModelInstanceGroup.KIND_CPU)],
        dynamic_batching=mc.ModelDynamicBatching(max_queue_delay_microseconds=spec.max_queue_delay_microseconds),
    )
    config.parameters["spec"].string_value = spec.to_json()
    return config


def ensemble_config(spec: ModelSpec) -> mc.ModelConfig:
    """The ``ctr`` ensemble: raw features in, click probability out."""
    io = step_io(spec)
    steps = []
    for step in STEPS:
        inputs, outputs = io[step]
        steps.append(
            mc.ModelEnsembling.Step(
                model_name=step,
                model_version=-1,
                input_map={t.name: t.name for t in inputs},
                output_map={t.name: t.name for t in outputs},
            )
        )
    return mc.ModelConfig(
        name=spec.name,
        platform="ensemble",
        max_batch_size=spec.max_batch_size,
        input=[_input(t) for t in spec.wire_inputs()],
        output=[_output(io[DENSE][1][0])],
        ensemble_scheduling=mc.ModelEnsembling(step=steps),
    )


def all_configs(spec: ModelSpec) -> dict[str, mc.ModelConfig]:
    """Every model of the repository by name."""
    configs = {step: step_config(spec, step) for step in STEPS}
    configs[spec.name] = ensemble_config(spec)
    return configs


def render(config: mc.ModelConfig) -> str:
    """``config.pbtxt`` text of a config."""
    return text_format.MessageToString(config)


def write_configs(spec: ModelSpec, repository: Path) -> list[Path]:
    """Write every ``config.pbtxt`` (and the ensemble's empty version folder)."""
    written = []
    for name, config in all_configs(spec).items():
        path = repository / name / "config.pbtxt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(config))
        written.append(path)
    (repository / spec.name / str(spec.version)).mkdir(parents=True, exist_ok=True)
    return written
