"""The dense net in PyTorch: eager (any shape, any device) and one CUDA graph per bucket.

The GPU path without TensorRT: :class:`TorchEager` is the generic dynamic-shape graph, and
:class:`CudaGraphBucket` replays a graph captured at one bucket's shape (static input and output
tensors on the device). Inputs that are already device tensors (the lookup step's, handed over
through DLPack) are copied device to device into the static inputs, padded there; host arrays are
padded into pinned host buffers and copied in. On a machine without CUDA the same classes run
eagerly on the CPU, which is how the padding logic is tested there. Every copy between host memory
and the device is counted (:class:`~recserve.backends.base.device_copies.DeviceCopies`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from recserve.backends.base.device_copies import DeviceCopies
from recserve.backends.dense.buckets import (
    Arrays,
    Bucket,
    BucketedRunner,
    BucketPolicy,
    input_shape,
    pad_to_bucket,
    present_inputs,
)
from recserve.core.contract import is_sequence_input, left_padded_inputs
from recserve.core.spec.model import ModelSpec

if TYPE_CHECKING:
    from recserve.backends.dense.network import CTRNet

LOGGER = logging.getLogger(__name__)

#: A device step's inputs: numpy arrays (host memory) or torch tensors (taken through DLPack).
Feeds = Mapping[str, "np.ndarray | torch.Tensor"]
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


def on_device(array: np.ndarray | torch.Tensor, device: torch.device, copies: DeviceCopies) -> torch.Tensor:
    """``array`` as a tensor on ``device``; a host array (or a CPU tensor bound for a GPU) is counted."""
    if isinstance(array, torch.Tensor):
        if array.device == device:
            return array
        if array.device.type == "cpu":
            copies.to_device(array.numel() * array.element_size())
        return array.to(device)
    host = np.ascontiguousarray(array)
    copies.to_device(host.nbytes)
    return torch.from_numpy(host).to(device)


def to_host(tensor: torch.Tensor, copies: DeviceCopies) -> np.ndarray:
    """A device tensor's values in a numpy array, counted as copied to the host."""
    copies.to_host(tensor.numel() * tensor.element_size())
    return tensor.cpu().numpy()


def holds_tensors(inputs: Feeds) -> bool:
    """True when any input is a torch tensor (a device step's inputs, taken through DLPack)."""
    return any(isinstance(value, torch.Tensor) for value in inputs.values())


