"""TensorRT engines for the dense net: one optimisation profile per bucket, built from the ONNX export.

The profiles are small value objects derived from the spec's bucket grid (Polygraphy style: a
profile maps each input to a ``min``/``opt``/``max`` shape). Profile ``k`` serves the rows and
sequence positions between the previous buckets (exclusive) and bucket ``k`` (inclusive), tuned for
the bucket itself, so the grid tiles every shape Triton's TensorRT backend may send unpadded, and a
runner that pads to the bucket always hits ``opt``.

This module imports without TensorRT; :func:`build_engine` needs it (``tensorrt_available()``).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from recserve.backends.dense.buckets import Bucket, grid_floors
from recserve.core.spec.model import ModelSpec

LOGGER = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "bf16")
DEFAULT_WORKSPACE_BYTES = 1 << 30


class TensorRTUnavailable(RuntimeError):
    """TensorRT is not installed here."""


def tensorrt_available() -> bool:
    """True when the ``tensorrt`` Python package can be imported."""
    return importlib.util.find_spec("tensorrt") is not None


@dataclass(frozen=True)
class ShapeRange:
    """The shapes one input may take under a profile."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise ValueError(f"min/opt/max ranks differ: {self.min} {self.opt} {self.max}")
        if any(not lo <= mid <= hi for lo, mid, hi in zip(self.min, self.opt, self.max, strict=True)):
            raise ValueError(f"need min <= opt <= max per axis: {self.min} {self.opt} {self.max}")


@dataclass(frozen=True)
class OptimizationProfile:
    """One TensorRT optimisation profile: the bucket it is tuned for and a shape range per input."""

    bucket: Bucket
    shapes: tuple[tuple[str, ShapeRange], ...]

    def __getitem__(self, name: str) -> ShapeRange:
        return dict(self.shapes)[name]

    def holds(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """True when every input shape lies within this profile."""
        ranges = dict(self.shapes)
        return all(
            all(lo <= s <= hi for lo, s, hi in zip(ranges[name].min, shape, ranges[name].max, strict=True))
            for name, shape in shapes.items()
        )

    @classmethod
    def for_bucket(cls, spec: ModelSpec, bucket: Bucket, floor: Bucket | None = None) -> OptimizationProfile:
        """The profile for ``bucket``: from ``floor`` (the bucket itself if None) up to it, tuned for it."""
        low = (floor or bucket).input_shapes(spec)
        high = bucket.input_shapes(spec)
        return cls(
            bucket,
            tuple((name, ShapeRange(low[name], high[name], high[name])) for name in high),
        )


def spec_profiles(spec: ModelSpec) -> tuple[OptimizationProfile, ...]:
    """One profile per bucket of the grid, each starting just above the previous buckets."""
    return tuple(
        OptimizationProfile.for_bucket(spec, bucket, floor) for bucket, floor in grid_floors(spec).items()
    )


@dataclass(frozen=True)
class EngineOptions:
    """How to build: precision, workspace limit and the timing cache file (reused between builds)."""

    precision: str = "fp32"
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    timing_cache: Path | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; use one of {PRECISIONS}")


def build_engine(onnx_path: Path, profiles: tuple[OptimizationProfile, ...], options: EngineOptions) -> bytes:
    """A serialised TensorRT engine (plan) for the ONNX graph with the given profiles.

    Raises:
        TensorRTUnavailable: TensorRT is not installed.
        RuntimeError: the ONNX graph does not parse or the build fails.
    """
    if not tensorrt_available():
        raise TensorRTUnavailable("TensorRT is not installed (pip package 'tensorrt')")
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode since TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    if options.precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif options.precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    cache_bytes = (
        options.timing_cache.read_bytes() if options.timing_cache and options.timing_cache.is_file() else b""
    )
    config.set_timing_cache(config.create_timing_cache(cache_bytes), ignore_mismatch=False)
    for profile in profiles:
        trt_profile = builder.create_optimization_profile()
        for name, shapes in profile.shapes:
            trt_profile.set_shape(name, shapes.min, shapes.opt, shapes.max)
        config.add_optimization_profile(trt_profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT engine build failed; see the TensorRT log above")
    if options.timing_cache is not None:
        options.timing_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    LOGGER.info(
        "built TensorRT engine: %d profiles, %s, %d bytes", len(profiles), options.precision, plan.nbytes
    )
    return bytes(plan)
