"""Constants and small helpers that both halves share (standard library only)."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LIMIT_BYTES = 64 * 1024 * 1024  # per call: working tree + carried folders
KIT = ".gpu-kit"
CACHE = ".gpu-cache"
WORK = ".gpu-run"
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux1_x86_64",
    "manylinux2010_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_35_x86_64",  # nvidia-pytriton 0.7.0 (tritonserver needs glibc 2.35)
)
PYTRITON = "nvidia-pytriton==0.7.0"
GEVENTHTTPCLIENT = "geventhttpclient==2.0.2"  # tritonclient 2.50[http] pins <=2.0.2: sdist only for cp312
#: Installed from the kit with their dependencies (resolved together with the image's packages).
KIT_REQUIREMENTS = (
    "numpy>=1.24,<2",
    "tritonclient[grpc]==2.50.0",
    "aiohttp>=3.8.1,<4",
    "python-rapidjson>=0.9.1",
    "urllib3>=2.0.7",
    "protobuf>=4.21,<5",
    "redis>=5",
    "nvidia-cuda-runtime-cu12",
    "setuptools>=77",
    # geventhttpclient 2.0.2's own dependencies
    "gevent",
    "certifi",
    "six",
    "brotli",
)
#: What the GPU machine's image provides (the versions stand in for the check here).
IMAGE_PACKAGES = {
    "torch": "2.11.0",
    "onnx": "1.22.0",
    "onnxruntime": "1.22.0",
    "safetensors": "0.5.0",
    "grpcio": "1.70.0",
    "pytest": "8.3.0",
    "matplotlib": "3.10.0",
}
IMAGE_REQUIREMENTS = (
    "torch>=2.3",
    "onnx>=1.16",
    "onnxruntime>=1.18",
    "safetensors>=0.4",
    "grpcio>=1.41",
    "pytest>=8",
    "matplotlib>=3.7",
)
LIBB64 = "libb64.so.0d"
KIT_FORMAT = 1  # bump when the kit's layout or requirement lists change
PERF_BATCHES = (64, 256)
PERF_CONCURRENCY = (1, 2, 4, 8, 16)
BENCH_PART = 0  # the bench: one call of at most 8 minutes (``run`` without ``--part``)
PARTS = (BENCH_PART, 1, 2, 3, 4, 5)  # one call each
#: part 5's ``recserve bench-longseq`` grid (with ``--quick``'s users and held-out users)
LONGSEQ_GRID = ("--rates", "20,40,60", "--rounds", "5", "--seconds", "2")
LONGSEQ_DRY = ("--rates", "25", "--rounds", "2", "--seconds", "0.5")
BENCH_DEADLINE_S = 470.0  # the bench's call stops starting steps then (8 minutes, the outputs included)
P99_BOUND_MS = 10.0  # gpu_served_rows_per_s: the best served point with p99 within this
INSTANCES = (1, 2, 4)
LOOKUP_INSTANCES = (1, 2, 4, 8)
CUDA_TESTS = (
    "tests/unit/test_dense_parity.py",
    "tests/unit/test_device_cache.py",
    "tests/unit/test_device_tier.py",
    "tests/unit/test_device_transform.py",
    "tests/unit/test_tensorrt_engine.py",
    "tests/unit/test_serving_plan.py",
    "tests/integration/test_device_l1.py",
)


@dataclass(frozen=True)
class BenchSizes:
    """What the bench measures: full size on a GPU, tiny in a dry run (``device="cpu"``)."""

    train_rows: int  # the bench repository's training rows (the served shapes do not depend on them)
    holdout_rows: int
    history: int  # one user's history length in the candidate lists and the bound
    bound: tuple[tuple[int, int], ...]  # the bound's batches: (users, candidates per user)
    rows_batch: int  # rows per row-layout request (capped at the served maximum)
    lists: tuple[int, ...]  # candidates per list (one user)
    concurrency: tuple[int, ...]  # requests in flight
    bytes_lists: tuple[int, ...]  # the BYTES form, for comparison
    bytes_concurrency: tuple[int, ...]
    seconds: float  # per served point
    bound_seconds: float  # per bound batch

    def as_dict(self) -> dict[str, Any]:
        """For the summary."""
        return asdict(self)


BENCH = BenchSizes(
    train_rows=20_000,
    holdout_rows=2_000,
    history=256,
    bound=((1, 1024), (1, 4096), (4, 4096)),
    rows_batch=1024,
    lists=(4096, 1024, 256),
    concurrency=(1, 2, 4, 8, 16),
    bytes_lists=(1024,),
    bytes_concurrency=(1, 4, 16),
    seconds=2.0,
    bound_seconds=2.0,
)
BENCH_DRY = BenchSizes(
    train_rows=2_000,
    holdout_rows=500,
    history=32,
    bound=((1, 32), (2, 64)),
    rows_batch=16,
    lists=(64, 16),
    concurrency=(1, 2),
    bytes_lists=(16,),
    bytes_concurrency=(1,),
    seconds=0.3,
    bound_seconds=0.3,
)
#: The issue's targets on one H100 or H200: (key, what, candidates per list, p99 bound ms, at least)
TARGETS = (
    ("lists_4096", "served candidate rows/s, lists of 4,096, p99 <= 10 ms", 4096, 10.0, 1_500_000.0),
    ("lists_1024", "served candidate rows/s, lists of 1,024, p99 <= 5 ms", 1024, 5.0, 500_000.0),
)
SERVED_VS_BOUND_TARGET = 0.6


def log(message: str) -> None:
    """Progress on stderr."""
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


def find_root() -> Path:
    """The working tree: the current folder when it is recserve's, else the one holding this package."""
    for candidate in (Path.cwd(), Path(__file__).resolve().parents[2]):
        marker = candidate / "perf" / "gpu_check" / "__init__.py"
        if marker.is_file() and (candidate / "pyproject.toml").is_file():
            return candidate
    raise SystemExit("error: run from the recserve working tree")


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tail(text: str, lines: int = 15) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.strip().splitlines()[-lines:])