def pad_into(
    inputs: Mapping[str, torch.Tensor],
    bucket: Bucket,
    out: dict[str, torch.Tensor],
    left: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """:func:`~recserve.backends.dense.buckets.pad_to_bucket` on the device: tensors padded into ``out``.

    ``inputs`` are tensors on the device of ``out`` (of at most the bucket's shape); each is copied
    into its buffer of the bucket's shape, the rest of which is zeroed.
    """
    rows, length = input_shape(inputs)
    for name in present_inputs(inputs):
        target, array = out[name], inputs[name]
        target.zero_()
        if is_sequence_input(name):
            start = bucket.length - length if name in left else 0
            target[:rows, start : start + length].copy_(array)
        else:
            target[:rows].copy_(array)
    return out


class TorchEager:
    """The network eagerly on ``device`` for inputs of any shape.

    Args:
        net: the dense network (``forward`` takes the dense step's tensors in wire order).
        device: ``"cpu"`` or ``"cuda"``/``"cuda:N"``.
        precision: ``fp32``, or ``fp16``/``bf16`` under autocast (matmuls in half precision; softmax,
            normalisation and the sigmoid stay fp32); outputs come back as fp32.
    """

    def __init__(
        self,
        net: torch.nn.Module,
        device: str = "cpu",
        precision: str = "fp32",
        copies: DeviceCopies | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.precision = PRECISIONS[precision]
        self.net = net.to(device=self.device).eval()
        self.names: tuple[str, ...] = getattr(net, "input_names")  # noqa: B009 (CTRNet's, in its order)
        #: the host-device copies of every call (of this runner and its buckets)
        self.copies = copies or DeviceCopies("dense")

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The network on device tensors, in the runner's precision."""
        with torch.autocast(
            self.device.type,
            dtype=self.precision,
            enabled=self.precision != torch.float32,
            cache_enabled=False,
        ):
            return self.net(*inputs)

    def tensors(self, inputs: Feeds) -> dict[str, torch.Tensor]:
        """The network's inputs as tensors on the device (numpy arrays and CPU tensors copied there)."""
        return {n: on_device(inputs[n], self.device, self.copies) for n in self.names if n in inputs}

    @torch.inference_mode()
    def lists(self, inputs: Feeds, owners: np.ndarray) -> np.ndarray:
        """Probabilities ``[rows, 1]`` of candidate lists, each user's history projected once.

        ``inputs``: the per-candidate inputs flat (``[rows, ...]``) and the histories and masks with
        a row per user; ``owners``: each candidate row's user. The network's candidate-list forward
        (``CTRNet.score`` with each row's user, copied to the device once).
        """
        feeds = self.tensors(inputs)
        owner = torch.as_tensor(owners, device=self.device)
        return to_host(self.score_lists(feeds, owner), self.copies)

    def score_lists(self, feeds: Mapping[str, torch.Tensor], owners: torch.Tensor) -> torch.Tensor:
        """The candidate-list forward on device tensors: float32 probabilities ``[rows, 1]`` on the device."""
        with torch.autocast(
            self.device.type,
            dtype=self.precision,
            enabled=self.precision != torch.float32,
            cache_enabled=False,
        ):
            return cast("CTRNet", self.net).score(dict(feeds), owners).float()

    @torch.inference_mode()
    def __call__(self, inputs: Feeds) -> np.ndarray:
        """Probabilities ``[rows, 1]`` as float32 (inputs: numpy arrays or torch tensors)."""
        feeds = self.tensors(inputs)
        return to_host(self.forward(*(feeds[n] for n in self.names)).float(), self.copies)


class DeviceBuffers:
    """Static device tensors of one bucket's shape, fed from pinned host buffers on one stream.

    Shared by the CUDA-graph and TensorRT runners: a request is padded into the pinned host buffers,
    copied to the static device inputs, run, and the static output copied back.
    """

    def __init__(
        self, spec: ModelSpec, bucket: Bucket, device: torch.device, copies: DeviceCopies | None = None
    ) -> None:
        self.bucket = bucket
        self.device = device
        self.copies = copies or DeviceCopies("dense")
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

    def upload(self, inputs: Feeds) -> None:
        """Pad ``inputs`` to the bucket into the device inputs, on the buffers' stream (current).

        Device tensors (the lookup step's, through DLPack) are copied and padded on the device, after
        the work queued on the default stream (where they were made); host arrays among them are
        copied there first. Inputs that are all host arrays are padded into the pinned host buffers
        and copied in one by one.
        """
        if holds_tensors(inputs):
            self.stream.wait_stream(torch.cuda.default_stream(self.device))
            tensors = {n: on_device(inputs[n], self.device, self.copies) for n in present_inputs(inputs)}
            pad_into(tensors, self.bucket, dict(zip(self.names, self.inputs, strict=True)), self.left)
            return
        pad_to_bucket(cast(Arrays, inputs), self.bucket, self.host_arrays, self.left)
        for name, device_tensor in zip(self.names, self.inputs, strict=True):
            device_tensor.copy_(self.host[name], non_blocking=True)
            self.copies.to_device(self.host_arrays[name].nbytes)

    def download(self) -> np.ndarray:
        """Wait for the stream and return the output ``[bucket.rows, 1]`` as float32."""
        self.result.copy_(self.output, non_blocking=True)
        self.copies.to_host(self.result.numel() * self.result.element_size())
        self.stream.synchronize()
        return self.result.numpy().copy()


class CudaGraphBucket:
    """The network captured as a CUDA graph at one bucket's shape.

    Not reentrant: the static tensors are shared by every call (one Triton instance calls it serially).
    """

    def __init__(self, eager: TorchEager, spec: ModelSpec, bucket: Bucket) -> None:
        if eager.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.buffers = DeviceBuffers(spec, bucket, eager.device, eager.copies)
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
        """Probabilities ``[bucket.rows, 1]`` for inputs padded to the bucket (on the device for tensors)."""
        if not holds_tensors(inputs):
            return self.eager(pad_to_bucket(inputs, self.bucket, left=self.left))
        tensors = self.eager.tensors(inputs)
        shapes = self.bucket_shapes(tensors)
        out = {
            n: torch.empty(shape, dtype=torch.float32, device=self.eager.device)
            for n, shape in shapes.items()
        }
        return self.eager(pad_into(tensors, self.bucket, out, self.left))

    def bucket_shapes(self, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
        """Each input's shape padded to the bucket (rows, and sequence positions)."""
        bucket = self.bucket
        return {
            name: (bucket.rows, bucket.length, *t.shape[2:])
            if is_sequence_input(name)
            else (bucket.rows, *t.shape[1:])
            for name, t in tensors.items()
        }


def bucketed_torch_runner(
    spec: ModelSpec,
    net: torch.nn.Module,
    device: str = "cpu",
    precision: str = "fp32",
    policy: BucketPolicy | None = None,
    prepare: tuple[Bucket, ...] = (),
    background: bool = True,
    copies: DeviceCopies | None = None,
) -> BucketedRunner:
    """PyTorch behind the bucket policy: CUDA graphs per bucket on CUDA, eager buckets on the CPU.

    ``copies`` counts the host-device bytes of every call (a new counter by default).
    """
    eager = TorchEager(net, device, precision, copies)

    def compile_bucket(bucket: Bucket) -> EagerBucket | CudaGraphBucket:
        return (
            CudaGraphBucket(eager, spec, bucket)
            if eager.device.type == "cuda"
            else EagerBucket(eager, bucket, left_padded_inputs(spec))
        )

    return BucketedRunner(policy or BucketPolicy.from_spec(spec), compile_bucket, eager, prepare, background)
