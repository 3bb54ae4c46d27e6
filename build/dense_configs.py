"""The dense step's own config parts: a warm-up sample per bucket, and the TensorRT ``dense`` of ``gpu``."""

from __future__ import annotations

import dataclasses

from tritonclient.grpc import model_config_pb2 as mc

from recserve.backends.dense.buckets import spec_buckets
from recserve.build.step_tensors import CONFIG_DTYPES, model_input, model_output, step_io
from recserve.core.names import DENSE
from recserve.core.spec.model import ModelSpec

TENSORRT_PLAN = "model.plan"


def dense_warmup(spec: ModelSpec) -> list[mc.ModelWarmup]:
    """One ``model_warmup`` sample per bucket of the spec's grid (zeros; mask 0 attends to nothing)."""
    inputs = step_io(spec)[DENSE][0]
    return [
        mc.ModelWarmup(
            name=f"bucket_{bucket.rows}x{bucket.length}",
            batch_size=bucket.rows,
            count=1,
            inputs={
                t.name: mc.ModelWarmup.Input(
                    data_type=CONFIG_DTYPES[t.dtype],
                    dims=[bucket.length if d == -1 else d for d in t.dims],
                    zero_data=True,
                )
                for t in inputs
            },
        )
        for bucket in spec_buckets(spec)
    ]


def dense_tensorrt_config(spec: ModelSpec) -> mc.ModelConfig:
    """The GPU ``dense``: a TensorRT plan with one optimisation profile per bucket, batched to bucket sizes.

    Requests of one sequence bucket batch together (the feature step pads every request to a sequence
    bucket, so no ragged batching); the dynamic batcher prefers the batch buckets' sizes.
    """
    inputs, outputs = step_io(spec, "gpu")[DENSE]
    return mc.ModelConfig(
        name=DENSE,
        platform="tensorrt_plan",
        default_model_filename=TENSORRT_PLAN,
        max_batch_size=spec.model.max_batch_size,
        input=[model_input(dataclasses.replace(t, ragged=False)) for t in inputs],
        output=[model_output(t) for t in outputs],
        instance_group=[
            mc.ModelInstanceGroup(count=spec.serving.instances[DENSE], kind=mc.ModelInstanceGroup.KIND_GPU)
        ],
        dynamic_batching=mc.ModelDynamicBatching(
            preferred_batch_size=list(spec.serving.batch_buckets),
            max_queue_delay_microseconds=spec.serving.max_queue_delay_microseconds,
        ),
        model_warmup=dense_warmup(spec),
    )
