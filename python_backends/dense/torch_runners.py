"""The dense net in PyTorch: eager (any shape, any device) and one CUDA graph per bucket.

The GPU path without TensorRT: :class:`TorchEager` is the generic dynamic-shape graph, and
:class:`CudaGraphBucket` replays a graph captured at one bucket's shape (static input and output
tensors on the device; a request is padded into pinned host buffers and copied in). On a machine
without CUDA the same classes run eagerly on the CPU, which is how the padding logic is tested there.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from recserve.backends.dense.buckets import (
    Arrays,
    Bucket,
    BucketedRunner,
    BucketPolicy,
    pad_to_bucket,
)
from recserve.core.contract import left_padded_inputs
from recserve.core.spec import ModelSpec

if TYPE_CHECKING:
    from recserve.backends.dense.network import CTRNet

LOGGER = logging.getLogger(__name__)

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # autocast dtypes
WARMUP_ITERATIONS = 3  # eager runs on a side stream before capture (cuBLAS handles, allocator pools)


def load_net(spec: ModelSpec, weights: Path) -> CTRNet:
    """The dense network with verified safetensors weights (no pickle)."""
    from safetensors.torch import load_file

    from recserve.backends.dense.network import CTRNet

    net = CTRNet(spec)
    net.load_state_dict(load_file(str(weights)))
    return net.eval()


def cuda_available() -> bool:
    """True when PyTorch sees a CUDA device."""
    return torch.cuda.is_available()


class TorchEager:
    """The network eagerly on ``device`` for inputs of any shape.

    Args:
        net: the dense network (``forward`` takes the dense step's tensors in wire order).
        device: ``"cpu"`` or ``"cuda"``/``"cuda:N"``.
        precision: ``fp32``, or ``fp16``/``bf16`` under autocast (matmuls in half precision; softmax,
            normalisation and the sigmoid stay fp32); outputs come back as fp32.
    """

    def __init__(self, net: torch.nn.Module, device: str = "cpu", precision: str = "fp32") -> None:
        self.device = torch.device(device)
        self.precision = PRECISIONS[precision]
        self.net = net.to(device=self.device).eval()
        self.names: tuple[str, ...] = getattr(net, "input_names")  # noqa: B009 (CTRNet's, in its order)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The network on device tensors, in the runner's precision."""
        with torch.autocast(
            self.device.type,
            dtype=self.precision,
            enabled=self.precision != torch.float32,
            cache_enabled=False,
        ):
            return self.net(*inputs)

    @torch.inference_mode()
    def __call__(self, inputs: Arrays) -> np.ndarray:
        """Probabilities ``[rows, 1]`` as float32."""
        feeds = [torch.from_numpy(np.ascontiguousarray(inputs[n])).to(self.device) for n in self.names]
        return self.forward(*feeds).float().cpu().numpy()


class DeviceBuffers:
    """Static device tensors of one bucket's shape, fed from pinned host buffers on one stream.

    Shared by the CUDA-graph and TensorRT runners: a request is padded into the pinned host buffers,
    copied to the static device inputs, run, and the static output copied back.
    """

    def __init__(self, spec: ModelSpec, bucket: Bucket, device: torch.device) -> None:
        self.bucket = bucket
        self.left = left_padded_inputs(spec)
        shapes = bucket.input_shapes(spec)
        self.host = {
            name: torch.zeros(shape, dtype=torch.float32).pin_memory() for name, shape in shapes.items()
        }
        self.host_arrays = {name: tensor.numpy() for name, tensor in self.host.items()}  # same memory
        self.names = tuple(shapes)  # the spec's dense inputs, in the network's order
        self.inputs = [torch.zeros(shapes[n], device=device) for n in self.names]
        self.output = torch.zeros((bucket.rows, 1), device=device)
        self.result = torch.zeros((bucket.rows, 1), dtype=torch.float32).pin_memory()
        self.stream = torch.cuda.Stream(device)

    def upload(self, inputs: Arrays) -> None:
        """Pad ``inputs`` to the bucket and queue their copy to the device inputs."""
        pad_to_bucket(inputs, self.bucket, self.host_arrays, self.left)
        for name, device_tensor in zip(self.names, self.inputs, strict=True):
            device_tensor.copy_(self.host[name], non_blocking=True)

    def download(self) -> np.ndarray:
        """Wait for the stream and return the output ``[bucket.rows, 1]`` as float32."""
        self.result.copy_(self.output, non_blocking=True)
        self.stream.synchronize()
        return self.result.numpy().copy()


class CudaGraphBucket:
    """The network captured as a CUDA graph at one bucket's shape.

    Not reentrant: the static tensors are shared by every call (one Triton instance calls it serially).
    """

    def __init__(self, eager: TorchEager, spec: ModelSpec, bucket: Bucket) -> None:
        if eager.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.buffers = DeviceBuffers(spec, bucket, eager.device)
        self.buffers.stream.wait_stream(torch.cuda.current_stream(eager.device))  # the buffers' zero fill
        with torch.inference_mode(), torch.cuda.stream(self.buffers.stream):
            for _ in range(WARMUP_ITERATIONS):  # on the side stream, before capture
                eager.forward(*self.buffers.inputs)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.buffers.stream, capture_error_mode="thread_local"):
                self.buffers.output = eager.forward(*self.buffers.inputs).float()
        self.buffers.stream.synchronize()

    @torch.inference_mode()
    def __call__(self, inputs: Arrays) -> np.ndarray:
        """Probabilities ``[bucket.rows, 1]`` for inputs of at most the bucket's shape (padded here)."""
        with torch.cuda.stream(self.buffers.stream):
            self.buffers.upload(inputs)
            self.graph.replay()
            return self.buffers.download()


class EagerBucket:
    """The eager network at one bucket's shape (the CPU stand-in for a captured graph)."""

    def __init__(self, eager: TorchEager, bucket: Bucket, left: Collection[str] = ()) -> None:
        self.eager = eager
        self.bucket = bucket
        self.left = left

    def __call__(self, inputs: Arrays) -> np.ndarray:
        """Probabilities ``[bucket.rows, 1]`` for inputs padded to the bucket."""
        return self.eager(pad_to_bucket(inputs, self.bucket, left=self.left))


def bucketed_torch_runner(
    spec: ModelSpec,
    net: torch.nn.Module,
    device: str = "cpu",
    precision: str = "fp32",
    policy: BucketPolicy | None = None,
    prepare: tuple[Bucket, ...] = (),
    background: bool = True,
) -> BucketedRunner:
    """PyTorch behind the bucket policy: CUDA graphs per bucket on CUDA, eager buckets on the CPU."""
    eager = TorchEager(net, device, precision)

    def compile_bucket(bucket: Bucket) -> EagerBucket | CudaGraphBucket:
        return (
            CudaGraphBucket(eager, spec, bucket)
            if eager.device.type == "cuda"
            else EagerBucket(eager, bucket, left_padded_inputs(spec))
        )

    return BucketedRunner(policy or BucketPolicy.from_spec(spec), compile_bucket, eager, prepare, background)
