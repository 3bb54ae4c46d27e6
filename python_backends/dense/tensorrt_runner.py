"""The dense net as a TensorRT engine behind the bucket policy (GPU; needs ``tensorrt`` and CUDA).

The engine built by ``recserve build --profile gpu`` holds one optimisation profile per bucket of
the grid; each bucket gets its own execution context bound to its profile and static device
buffers. A missed bucket is compiled in the background as a one-profile engine of its own, while
PyTorch on the same GPU (the generic graph) serves it. Imports without TensorRT.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from recserve.backends.base.device_copies import DeviceCopies
from recserve.backends.dense.buckets import Arrays, Bucket, BucketedRunner, BucketPolicy
from recserve.backends.dense.torch_runners import DeviceBuffers, TorchEager
from recserve.core.names import PROBABILITY
from recserve.core.spec.model import ModelSpec

LOGGER = logging.getLogger(__name__)


class TensorRTEngine:
    """A deserialised engine with one execution context per optimisation profile.

    Args:
        plan: the serialised engine.
        buckets: the bucket each profile is tuned for, in profile order.
        device: the CUDA device.
    """

    def __init__(self, plan: bytes, buckets: tuple[Bucket, ...], device: str = "cuda:0") -> None:
        import tensorrt as trt

        self.device = torch.device(device)
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise RuntimeError("the TensorRT plan does not deserialise on this GPU/TensorRT version")
        if self.engine.num_optimization_profiles != len(buckets):
            raise RuntimeError(
                f"engine has {self.engine.num_optimization_profiles} profiles, manifest lists {len(buckets)}"
            )
        self.profiles = {bucket: index for index, bucket in enumerate(buckets)}


class TensorRTBucket:
    """One bucket of an engine: its profile's execution context with static device buffers."""

    def __init__(
        self, engine: TensorRTEngine, spec: ModelSpec, bucket: Bucket, copies: DeviceCopies | None = None
    ) -> None:
        self.buffers = DeviceBuffers(spec, bucket, engine.device, copies)
        self.buffers.stream.wait_stream(torch.cuda.current_stream(engine.device))  # the buffers' zero fill
        self.context = engine.engine.create_execution_context()
        self.context.set_optimization_profile_async(engine.profiles[bucket], self.buffers.stream.cuda_stream)
        shapes = bucket.input_shapes(spec)
        for name, tensor in zip(self.buffers.names, self.buffers.inputs, strict=True):
            self.context.set_input_shape(name, shapes[name])
            self.context.set_tensor_address(name, tensor.data_ptr())
        self.context.set_tensor_address(PROBABILITY, self.buffers.output.data_ptr())
        self(bucket_zeros(spec, bucket))  # warm-up

    def __call__(self, inputs: Arrays) -> np.ndarray:
        """Probabilities ``[bucket.rows, 1]`` for inputs of at most the bucket's shape (padded here)."""
        with torch.cuda.stream(self.buffers.stream):
            self.buffers.upload(inputs)
            if not self.context.execute_async_v3(self.buffers.stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed")
            return self.buffers.download()


def bucket_zeros(spec: ModelSpec, bucket: Bucket) -> dict[str, np.ndarray]:
    """All-zero inputs of a bucket's shape (mask 0: rows that attend to nothing)."""
    return {name: np.zeros(shape, np.float32) for name, shape in bucket.input_shapes(spec).items()}


def bucketed_tensorrt_runner(
    spec: ModelSpec,
    plan: bytes,
    buckets: tuple[Bucket, ...],
    onnx_path: Path,
    net: torch.nn.Module,
    device: str = "cuda:0",
    policy: BucketPolicy | None = None,
    copies: DeviceCopies | None = None,
) -> BucketedRunner:
    """TensorRT buckets from the built engine; misses compile a one-profile engine in the background.

    Args:
        spec: the model spec.
        plan: the serialised engine of ``recserve build --profile gpu``.
        buckets: its profiles' buckets, in profile order (from the manifest).
        onnx_path: the verified ONNX file, for compiling missed buckets.
        net: the PyTorch network: the generic graph on the same GPU.
        device: the CUDA device.
        policy: the bucket policy; the spec's by default.
        copies: counts the host-device bytes of every call.
    """
    from recserve.backends.dense.tensorrt_engine import EngineOptions, OptimizationProfile, build_engine

    engine = TensorRTEngine(plan, buckets, device)

    def compile_bucket(bucket: Bucket) -> TensorRTBucket:
        if bucket in engine.profiles:
            return TensorRTBucket(engine, spec, bucket, copies)
        own = build_engine(onnx_path, (OptimizationProfile.for_bucket(spec, bucket),), EngineOptions())
        return TensorRTBucket(TensorRTEngine(own, (bucket,), device), spec, bucket, copies)

    generic = TorchEager(net, device, copies=copies)
    return BucketedRunner(policy or BucketPolicy.from_spec(spec), compile_bucket, generic, buckets)
